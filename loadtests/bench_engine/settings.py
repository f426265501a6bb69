"""The engine benchmark's sizes, targets and settings."""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.harness import reporter

BENCH = "bench_engine"
progress = reporter(BENCH)

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
ENGINES = ("ours", "transformers")

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {
    "concurrency": "1,8,16",
    "new_tokens": 64,
    "prompt_tokens": 128,
    "ttft_prompt_tokens": 2000,
    "rss_requests": 1000,
    "repeats": 3,
    "bandwidth_mib": 1024,
}
QUICK = {
    "concurrency": "1,4",
    "new_tokens": 8,
    "prompt_tokens": 32,
    "ttft_prompt_tokens": 128,
    "rss_requests": 40,
    "repeats": 1,
    "bandwidth_mib": 64,
}

# The memory soak: many short requests in waves; RSS after the first tenth is the baseline.
RSS_PROMPT_TOKENS = 32
RSS_NEW_TOKENS = 4
RSS_WAVE = 32
RSS_BASELINE_FRACTION = 0.1
RSS_NOISE_MB = 10.0  # growth allowed: this, or RSS_NOISE_FRACTION of the baseline if larger
RSS_NOISE_FRACTION = 0.02

# Targets (ratios).
DECODE_SPEEDUP_TARGET = 2.0  # ours / transformers tok/s at the highest concurrency
TTFT_CACHE_SPEEDUP_TARGET = 20.0  # cold / cached-prefix TTFT
FLOOR_RATIO_TARGET = 2.0  # batch-1 ms/step / bandwidth floor

WARMUP_NEW_TOKENS = 2
BANDWIDTH_TRIES = 5


@dataclass
class Settings:
    """Resolved options; travels to each worker as JSON."""

    model: str
    dtypes: list[str]
    concurrency: list[int]
    new_tokens: int
    prompt_tokens: int
    ttft_prompt_tokens: int
    rss_requests: int
    repeats: int
    bandwidth_mib: int
    threads: int
    skip_transformers: bool
    out: str
