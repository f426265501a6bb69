"""``kvroute bench serve``: one workload against any OpenAI-compatible server, at one or several
concurrencies, reported like ``vllm bench serve`` with the cached-token ratio beside its oracle."""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from kvroute.text.tokenizer import TextTokenizer
from loadtests.harness import cpu_model, package_version, progress
from loadtests.options import percentiles, shown_metrics, workload_options
from loadtests.serving.client import Endpoint, RequestRecord
from loadtests.serving.metrics import ServingMetrics, compute_metrics
from loadtests.serving.oracle import OracleResult, oracle_cached_tokens, token_stream
from loadtests.serving.runner import RunResult, run_workload
from loadtests.serving.vllm_report import format_report, plot_sweep
from loadtests.serving.workloads import Workload, build_workload

BENCH = "bench serve"


@dataclass
class ServeSettings:
    endpoint: Endpoint
    workloads: list[Workload]  # one per sweep point: each starts with a cold cache
    tokenizer: TextTokenizer | None  # None: no oracle
    max_concurrency: list[int | None]
    request_rate: float
    seed: int
    percentiles: list[float]
    shown_metrics: tuple[str, ...]
    block_size: int = 16
    show_progress: bool = True


@dataclass
class ServePoint:
    """One run of the workload at one concurrency."""

    max_concurrency: int | None
    metrics: ServingMetrics
    oracle: OracleResult | None
    client_cpu_s: float
    text: str

    def as_json(self) -> dict[str, Any]:
        out = {"max_concurrency": self.max_concurrency, **self.metrics.as_json()}
        out["client_cpu_s"] = self.client_cpu_s
        out["client_cpu_us_per_request"] = 1e6 * self.client_cpu_s / max(1, self.metrics.completed)
        out["client_cpu_share"] = self.client_cpu_s / max(self.metrics.duration_s, 1e-9)
        if self.oracle is not None:
            out["oracle_cached_tokens"] = self.oracle.cached_tokens
            out["oracle_cached_token_ratio"] = self.oracle.ratio
            out["cached_ratio_of_oracle"] = (
                self.metrics.cached_ratio / self.oracle.ratio if self.oracle.ratio else None
            )
        return out


def served_models(base_url: str, api_key: str | None) -> list[str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30)
        response.raise_for_status()
        models = [model["id"] for model in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"cannot list the models at {url} ({error}); give --model to skip this") from None
    if not models:
        raise ValueError(f"{url} lists no models")
    return models


def oracle_for(run: RunResult, tokenizer: TextTokenizer, chat: bool, block_size: int) -> OracleResult:
    """The oracle over the requests that succeeded, in the order they were sent."""
    done = sorted((r for r in run.records if r.ok), key=lambda r: r.start)
    streams = (
        token_stream(tokenizer, run.sent_messages[(r.conversation, r.turn)], r.text, chat) for r in done
    )
    return oracle_cached_tokens(streams, block_size)


def run_point(settings: ServeSettings, workload: Workload, max_concurrency: int | None) -> ServePoint:
    bar = tqdm(
        total=workload.num_requests,
        disable=not settings.show_progress,
        desc=f"concurrency {max_concurrency or 'unlimited'}",
        unit="req",
    )

    def done(record: RequestRecord) -> None:
        bar.update(1)

    cpu_before = _cpu_seconds()
    run = asyncio.run(
        run_workload(settings.endpoint, workload, max_concurrency, settings.request_rate, settings.seed, done)
    )
    client_cpu = _cpu_seconds() - cpu_before
    bar.close()
    metrics = compute_metrics(run.records, run.duration_s, settings.percentiles, workload.num_requests)
    oracle = None
    if settings.tokenizer is not None:
        oracle = oracle_for(run, settings.tokenizer, settings.endpoint.chat, settings.block_size)
        reported = sum(r.prompt_tokens or 0 for r in run.records if r.ok)
        if reported and oracle.prompt_tokens != reported:
            progress(
                BENCH,
                f"note: the server counted {reported} prompt tokens, the local tokenizer "
                f"{oracle.prompt_tokens}: is --tokenizer the served model's?",
            )
    text = format_report(metrics, oracle, max_concurrency, settings.request_rate, settings.shown_metrics)
    share = 100 * client_cpu / max(run.duration_s, 1e-9)
    text += f"\nBenchmark client CPU: {client_cpu:.2f} s ({share:.0f}% of a core)"
    return ServePoint(max_concurrency, metrics, oracle, client_cpu, text)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def concurrency_cap_warning(workload: Workload, max_concurrency: list[int | None]) -> str | None:
    """The warning for a run asking more concurrency than its workload can keep in flight, else None.

    A slot is held for a whole conversation (its turns go one after another), so at most one
    request per conversation is ever in flight: a --max-concurrency above the number of
    conversations runs exactly like one equal to it.
    """
    parallelism = len(workload.conversations)
    over = sorted({c for c in max_concurrency if c is not None and c > parallelism})
    if not over:
        return None
    asked = " ".join(str(c) for c in over)
    if workload.name == "multi-turn":
        turns = workload.settings.get("turns", 1)
        why = (
            f"the workload has {parallelism} conversations (--num-prompts {workload.num_requests} /"
            f" --turns {turns}), each sending its turns one after another"
        )
        fix = "raise --num-prompts or lower --turns"
    elif workload.name == "jsonl":
        why = f"the file gives {parallelism} conversations (up to --num-prompts)"
        fix = "add lines to the file"
    else:
        why = f"the workload has {parallelism} requests (--num-prompts)"
        fix = "raise --num-prompts"
    return (
        f"warning: --max-concurrency {asked} is above what the workload can keep in flight: {why},"
        f" so the effective concurrency is capped at {parallelism} ({fix} to reach {over[-1]})"
    )


def warn_if_concurrency_capped(bench: str, settings: ServeSettings) -> None:
    """Says once per run (not per sweep point: every point's workload has the same shape) that a
    --max-concurrency cannot be reached."""
    warning = concurrency_cap_warning(settings.workloads[0], settings.max_concurrency)
    if warning is not None:
        progress(bench, warning)


def run_serve(settings: ServeSettings) -> list[ServePoint]:
    points = []
    for workload, concurrency in zip(settings.workloads, settings.max_concurrency, strict=True):
        point = run_point(settings, workload, concurrency)
        print(point.text, flush=True)
        points.append(point)
    return points


def write_results(settings: ServeSettings, points: list[ServePoint], out: Path, label: str) -> None:
    """The JSON report and, for a sweep, the PNG beside it."""
    results = [point.as_json() for point in points]
    report = {
        "bench": BENCH,
        "label": label,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": cpu_model(), "kvroute": package_version("kvroute")},
        "endpoint": settings.endpoint.url,
        "model": settings.endpoint.model,
        "dataset": settings.workloads[0].name,
        "dataset_settings": settings.workloads[0].settings,
        "num_requests": settings.workloads[0].num_requests,
        "request_rate": str(settings.request_rate),
        "seed": settings.seed,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    progress(BENCH, f"wrote {out}")
    plot = plot_sweep(results, out.with_suffix(".png"), f"{label}: {settings.workloads[0].name}")
    if plot is not None:
        progress(BENCH, f"wrote {plot}")


def load_tokenizer(path: Path | None) -> TextTokenizer:
    """The workload's tokenizer: the given model directory, else the default model (prepared once)."""
    if path is None:
        from replica.tools.prepare_model import prepare_default_model

        path = prepare_default_model(progress=lambda message: progress(BENCH, message))
    return TextTokenizer.from_dir(path)


def settings_from_args(args: argparse.Namespace, endpoint: Endpoint) -> ServeSettings:
    """What `bench serve` and `bench compare` share: the tokenizer, the workload, the statistics."""
    tokenizer = load_tokenizer(args.tokenizer)
    options = workload_options(args)
    concurrency = args.max_concurrency if isinstance(args.max_concurrency, list) else [args.max_concurrency]
    # Point i of a sweep gets the workload of seed + i: same shape, new text, so no point finds the
    # cache warmed by the one before (the oracle assumes a cold start).
    workloads = [
        build_workload(args.dataset, tokenizer, args.seed + i, options) for i in range(len(concurrency))
    ]
    return ServeSettings(
        endpoint=endpoint,
        workloads=workloads,
        tokenizer=tokenizer,
        max_concurrency=concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        percentiles=percentiles(args),
        shown_metrics=shown_metrics(args),
        block_size=args.block_size,
        show_progress=not args.disable_tqdm,
    )


def request_extras(args: argparse.Namespace) -> dict[str, Any]:
    extras: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        extras["ignore_eos"] = True
    return extras


def run_serve_command(args: argparse.Namespace) -> None:
    model = args.model or served_models(args.base_url, args.api_key)[0]
    url = args.base_url.rstrip("/") + "/" + args.endpoint.lstrip("/")
    endpoint = Endpoint(url, model, args.api_key, request_extras(args))
    settings = settings_from_args(args, endpoint)
    first = settings.workloads[0]
    progress(
        BENCH,
        f"{first.name}: {first.num_requests} requests in {len(first.conversations)} conversations"
        f" per point -> {url} ({model})",
    )
    warn_if_concurrency_capped(BENCH, settings)
    points = run_serve(settings)
    write_results(settings, points, args.out, args.label)
