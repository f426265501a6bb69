"""The index benchmark's checks against its targets, its table and its preamble."""

from __future__ import annotations

from typing import Any

from loadtests.bench_index.settings import (
    BOOTSTRAP_REPEATS,
    BOOTSTRAP_TARGET_S,
    FULL_MATCH_REPLICAS,
    LOOKUP_P99_TARGET_US,
    PARTIAL_MATCH_REPLICAS,
    PREDICTED_REPLICAS,
    Settings,
)
from loadtests.harness import check, markdown_table, verdict

TARGET_TEXT = {
    "lookup_p99_us": f"p99 ≤ {LOOKUP_P99_TARGET_US:g} µs",
    "lookup_with_predictions_p99_us": f"p99 ≤ {LOOKUP_P99_TARGET_US:g} µs",
    "bootstrap_s": f"≤ {BOOTSTRAP_TARGET_S:g} s",
    "publisher_heartbeat_lowest_ttl_ms": "> 0 (never expired)",
}


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    lookups = results["lookup_us"]
    return [
        check("lookup_p99_us", lookups["full_match"]["p99"], LOOKUP_P99_TARGET_US),
        check(
            "lookup_with_predictions_p99_us",
            lookups["full_match_with_predictions"]["p99"],
            LOOKUP_P99_TARGET_US,
        ),
        check("bootstrap_s", results["bootstrap_s"], BOOTSTRAP_TARGET_S),
        check("publisher_heartbeat_lowest_ttl_ms", results["publisher_heartbeat_lowest_ttl_ms"], 1, True),
    ]


Row = tuple[str, str, str | None]  # label, value, check


def stream_rows(s: Settings, r: dict[str, Any]) -> list[Row]:
    """1 and 2: the publisher and the mirrors."""

    def rate(key: str) -> str:
        return f"{r[key]:,.0f}"

    return [
        (
            f"publish throughput, 1 replica, {s.blocks:,} hashes (hashes/s)",
            rate("publish_hashes_per_s"),
            None,
        ),
        (
            "publisher heartbeat TTL left, lowest during the burst (ms; −2: expired)",
            str(r["publisher_heartbeat_lowest_ttl_ms"]),
            "publisher_heartbeat_lowest_ttl_ms",
        ),
        (
            "mirror apply rate, tailing live in its own process (hashes/s)",
            rate("mirror_apply_hashes_per_s"),
            None,
        ),
        ("mirror lag gauge when the live mirror held them all (s)", f"{r['mirror_lag_s']:.3f}", None),
        ("mirror apply rate, catching up alone (hashes/s)", rate("mirror_catch_up_hashes_per_s"), None),
    ]


def index_rows(s: Settings, r: dict[str, Any]) -> list[Row]:
    """5, then 4 and 3: lookups, bootstrap, memory."""
    lookups = r["lookup_us"]

    def latency(name: str) -> str:
        return " / ".join(f"{lookups[name][q]:.1f}" for q in ("p50", "p99", "max"))

    where = f"{s.replicas} replicas, {s.blocks:,} blocks"
    quantiles = "p50 / p99 / max (µs)"
    memory = f"{r['memory_bytes_per_block_tracemalloc']:.0f} / {r['memory_bytes_per_block_estimate']:.0f}"
    return [
        (
            f"`lookup`, {s.prompt_blocks}-block prompt fully matched, {where}: {quantiles}",
            latency("full_match"),
            "lookup_p99_us",
        ),
        (
            f"`lookup_with_predictions`, same prompt: {quantiles}",
            latency("full_match_with_predictions"),
            "lookup_with_predictions_p99_us",
        ),
        (f"`lookup`, miss at block 0: {quantiles}", latency("miss"), None),
        (f"`lookup_with_predictions`, miss at block 0: {quantiles}", latency("miss_with_predictions"), None),
        (
            f"bootstrap of a fresh mirror, {where} (s, median of {BOOTSTRAP_REPEATS})",
            f"{r['bootstrap_s']:.3f}",
            "bootstrap_s",
        ),
        ("mirror memory per indexed block: tracemalloc / `bytes_per_block()` (B)", memory, None),
    ]


def tables(report: dict[str, Any]) -> list[str]:
    s, results = Settings(**report["settings"]), report["results"]
    outcome = {c["check"]: c["passed"] for c in report["checks"]}
    rows = []
    for label, value, name in [*stream_rows(s, results), *index_rows(s, results)]:
        target, passed = (TARGET_TEXT[name], verdict(outcome[name])) if name else ("", "")
        rows.append([label, value, target, passed])
    return [markdown_table(["metric", "value", "target", "pass"], rows)]


def preamble(report: dict[str, Any]) -> list[str]:
    m, c = report["machine"], report["corpus"]
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores; redis-server {m['redis_server']} (loopback, no "
        f"persistence); Python {m['python']}; redis-py {m['redis_py']}, hiredis {m['hiredis']}.",
        f"Corpus: {c['blocks']:,} blocks in {c['chains']:,} chains of shared prefixes over "
        f"{c['replicas']} replicas, {c['pairs']:,} (replica, block) pairs ({c['pairs_per_block']:.2f} "
        f"per block); the prompt is fully held by {FULL_MATCH_REPLICAS} replicas, partly by "
        f"{PARTIAL_MATCH_REPLICAS}, {PREDICTED_REPLICAS} of which are predicted to hold it all. "
        f"Latencies: {report['settings']['lookups']:,} calls each, GC off, perf_counter_ns.",
    ]
