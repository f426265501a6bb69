"""`kvroute bench serve` and `kvroute bench compare` as a user runs them, against real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.local_redis import free_port
from tests.helpers.processes import ReplicaProcess, running_stack


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "bench", *args, "--disable-tqdm"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# slow: a two-point sweep of the benchmark; `bench serve` itself is covered by the plain-replica test
@pytest.mark.slow
def test_serve_sweep_through_the_gateway(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    with running_stack(llama_dir, tmp_path, 2) as stack:
        result = _bench(
            "serve",
            "--base-url", stack.gateway.url,
            "--tokenizer", str(llama_dir),
            "--dataset", "multi-turn",
            "--num-prompts", "24",
            "--turns", "3",
            "--document-len", "100:200",
            "--input-len", "12",
            "--output-len", "6",
            "--ignore-eos",
            "--max-concurrency", "2", "4",
            "--out", str(out),
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("============ Serving Benchmark Result ============") == 2
    report = json.loads(out.read_text())
    assert report["dataset"] == "multi-turn" and report["num_requests"] == 24
    for point in report["results"]:
        assert point["completed"] == 24 and point["failed"] == 0
        assert point["total_output_tokens"] == 24 * 6  # --ignore-eos: exactly max_tokens each
        assert sum(point["requests_per_replica"].values()) == 24
        # Turns 2 and 3 resend the history: the kv gateway keeps each conversation where it is cached.
        assert point["cached_token_ratio"] > 0.5
        assert point["cached_token_ratio"] <= point["oracle_cached_token_ratio"] + 0.02
        assert point["mean_ttft_ms"] > 0 and point["p99_e2el_ms"] >= point["median_e2el_ms"]
    assert [p["max_concurrency"] for p in report["results"]] == [2, 4]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_serve_against_a_plain_replica_and_a_dead_url(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "random.json"
    with ReplicaProcess(
        llama_dir, tmp_path / "replica.log", "--dtype", "float32", "--kv-cache-tokens", "8192"
    ) as replica:
        replica_url = replica.url
        result = _bench(
            "serve", "--base-url", replica_url, "--tokenizer", str(llama_dir), "--dataset", "random",
            "--num-prompts", "10", "--input-len", "40", "--output-len", "4", "--endpoint", "/v1/completions",
            "--out", str(out),
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    point = json.loads(out.read_text())["results"][0]
    assert point["completed"] == 10 and point["requests_per_replica"] == {}
    assert 35 * 10 <= point["total_input_tokens"] <= 45 * 10
    dead = _bench("serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--tokenizer", str(llama_dir))
    assert dead.returncode != 0
    assert "cannot list the models" in dead.stderr and "Traceback" not in dead.stderr


def test_python_dash_m_loadtests_is_the_bench_cli(llama_dir: Path) -> None:
    """`python -m loadtests ARGS` is what `kvroute bench ARGS` runs: its help, its one-line errors."""
    run = [sys.executable, "-m", "loadtests"]
    help_text = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "{serve,compare}" in help_text.stdout
    dead = subprocess.run(
        [*run, "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--tokenizer", str(llama_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dead.returncode != 0
    assert "kvroute bench: error: cannot list the models" in dead.stderr and "Traceback" not in dead.stderr


# slow: a benchmark of two policies on two fresh stacks; routing itself is what tests/stack/
# test_chat_affinity.py and test_gateway_e2e.py check
@pytest.mark.slow
def test_compare_kv_beats_round_robin_on_cached_tokens(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    result = _bench(
        "compare",
        "--model-dir", str(llama_dir),
        "--replicas", "2",
        "--policies", "kv", "round-robin",
        "--no-sglang",
        "--replica-arg=--dtype=float32",
        "--dataset", "multi-turn",
        "--num-prompts", "32",
        "--turns", "4",
        "--num-documents", "8",
        "--document-len", "150:250",
        "--input-len", "12",
        "--output-len", "6",
        "--ignore-eos",
        "--max-concurrency", "4",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    by_policy = {row["policy"]: row for row in report["results"]}
    kv, round_robin = by_policy["kv"], by_policy["round-robin"]
    for row in (kv, round_robin):
        assert row["completed"] == 32 and row["failed"] == 0
        assert sum(row["requests_per_replica"]) == 32  # counted by the replicas themselves
    assert kv["cached_token_ratio"] > round_robin["cached_token_ratio"] + 0.1
    assert kv["cached_ratio_of_oracle"] > 0.8
    assert kv["predicted_cached_tokens"] is not None
    assert "policy" in report["table"] and out.with_suffix(".png").exists()
