"""The index benchmark's options and run: every phase in order against a private redis-server."""

from __future__ import annotations

import argparse
import asyncio
import platform
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from launcher.local_redis import RedisServer
from loadtests.bench_index.corpus import Corpus, build_corpus, write_corpus
from loadtests.bench_index.lookups import bootstraps, lookup_latencies, memory_per_block
from loadtests.bench_index.settings import (
    BENCH,
    BOOTSTRAP_REPEATS,
    FULL,
    FULL_MATCH_REPLICAS,
    PARTIAL_MATCH_REPLICAS,
    QUICK,
    Settings,
    progress,
)
from loadtests.bench_index.stream import publish_and_apply
from loadtests.bench_index.tables import checks, preamble, tables
from loadtests.harness import ComponentBenchmark, Measurement, package_version
from loadtests.options import Sizes


def resolve_settings(args: argparse.Namespace, sizes: dict[str, Any]) -> Settings:
    s = Settings(out=args.out, **sizes)
    if s.replicas < FULL_MATCH_REPLICAS + PARTIAL_MATCH_REPLICAS:
        raise SystemExit(f"--replicas must be at least {FULL_MATCH_REPLICAS + PARTIAL_MATCH_REPLICAS}")
    if not 2 <= s.prompt_blocks <= s.blocks:
        raise SystemExit("--prompt-blocks must be at least 2 and at most --blocks")
    if s.lookups < 1:
        raise SystemExit("--lookups must be positive")
    return s


def written_corpus(s: Settings, server: RedisServer, rng: np.random.Generator) -> Corpus:
    """A fresh corpus, written into the emptied server."""
    client = server.client()
    try:
        client.flushall()
        progress(f"building and writing a corpus of {s.blocks:,} blocks over {s.replicas} replicas")
        corpus = build_corpus(rng, s.blocks, s.replicas, s.prompt_blocks)
        write_corpus(client, corpus)
    finally:
        client.close()
    return corpus


def measure_phases(s: Settings, server: RedisServer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every phase, in order; returns the results and the corpus's shape."""
    rng = np.random.default_rng(0)
    results = asyncio.run(publish_and_apply(server.url, s.blocks, rng))
    if results["publisher_heartbeat_lowest_ttl_ms"] < 0:
        progress(
            "warning: the burst starved the publisher's heartbeat past its TTL; a mirror polling "
            f"then drops the replica (the live mirror applied {results['mirror_hashes_applied']:,.0f} "
            "hashes from the stream, the rest from a reload of the set)"
        )
    corpus = written_corpus(s, server, rng)
    progress("memory of a bootstrapped mirror (tracemalloc)")
    results |= memory_per_block(server.url, corpus)
    progress(f"bootstrap time, {BOOTSTRAP_REPEATS} fresh mirrors")
    timings, index = bootstraps(server.url, corpus)
    results |= timings
    results["lookup_us"] = lookup_latencies(index, corpus, s.lookups, rng)
    shape = {
        "blocks": corpus.blocks,
        "chains": len(corpus.chains),
        "replicas": s.replicas,
        "pairs": corpus.pairs,
        "pairs_per_block": corpus.pairs / corpus.blocks,
    }
    return results, shape


def measure(s: Settings) -> Measurement:
    with tempfile.TemporaryDirectory(prefix="bench_index.") as workdir:
        server = RedisServer(Path(workdir))
        server.start()
        try:
            with server.client() as client:
                redis_version = client.info("server")["redis_version"]
            results, shape = measure_phases(s, server)
        finally:
            server.stop()
    machine = {
        "python": platform.python_version(),
        "redis_server": redis_version,
        "redis_py": package_version("redis"),
        "hiredis": package_version("hiredis"),
    }
    report = {"settings": asdict(s), "corpus": shape, "results": results, "checks": checks(results)}
    return Measurement(machine, report)


DESCRIPTION = "Benchmark the Redis cache index: publisher, mirror, lookups (needs redis-server)."
BENCHMARK = ComponentBenchmark(
    BENCH, DESCRIPTION, Sizes(FULL, QUICK), resolve_settings, measure, preamble, tables
)
main = BENCHMARK.main
