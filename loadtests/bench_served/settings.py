"""The served benchmark's sizes, workloads, targets and settings."""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.harness import reporter
from replica.engine.config import EngineConfig

BENCH = "bench_served"
# The replica's options a run may set (its step budgets): the served replica and the in-process
# engine both take them; vLLM keeps its own.
ENGINE_OPTIONS = ("max_num_batched_tokens", "max_prefill_step_tokens")
progress = reporter(BENCH)

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {
    "decode_prompts_1": 8,  # random prompts at concurrency 1
    # ... and at concurrency 16: eight waves, as the p50 of a wave falls where one prefill step ends
    # and the next begins, and four left gateway / direct anywhere in 0.86-1.30 on no change
    "decode_prompts_16": 128,
    "input_len": 128,
    "output_len": 64,
    "prefix_prompts": 32,  # prefix repetition: requests, each one of 4 prefixes + its own suffix
    "prefix_len": 1536,
    "cold_prompts": 8,  # cold prefills of cold_len tokens, one token out
    "cold_len": 1024,
    "threads": 2,
}
QUICK = {
    "decode_prompts_1": 2,
    "decode_prompts_16": 8,
    "input_len": 32,
    "output_len": 8,
    "prefix_prompts": 4,
    "prefix_len": 128,
    "cold_prompts": 1,
    "cold_len": 128,
    "threads": 2,
}
NUM_PREFIXES = 4
PREFIX_SUFFIX_LEN = 32
PREFIX_OUTPUT_LEN = 8
PREFIX_CONCURRENCY = 2
# The prefix case runs whole, in passes taking turns with the other servers'. Its p50 falls between
# two groups of hits, and with two passes a server the gateway's read 0.97-1.14 of direct's over
# runs while the same requests, paired, took 3 ms longer through it (~85 ms hits); four passes
# halve the variance of a server's figures.
PREFIX_PASSES = 4
WARMUP_REQUESTS = 2

# Targets.
VS_VLLM_TARGET = 1.0  # served output tok/s / vLLM's, at each concurrency
VS_ENGINE_TARGET = 0.9  # served output tok/s / the in-process engine's
GATEWAY_TARGET = 0.95  # through the gateway / direct


@dataclass
class Settings:
    """Resolved options; ``vllm`` is the vLLM virtualenv, or None to leave vLLM out."""

    model: str
    vllm: str | None
    decode_prompts_1: int
    decode_prompts_16: int
    input_len: int
    output_len: int
    prefix_prompts: int
    prefix_len: int
    cold_prompts: int
    cold_len: int
    threads: int
    dtype: str  # both servers' and the in-process engine's
    temperature: float  # every request's; 0: greedy
    out: str
    max_num_batched_tokens: int  # the replica's step budgets, served and in-process alike
    max_prefill_step_tokens: int

    def engine_options(self) -> dict[str, int]:
        """The values of ``ENGINE_OPTIONS``, by the replica's field names."""
        return {name: getattr(self, name) for name in ENGINE_OPTIONS}

    def engine_config(self) -> EngineConfig:
        """The in-process engine's settings: the served replica's (``servers.replica_command``)."""
        return EngineConfig(model=self.model, dtype=self.dtype, threads=self.threads, **self.engine_options())
