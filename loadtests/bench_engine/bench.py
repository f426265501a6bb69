"""The engine benchmark's options and orchestration: one worker process per (engine, dtype) group,
one at a time, and the memory read bandwidth measured here, in the parent."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtests.bench_engine.settings import (
    BANDWIDTH_TRIES,
    BENCH,
    DTYPES,
    ENGINES,
    FULL,
    QUICK,
    Settings,
    progress,
)
from loadtests.bench_engine.tables import checks, derive, preamble, tables
from loadtests.harness import ComponentBenchmark, Measurement, package_version
from loadtests.options import Sizes


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from: fp32, bf16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker (default 2)")
    parser.add_argument("--skip-transformers", action="store_true", help="measure our engine only")


def resolve_settings(args: argparse.Namespace, sizes: dict[str, Any]) -> Settings:
    """The options and the chosen sizes, checked; the default model is prepared if needed."""
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if unknown := set(dtypes) - set(DTYPES):
        raise SystemExit(f"unknown dtype(s) {sorted(unknown)}; choose from {', '.join(DTYPES)}")
    if sizes["new_tokens"] < 2:
        raise SystemExit("--new-tokens must be at least 2 (ms/step needs decode steps)")
    model = args.model
    if model is None:
        from replica.tools.prepare_model import prepare_default_model

        model = prepare_default_model(progress=progress)
    return Settings(
        model=str(Path(model).resolve()),
        dtypes=dtypes,
        concurrency=[int(n) for n in str(sizes.pop("concurrency")).split(",")],
        threads=args.threads,
        skip_transformers=args.skip_transformers,
        out=args.out,
        **sizes,
    )


def run_group(s: Settings, engine: str, dtype: str, workdir: Path) -> dict[str, Any]:
    """Runs one (engine, dtype) group in a fresh interpreter and returns its measurements."""
    progress(f"{engine} {dtype}: starting worker")
    result_path = workdir / f"{engine}-{dtype}.json"
    task = {"settings": asdict(s), "engine": engine, "dtype": dtype, "result_path": str(result_path)}
    env = os.environ | {
        "OMP_NUM_THREADS": str(s.threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    command = [sys.executable, "-m", "loadtests.bench_engine.worker", json.dumps(task)]
    subprocess.run(command, env=env, stdout=2, check=True)  # worker chatter stays off our stdout
    return json.loads(result_path.read_text())


def measure_read_bandwidth(mib: int, threads: int) -> float:
    """Bytes/s that ``threads`` torch threads read from a float32 tensor far larger than the caches.

    Batch-1 decode must stream every weight once per step with those same threads, so weights /
    this is its floor (a single-threaded numpy sum reads about half as fast here).
    """
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(BANDWIDTH_TRIES):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def collect(s: Settings, bandwidth: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Runs every group, one subprocess at a time; returns per-dtype results and the checks."""
    engines = ENGINES[:1] if s.skip_transformers else ENGINES
    results: dict[str, Any] = {}
    all_checks: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_engine.") as workdir:
        for dtype in s.dtypes:
            measured = {engine: run_group(s, engine, dtype, Path(workdir)) for engine in engines}
            derived = derive(measured["ours"], measured.get("transformers"), bandwidth)
            results[dtype] = measured | {"derived": derived}
            all_checks += checks(s, dtype, measured["ours"], derived)
    return results, all_checks


def measure(s: Settings) -> Measurement:
    progress(f"measuring memory read bandwidth over {s.bandwidth_mib} MiB")
    bandwidth = measure_read_bandwidth(s.bandwidth_mib, s.threads)
    results, all_checks = collect(s, bandwidth)
    machine = {
        "threads": s.threads,
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "python": platform.python_version(),
    }
    return Measurement(
        machine,
        {
            "settings": asdict(s),
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "results": results,
            "checks": all_checks,
        },
    )


DESCRIPTION = "Benchmark the replica engine against transformers generate (CPU)."
SIZES = Sizes(FULL, QUICK, quick_help="tiny sizes")
BENCHMARK = ComponentBenchmark(
    BENCH, DESCRIPTION, SIZES, resolve_settings, measure, preamble, tables, add_options
)
main = BENCHMARK.main
