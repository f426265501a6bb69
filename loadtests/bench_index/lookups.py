"""3 to 5 of :mod:`loadtests.bench_index`: memory per indexed block and bootstrap time of fresh
mirrors over the corpus, and lookup latency on the index the last bootstrap built."""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gateway.index.block_index import BlockIndex
from gateway.index.mirror import IndexMirror
from loadtests.bench_index.corpus import Corpus, replica_id
from loadtests.bench_index.settings import (
    BOOTSTRAP_REPEATS,
    MODEL,
    PREDICTED_REPLICAS,
    PREDICTION_TTL_S,
    WARMUP_LOOKUPS,
    progress,
    random_hashes,
)

# -- 3 and 4: bootstrap time, memory per block ---------------------------------------------------


async def bootstrap(redis_url: str, corpus: Corpus) -> tuple[float, BlockIndex]:
    """Seconds a fresh mirror's ``start()`` takes (it returns bootstrapped), and its index."""
    mirror = IndexMirror(redis_url)
    started = time.perf_counter()
    await mirror.start()
    seconds = time.perf_counter() - started
    await mirror.stop()
    index = mirror.index
    if index.size != corpus.blocks or index.num_replicas != len(corpus.holdings):
        raise RuntimeError(
            f"bootstrap loaded {index.size:,} blocks of {index.num_replicas} replicas, expected "
            f"{corpus.blocks:,} of {len(corpus.holdings)}"
        )
    return seconds, index


def memory_per_block(redis_url: str, corpus: Corpus) -> dict[str, float]:
    """Bytes the allocator holds for a bootstrapped mirror, per distinct block (a bootstrap of its
    own: tracing slows allocation several times over), beside the index's own estimate."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = asyncio.run(bootstrap(redis_url, corpus))[1]
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return {
        "memory_bytes_per_block_tracemalloc": used / index.size,
        "memory_bytes_per_block_estimate": index.bytes_per_block(),
    }


def bootstraps(redis_url: str, corpus: Corpus) -> tuple[dict[str, Any], BlockIndex]:
    """Median of ``BOOTSTRAP_REPEATS`` bootstraps, and the last one's index."""
    samples = []
    for _ in range(BOOTSTRAP_REPEATS):
        seconds, index = asyncio.run(bootstrap(redis_url, corpus))
        samples.append(seconds)
    return {"bootstrap_s": statistics.median(samples), "bootstrap_samples_s": samples}, index


# -- 5: lookup latency ---------------------------------------------------------------------------

LookupFn = Callable[[str, Sequence[int]], object]


def check_matches(index: BlockIndex, corpus: Corpus, prompt: list[int], miss: list[int]) -> None:
    """The prompt must be walked to its end (the worst case) and the miss must stop at block 0."""
    found = index.lookup(MODEL, prompt)
    full = sorted(rid for rid, depth in found.items() if depth == len(prompt))
    if full != sorted(map(replica_id, corpus.full_match)):
        raise RuntimeError(f"prompt fully matched on {full}, expected the corpus's full-match replicas")
    if any(index.lookup(MODEL, miss).values()):
        raise RuntimeError("the miss prompt matched something")


def time_calls(lookup: LookupFn, hashes: list[int], count: int) -> list[int]:
    """Nanoseconds per call; GC off meanwhile, so a collection other code triggered is not in a sample."""
    for _ in range(WARMUP_LOOKUPS):
        lookup(MODEL, hashes)
    samples = [0] * count
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(count):
            started = clock()
            lookup(MODEL, hashes)
            samples[i] = clock() - started
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def latency_us(samples: list[int]) -> dict[str, float]:
    p50, p99 = np.percentile(samples, [50, 99]) / 1000
    return {
        "p50": float(p50),
        "p99": float(p99),
        "max": max(samples) / 1000,
        "mean": statistics.mean(samples) / 1000,
    }


def lookup_latencies(
    index: BlockIndex, corpus: Corpus, count: int, rng: np.random.Generator
) -> dict[str, dict[str, float]]:
    """p50/p99/max/mean µs of a full match and of a miss at block 0, with and without predictions
    (some partial holders predicted to hold the whole prompt, as after routing it there)."""
    prompt, miss = corpus.prompt(), random_hashes(rng, corpus.prompt_blocks).tolist()
    check_matches(index, corpus, prompt, miss)
    for replica in corpus.partial_match[:PREDICTED_REPLICAS]:
        index.predict(replica_id(replica), prompt, PREDICTION_TTL_S)
    cases: dict[str, tuple[LookupFn, list[int]]] = {
        "full_match": (index.lookup, prompt),
        "miss": (index.lookup, miss),
        "full_match_with_predictions": (index.lookup_with_predictions, prompt),
        "miss_with_predictions": (index.lookup_with_predictions, miss),
    }
    latencies = {}
    for name, (lookup, hashes) in cases.items():
        progress(f"  {count:,} lookups: {name}")
        latencies[name] = latency_us(time_calls(lookup, hashes, count))
    return latencies
