"""The index benchmark's sizes, targets, names and settings, and the helpers its phases share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from kvroute.protocol import Keys
from loadtests.harness import reporter

BENCH = "bench_index"
progress = reporter(BENCH)

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {"blocks": 1_000_000, "replicas": 64, "prompt_blocks": 512, "lookups": 20_000}
QUICK = {"blocks": 20_000, "replicas": 16, "prompt_blocks": 64, "lookups": 2_000}

MODEL = "bench-model"
FINGERPRINT = "bench"
KEYS = Keys()
PUBLISHER_ID = "bench-publisher:8000"

APPEND_HASHES = 1_000  # hashes per outbox append
CHAIN_BLOCKS = 1_000  # mean chain length: 1,000 chains for 1,000,000 blocks
FULL_MATCH_REPLICAS = 4  # replicas holding the whole measured prompt
PARTIAL_MATCH_REPLICAS = 8  # replicas holding a shorter prefix of it
PREDICTED_REPLICAS = 2  # of the partial ones, predicted to hold it all
MAX_SHARERS = 3  # replicas besides its owner holding a prefix of any other chain
PREDICTION_TTL_S = 3600.0  # outlives the run: no prediction expires mid-measurement
SADD_MEMBERS = 10_000  # members per SADD when writing the corpus
BOOTSTRAP_REPEATS = 3
WARMUP_LOOKUPS = 200
POLL_S = 0.002  # how often completion is polled
FRESH_HEARTBEAT_MS = 1000  # TTL left on a heartbeat refreshed within the last second (defaults: 2 s, 0.5 s)
SECONDS_PER_HASH = 20e-6  # generous deadline slack for the publish and apply phases

LOOKUP_P99_TARGET_US = 100.0
BOOTSTRAP_TARGET_S = 2.0


@dataclass(frozen=True)
class Settings:
    blocks: int
    replicas: int
    prompt_blocks: int
    lookups: int
    out: str


def random_hashes(rng: np.random.Generator, count: int) -> np.ndarray:
    """Uniform 64-bit values: as good as chained xxh3 hashes for dicts, and a million in milliseconds."""
    return np.frombuffer(rng.bytes(8 * count), dtype="<u8")


async def poll_until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_S)


def phase_timeout(blocks: int) -> float:
    return 30 + blocks * SECONDS_PER_HASH
