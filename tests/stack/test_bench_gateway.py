"""Smoke test of the gateway-overhead benchmark: ``--quick`` sizes against a real replica (tiny test
model), a real gateway and a private redis-server, so the whole pipeline (processes, alternated
sequential requests, concurrent phases, CPU accounting, checks, table, JSON) runs in seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loadtests import bench_gateway

MODE_KEYS = {
    "latency_ms",
    "added_ms",
    "req_s",
    "cpu_share_pct",
    "cpu_us_per_request",
    "cpu_bound_req_s",
}
CHECKS = {
    f"{mode}.{name}"
    for mode in bench_gateway.MODES
    for name in ("added_p50_ms", "cpu_us_per_request", "req_s")
}


def test_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r" / "bench_gateway.json"
    started = time.monotonic()
    assert bench_gateway.main(["--quick", "--out", str(out)]) == 0
    assert time.monotonic() - started < 40

    report = json.loads(out.read_text())
    results = report["results"]
    assert results.keys() == set(bench_gateway.MODES)
    sides = {"direct", "gateway"} | ({"sglang_router"} if report["sglang_router"] else set())
    for r in results.values():
        assert r.keys() == MODE_KEYS
        assert r["latency_ms"].keys() == sides
        assert all(
            q.keys() == {"p50", "p99", "mean"} and min(q.values()) > 0 for q in r["latency_ms"].values()
        )
        assert r["added_ms"].keys() == sides - {"direct"}
        assert all(a.keys() == {"p50", "p99"} for a in r["added_ms"].values())
        assert r["req_s"].keys() == sides and min(r["req_s"].values()) > 0
        assert r["cpu_share_pct"].keys() == sides
        assert all(c.keys() == {"proxy", "replica", "client"} for c in r["cpu_share_pct"].values())
        assert r["cpu_share_pct"]["direct"]["proxy"] == 0
        assert r["cpu_us_per_request"].keys() == r["cpu_bound_req_s"].keys() == sides - {"direct"}
        for cpu in r["cpu_us_per_request"].values():
            assert cpu.keys() == {"sequential", "concurrent"} and cpu["concurrent"] > 0  # work under load
        assert min(r["cpu_bound_req_s"].values()) > 0
    assert {c["check"] for c in report["checks"]} == CHECKS
    tokenization = report["tokenization"]
    assert tokenization["turns"] == bench_gateway.TOKENIZE_TURNS
    assert tokenization["prompt_tokens"] >= bench_gateway.TOKENIZE_TOKENS
    # reusing the previous turn's ids must beat tokenizing from scratch by far
    assert tokenization["verbatim_repeat_us"] < tokenization["previous_turn_cached_us"]
    assert 3 * tokenization["previous_turn_cached_us"] < tokenization["from_scratch_us"]
    clients = report["upstream_clients"]
    cases = {f"{mode}.c{c}" for mode in bench_gateway.MODES for c in (1, bench_gateway.CONCURRENCY)}
    assert clients.keys() == {"httpx", "aiohttp", "gateway.upstream"}
    assert all(row.keys() == cases and min(row.values()) > 0 for row in clients.values())
    assert all(isinstance(c["passed"], bool) for c in report["checks"])

    table = capsys.readouterr().out
    assert table.strip() == report["table"].strip()
    assert "`instant` profile" in table and report["settings"]["replica_engine"] == "sim"
    assert ("not installed" in table) != report["sglang_router"]
