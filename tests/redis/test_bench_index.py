"""Smoke test of the cache-index benchmark: ``--quick`` sizes against a private redis-server, so the
whole pipeline (publisher, mirror process, corpus, bootstraps, lookups, checks, table, JSON) runs
in seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from loadtests import bench_index

METRICS = {
    "publish_hashes_per_s",
    "publish_s",
    "publisher_heartbeat_lowest_ttl_ms",
    "mirror_apply_hashes_per_s",
    "mirror_apply_s",
    "mirror_lag_s",
    "mirror_hashes_applied",
    "mirror_catch_up_hashes_per_s",
    "mirror_catch_up_s",
    "memory_bytes_per_block_tracemalloc",
    "memory_bytes_per_block_estimate",
    "bootstrap_s",
    "bootstrap_samples_s",
    "lookup_us",
}
LOOKUP_CASES = {"full_match", "miss", "full_match_with_predictions", "miss_with_predictions"}


def numbers(tree: Any) -> list[float]:
    if isinstance(tree, dict):
        return [x for value in tree.values() for x in numbers(value)]
    if isinstance(tree, list):
        return [x for value in tree for x in numbers(value)]
    return [tree] if isinstance(tree, int | float) and not isinstance(tree, bool) else []


def test_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r" / "bench_index.json"
    started = time.monotonic()
    assert bench_index.main(["--quick", "--out", str(out)]) == 0
    assert time.monotonic() - started < 20

    report = json.loads(out.read_text())
    results = report["results"]
    assert results.keys() == METRICS
    assert results["lookup_us"].keys() == LOOKUP_CASES
    assert all(stats.keys() == {"p50", "p99", "max", "mean"} for stats in results["lookup_us"].values())
    measured = numbers(results)
    assert len(measured) == len(METRICS) - 2 + bench_index.BOOTSTRAP_REPEATS + 4 * len(LOOKUP_CASES)
    assert all(x > 0 for x in measured)

    blocks = bench_index.QUICK["blocks"]
    assert results["mirror_hashes_applied"] == blocks  # every hash came through the stream
    assert report["corpus"]["blocks"] == blocks
    assert report["corpus"]["replicas"] == bench_index.QUICK["replicas"]
    assert report["corpus"]["pairs"] > blocks  # prefixes are shared
    assert {c["check"] for c in report["checks"]} == set(bench_index.TARGET_TEXT)
    assert report["machine"]["redis_server"]

    stdout = capsys.readouterr().out
    assert report["table"] in stdout
    assert stdout.count("\n| ") == 1 + 11  # header, then one row per metric
