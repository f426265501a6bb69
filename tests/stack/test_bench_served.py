"""Smoke test of the served benchmark: ``--quick`` sizes on the tiny test model, vLLM left out, so
the whole pipeline (replica and gateway processes, every case, the in-process engine, ratios,
checks, table, JSON) runs in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import bench_served

CASES = {"decode_1", "decode_16", "prefix", "cold"}


def test_quick_run_without_vllm(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench_served.json"
    argv = ["--quick", "--vllm", "none", "--model", str(llama_dir), "--out", str(out)]
    assert bench_served.main(argv) == 0

    report = json.loads(out.read_text())
    results = report["results"]
    assert results.keys() == {"kvroute", "gateway"}, "vLLM was left out"
    for server in results.values():
        assert server.keys() == CASES
        for case in server.values():
            assert case["failed"] == 0 and case["completed"] > 0
            assert case["output_tok_s"] > 0 and case["mean_ttft_ms"] > 0
    assert results["kvroute"]["cold"]["prefill_tok_s"] > 0
    prefix = results["kvroute"]["prefix"]
    assert prefix["cached_token_ratio"] > 0, "the repeated prefixes hit the cache"
    assert prefix["hits"] > 0 and prefix["misses"] > 0
    assert prefix["hits"] + prefix["misses"] == prefix["completed"]
    assert prefix["hit_mean_ttft_ms"] > 0 and prefix["miss_mean_ttft_ms"] > 0
    assert min(report["in_process"].values()) > 0
    by_name = {c["check"]: c for c in report["checks"]}
    assert by_name["decode_1.output_tok_s.kvroute_over_vllm"]["passed"] is None  # not measured
    assert by_name["decode_16.served_over_in_process"]["value"] > 0
    printed = capsys.readouterr().out
    assert "| output tok/s, concurrency 16 |" in printed and "served / in-process" in printed
    assert "2 threads, greedy:" in printed


def test_quick_sampled_run(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--temperature 1`` run with other step budgets completes every request on every server
    and names its sampling and budgets. (The tiny random model's sampled tokens may hold no text,
    so times to the first text are not checked here.)"""
    out = tmp_path / "bench_served.json"
    argv = ["--quick", "--vllm", "none", "--model", str(llama_dir), "--out", str(out), "--temperature", "1"]
    argv += ["--max-num-batched-tokens", "64", "--max-prefill-step-tokens", "256"]
    assert bench_served.main(argv) == 0

    report = json.loads(out.read_text())
    assert report["settings"]["temperature"] == 1.0
    assert report["settings"]["max_num_batched_tokens"] == 64
    for server in report["results"].values():
        for case in server.values():
            assert case["failed"] == 0 and case["completed"] > 0 and case["output_tok_s"] > 0
    printed = capsys.readouterr().out
    assert "2 threads, sampled at temperature 1:" in printed
    assert "The replica's steps: 64 tokens, 256 in a burst." in printed
