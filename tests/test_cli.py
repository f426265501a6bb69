"""The ``kvroute`` command line: subcommands run, and bad settings fail with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvroute.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_replica_with_a_missing_model_fails_cleanly(tmp_path: Path) -> None:
    result = kvroute("replica", "--model", str(tmp_path / "nowhere"))
    assert result.returncode != 0
    assert "no config.json" in result.stderr and "Traceback" not in result.stderr


def test_replica_with_an_unsupported_architecture_names_it(tmp_path: Path, llama_dir: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    result = kvroute("replica", "--model", str(model))
    assert result.returncode != 0
    assert "GPT2LMHeadModel" in result.stderr and "Traceback" not in result.stderr


def test_replica_rejects_a_token_budget_below_the_sequence_cap(llama_dir: Path) -> None:
    result = kvroute("replica", "--model", str(llama_dir), "--max-num-batched-tokens", "8")
    assert result.returncode != 0 and "max_num_batched_tokens" in result.stderr


def test_make_test_model_and_memory_planner(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    made = kvroute("make-test-model", "--arch", "qwen3", "--out", str(out), "--shards", "2")
    assert made.returncode == 0, made.stderr
    assert (out / "model.safetensors.index.json").is_file()
    plan = kvroute("memory", str(out), "--context", "4096", "--gpu-memory", "1")
    assert plan.returncode == 0, plan.stderr
    assert "KV" in plan.stdout


def test_the_serving_cli_does_not_load_the_load_tests() -> None:
    """DESIGN: nothing imports loadtests/; `kvroute bench` imports it only when it runs."""
    code = "import sys, kvroute.cli; sys.exit(any(m.startswith('loadtests') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    bench_help = kvroute("bench", "--help")
    assert bench_help.returncode == 0 and "{serve,compare}" in bench_help.stdout
