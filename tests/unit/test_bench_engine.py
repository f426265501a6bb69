"""Smoke test of the engine benchmark script: ``--quick`` sizes on the tiny Llama, so the whole
pipeline (workers, transformers comparison, checks, table, JSON) runs in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests import bench_engine

OURS_METRICS = {
    "decode_tok_s",
    "decode_ms_per_step",
    "ttft_cold_s",
    "ttft_cached_s",
    "ttft_cached_tokens",
    "rss_after_first_mb",
    "rss_after_all_mb",
    "weight_bytes",
    "peak_rss_mb",
}
TRANSFORMERS_METRICS = {"decode_tok_s", "decode_ms_per_step", "prefill_s", "ttft_cold_s", "peak_rss_mb"}


def numbers(tree: Any) -> list[float]:
    if isinstance(tree, dict):
        return [x for value in tree.values() for x in numbers(value)]
    return [tree] if isinstance(tree, int | float) and not isinstance(tree, bool) else []


def run(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    assert bench_engine.main(["--quick", *args, "--out", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


# slow: the transformers side of the benchmark; the pipeline itself runs below without it
@pytest.mark.slow
def test_quick_run_against_transformers(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, stdout = run(["--model", str(llama_dir), "--dtypes", "fp32"], tmp_path / "r" / "b.json", capsys)

    fp32 = report["results"]["fp32"]
    assert fp32["ours"].keys() >= OURS_METRICS
    assert fp32["transformers"].keys() >= TRANSFORMERS_METRICS
    assert set(fp32["ours"]["decode_tok_s"]) == set(fp32["transformers"]["decode_tok_s"]) == {"1", "4"}
    measured = numbers(fp32["ours"]) + numbers(fp32["transformers"])
    assert measured and all(x > 0 for x in measured)
    ratios = {k: v for k, v in fp32["derived"].items() if k != "rss_growth_mb"}  # growth may be <= 0
    assert all(x > 0 for x in numbers(ratios)) and None not in ratios.values()
    assert report["read_bandwidth_gb_s"] > 0
    assert {c["check"] for c in report["checks"]} == set(bench_engine.TARGET_TEXT)
    assert all(c["passed"] is not None for c in report["checks"])

    assert "| metric | fp32 ours | fp32 transformers | fp32 ratio | target | pass |" in stdout
    assert stdout.count("\n| ") == 1 + 2 + 6  # header, two decode rows, six other metrics
    assert report["table"] in stdout


def test_quick_run_of_our_engine_alone(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(llama_dir), "--dtypes", "bf16", "--skip-transformers", "--concurrency", "2"]
    report, stdout = run(args, tmp_path / "b.json", capsys)

    bf16 = report["results"]["bf16"]
    assert "transformers" not in bf16
    assert all(x > 0 for x in numbers(bf16["ours"]))
    assert bf16["ours"]["decode_ms_per_step"] > 0  # measured by an extra batch-1 run
    speedup = next(c for c in report["checks"] if c["check"] == "decode_speedup_at_top_concurrency")
    assert speedup["passed"] is None
    assert "bf16 n/a" in stdout and "| bf16 ours | bf16 transformers |" in stdout
