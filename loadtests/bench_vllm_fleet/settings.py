"""The fleet benchmark's sizes, policies, target and settings."""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.harness import reporter

BENCH = "bench_vllm_fleet"
progress = reporter(BENCH)

POLICIES = ("kv", "round-robin")
VLLM_BLOCK_SIZE = 128  # vLLM's on CPUs: the pool below is counted in these

# Sizes of a full run and of a --quick smoke run; explicit options override either. The pool holds
# about half the prefixes: all of them fit across the two servers, not on each.
FULL = {
    "num_prompts": 64,
    "num_prefixes": 8,
    "prefix_len": 512,
    "suffix_len": 32,
    "output_len": 8,
    "concurrency": 4,
    "kv_blocks": 24,  # per server, of 128 tokens: 3,072 tokens
}
QUICK = {
    "num_prompts": 16,
    "num_prefixes": 4,
    "prefix_len": 256,
    "suffix_len": 16,
    "output_len": 4,
    "concurrency": 2,
    "kv_blocks": 8,
}

TTFT_TARGET = 1.0  # kv's TTFT p50 / round-robin's: kv must be lower


@dataclass
class Settings:
    model: str
    vllm: str
    dtype: str
    num_prompts: int
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    concurrency: int
    kv_blocks: int
    out: str
