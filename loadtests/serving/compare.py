"""``kvroute bench compare``: the identical workload through one router per policy, side by side.

Each policy gets a fresh stack (a private Redis, R replicas with cold caches, and a gateway with
that policy); ``sglang-*`` policies put sglang-router (when installed) in front of the same kind of
fresh replicas instead. Requests per replica are read from every replica's own
``vllm:request_success_total``, so they are counted the same way behind any router.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from launcher.local_redis import free_port
from launcher.stack import LocalStack, StackSettings
from loadtests.harness import cpu_model, package_version, progress
from loadtests.serving.client import Endpoint
from loadtests.serving.serve import (
    ServePoint,
    ServeSettings,
    request_extras,
    run_point,
    settings_from_args,
    warn_if_concurrency_capped,
)
from loadtests.serving.vllm_report import save_figure

BENCH = "bench compare"
SGLANG_PREFIX = "sglang-"
SGLANG_POLICIES = ("sglang-cache_aware", "sglang-round_robin")
ROUTER_READY_TIMEOUT_S = 120


@dataclass
class PolicyResult:
    policy: str
    point: ServePoint
    requests_per_replica: list[int]

    @property
    def max_over_mean(self) -> float:
        """How far the busiest replica is above the mean (1.0: perfectly even)."""
        mean = statistics.fmean(self.requests_per_replica) if self.requests_per_replica else 0.0
        return max(self.requests_per_replica) / mean if mean else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            **self.point.as_json(),
            # counted by the replicas themselves, the same way behind every router
            "requests_per_replica": self.requests_per_replica,
            "max_over_mean_requests": self.max_over_mean,
        }


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def chosen_policies(args: argparse.Namespace) -> list[str]:
    policies = list(args.policies)
    if not args.no_sglang and sglang_installed():
        policies += [p for p in SGLANG_POLICIES if p not in policies]
    missing = [p for p in policies if p.startswith(SGLANG_PREFIX) and not sglang_installed()]
    if missing:
        raise ValueError(f"{missing} need sglang-router (pip install sglang-router)")
    return policies


def replica_args(args: argparse.Namespace) -> list[str]:
    extra = ["--engine", "sim", "--profile", args.profile] if args.engine == "sim" else []
    if args.kv_cache_tokens:
        extra += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    return extra + list(args.replica_arg)


def completed_requests(replica_url: str) -> int:
    """A replica's finished requests (every finish reason), from its Prometheus metrics."""
    text = httpx.get(replica_url + "/metrics", timeout=10).text
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "vllm:request_success_total"
        )
    )


@contextmanager
def sglang_router(policy: str, worker_urls: list[str], tokenizer_dir: Path, log: Path) -> Iterator[str]:
    """sglang-router bound to loopback in front of ``worker_urls``; yields its base URL."""
    port = free_port()
    command = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--policy", policy.removeprefix(SGLANG_PREFIX),
        "--tokenizer-path", str(tokenizer_dir),
        "--worker-urls", *worker_urls,
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {process.returncode}; see {log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router did not become healthy; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_policy(
    policy: str, args: argparse.Namespace, settings: ServeSettings, model_dir: Path, logs: Path
) -> PolicyResult:
    sglang = policy.startswith(SGLANG_PREFIX)
    stack = LocalStack(
        StackSettings(
            replicas=args.replicas,
            model=model_dir,
            port=free_port(),
            policy="round-robin" if sglang else policy,
            replica_args=replica_args(args),
            gateway_args=list(args.gateway_arg),
            log_dir=logs,
        )
    )
    try:
        stack.start(model_dir)
        with (
            sglang_router(policy, stack.replica_urls, model_dir, logs / "sglang-router.log")
            if sglang
            else _no_router(stack.base_url.removesuffix("/v1"))
        ) as base_url:
            before = [completed_requests(url) for url in stack.replica_urls]
            endpoint = Endpoint(base_url + "/v1/chat/completions", model_dir.name, None, request_extras(args))
            point = run_point(
                replace(settings, endpoint=endpoint), settings.workloads[0], settings.max_concurrency[0]
            )
            after = [completed_requests(url) for url in stack.replica_urls]
    finally:
        stack.stop()
    return PolicyResult(policy, point, [b - a for a, b in zip(before, after, strict=True)])


@contextmanager
def _no_router(base_url: str) -> Iterator[str]:
    yield base_url


def format_table(results: list[PolicyResult]) -> str:
    header = (
        f"{'policy':<20} {'cached%':>8} {'%oracle':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8}"
        f" {'TPOT p50':>9} {'E2EL p50':>9} {'out tok/s':>10} {'max/mean':>9} {'pred/real':>10}"
        f"  requests per replica"
    )
    lines = [header, "-" * len(header)]
    nan = float("nan")
    for result in results:
        m = result.point.metrics
        oracle = result.point.oracle
        ttft = m.latencies["ttft"]
        of_oracle = f"{100 * m.cached_ratio / oracle.ratio:.1f}" if oracle and oracle.ratio else "-"
        predicted = (
            f"{m.predicted_cached_tokens / m.cached_tokens:.2f}"
            if m.predicted_cached_tokens is not None and m.cached_tokens
            else "-"
        )
        lines.append(
            f"{result.policy:<20} {100 * m.cached_ratio:>8.1f} {of_oracle:>8} {ttft.median:>9.0f}"
            f" {ttft.percentiles.get(90.0, nan):>8.0f} {ttft.percentiles.get(99.0, nan):>8.0f}"
            f" {m.latencies['tpot'].median:>9.1f} {m.latencies['e2el'].median:>9.0f}"
            f" {m.output_throughput:>10.1f} {result.max_over_mean:>9.2f} {predicted:>10}"
            f"  {' '.join(map(str, result.requests_per_replica))}"
        )
    if any(r.point.metrics.failed for r in results):
        lines.append("failed requests: " + ", ".join(f"{r.policy}={r.point.metrics.failed}" for r in results))
    lines.append("(latencies in ms; pred/real = gateway-predicted / replica-reported cached tokens)")
    return "\n".join(lines)


def plot_compare(results: list[PolicyResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in results]
    figure, (latency, cached) = plt.subplots(1, 2, figsize=(12, 4))
    positions = range(len(names))
    p50 = [r.point.metrics.latencies["ttft"].median for r in results]
    p90 = [r.point.metrics.latencies["ttft"].percentiles.get(90.0, 0.0) for r in results]
    latency.bar([x - 0.2 for x in positions], p50, width=0.4, label="TTFT p50")
    latency.bar([x + 0.2 for x in positions], p90, width=0.4, label="TTFT p90")
    latency.set(ylabel="ms", title="Time to first token")
    latency.legend()
    cached.bar(positions, [100 * r.point.metrics.cached_ratio for r in results], color="tab:green")
    oracle = results[0].point.oracle
    if oracle is not None:
        cached.axhline(100 * oracle.ratio, color="black", linestyle="--", label="oracle")
        cached.legend()
    cached.set(ylabel="% of prompt tokens", title="Cached-token ratio")
    for axes in (latency, cached):
        axes.set_xticks(list(positions), names, rotation=30, ha="right")
        axes.grid(axis="y", alpha=0.3)
    return save_figure(figure, path, title)


def run_compare_command(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    if args.model_dir is None:
        from replica.tools.prepare_model import prepare_default_model

        args.model_dir = prepare_default_model(progress=lambda message: progress(BENCH, message))
    args.tokenizer = args.tokenizer or args.model_dir
    policies = chosen_policies(args)
    placeholder = Endpoint("http://127.0.0.1/v1/chat/completions", args.model_dir.name)
    settings = settings_from_args(args, placeholder)
    workload = settings.workloads[0]
    progress(
        BENCH,
        f"{workload.name}: {workload.num_requests} requests, {args.replicas} {args.engine} replicas,"
        f" concurrency {args.max_concurrency}; policies: {', '.join(policies)}",
    )
    warn_if_concurrency_capped(BENCH, settings)
    results: list[PolicyResult] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-compare-") as workdir:
        for policy in policies:
            logs = Path(workdir) / policy
            logs.mkdir()
            progress(BENCH, f"{policy}: starting fresh replicas")
            results.append(run_policy(policy, args, settings, args.model_dir, logs))
            progress(BENCH, f"{policy}: done")
    table = format_table(results)
    print(table, flush=True)
    report = {
        "bench": BENCH,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": cpu_model(), "sglang-router": package_version("sglang-router")},
        "model": args.model_dir.name,
        "engine": args.engine,
        "profile": args.profile if args.engine == "sim" else None,
        "replicas": args.replicas,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_concurrency": args.max_concurrency,
        "dataset": workload.name,
        "dataset_settings": workload.settings,
        "num_requests": workload.num_requests,
        "table": table,
        "results": [result.as_json() for result in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    progress(BENCH, f"wrote {args.out}")
    title = f"{workload.name}, {args.replicas} {args.engine} replicas, concurrency {args.max_concurrency}"
    progress(BENCH, f"wrote {plot_compare(results, args.out.with_suffix('.png'), title)}")
