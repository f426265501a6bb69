"""``kvroute bench serve`` and ``kvroute bench compare``: their options; ``launcher.cli`` hands them the
arguments after ``bench``, and the work itself is imported only once a command runs. The help uses
``launcher.cli``'s layout: every default shown, examples last."""

from __future__ import annotations

import argparse
import logging
import math
import os
import textwrap
from pathlib import Path
from typing import Any

from kvroute.protocol import DEFAULT_BLOCK_SIZE
from launcher.cli import HelpFormatter, add_command, examples

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl")

BENCH_EPILOG = examples(
    "kvroute bench serve --num-prompts 16 --document-len 256:512 --output-len 32   # a short run",
    "kvroute bench compare --engine sim --replicas 4 --num-prompts 64 --max-concurrency 8",
    "kvroute bench serve --help                       # every option, with its default",
)
# Sized for the default local stack (`kvroute up`: 2 SmolLM2-135M replicas on CPU): 2 points of
# 16 requests, 4 conversations over 2 documents of 256-512 tokens, 32-token answers; about 40 s on
# 2 CPU cores. The README's load-test section shows the same command.
QUICK_SERVE = (
    "kvroute bench serve --num-prompts 16 --turns 4 --document-len 256:512 \\\n"
    "      --input-len 32 --output-len 32 --max-concurrency 1 4   # vs kvroute up: <1 min on 2 CPU cores"
)


def build_bench_parser() -> argparse.ArgumentParser:
    """The parser of ``kvroute bench``: its serve and compare commands."""
    parser = argparse.ArgumentParser(
        prog="kvroute bench",
        description=textwrap.fill(
            "Load tests. serve measures any OpenAI-compatible server; compare runs one workload through"
            " a fresh stack per routing policy. Both send seeded workloads and report the cached-token"
            " ratio beside its oracle.",
            width=78,
        ),
        epilog=BENCH_EPILOG,
        formatter_class=HelpFormatter,
    )
    add_bench_commands(parser)
    return parser


def run_bench(argv: list[str]) -> None:
    """``kvroute bench ARGV``: parses the load tests' own options and runs the chosen command."""
    args = build_bench_parser().parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY") or None
    args.bench_handler(args)


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, title="commands")
    serve = add_command(
        sub,
        "serve",
        help="benchmark any OpenAI-compatible server (vllm bench serve style)",
        description="Sends a seeded workload to an OpenAI-compatible server and reports TTFT, TPOT, ITL,"
        " E2EL, throughput and the cached-token ratio beside its oracle (perfect affinity, unlimited"
        " cache). Several --max-concurrency values run a sweep, one fresh workload per point.",
        epilog=examples(
            QUICK_SERVE,
            "kvroute bench serve --dataset shared-prefix --num-prompts 32 --prefix-len 512 \\\n"
            "      --output-len 16 --max-concurrency 4",
            "# larger (many minutes on CPU, sized for GPUs):",
            "kvroute bench serve --base-url http://GPU_HOST:8000 --num-prompts 256 --turns 4 \\\n"
            "      --document-len 1024:4096 --max-concurrency 4 16 64",
            "kvroute bench serve --dataset jsonl --dataset-path chats.jsonl --max-concurrency 8",
        ),
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL without /v1")
    serve.add_argument(
        "--endpoint", default="/v1/chat/completions", help="/v1/chat/completions or /v1/completions"
    )
    serve.add_argument("--model", help="model name (default: the first of the server's /v1/models)")
    _add_workload_options(serve)
    serve.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        help="concurrent conversations at most; several values run a sweep (default: unlimited)",
    )
    serve.add_argument("--out", type=Path, default=Path("results/bench_serve.json"), help="JSON report")
    serve.add_argument("--label", default="bench serve", help="name in the report and the plot")
    serve.set_defaults(bench_handler=_run_serve)

    compare = add_command(
        sub,
        "compare",
        help="the same workload through one gateway per routing policy, side by side",
        description="Starts Redis, fresh replicas (torch or sim) and a gateway for each policy, runs the"
        " identical workload through each and prints one table.",
        epilog=examples(
            "kvroute bench compare --engine sim --replicas 4 --num-prompts 64 --max-concurrency 8",
            "kvroute bench compare --replicas 2 --num-prompts 16 --document-len 256:512 \\\n"
            "      --output-len 16 --max-concurrency 4 --policies kv round-robin   # torch on CPU",
            "kvroute bench compare --engine sim --profile h100-llama3-8b --kv-cache-tokens 20000",
        ),
    )
    compare.add_argument("--replicas", type=int, default=4, help="replicas behind each gateway")
    compare.add_argument("--engine", choices=["torch", "sim"], default="torch", help="replica backend")
    compare.add_argument("--profile", default="cpu-smollm2", help="sim cost profile (name or JSON file)")
    compare.add_argument("--model-dir", type=Path, help="model directory (default: prepared SmolLM2)")
    compare.add_argument(
        "--policies",
        nargs="+",
        default=["kv", "round-robin", "least-loaded", "random", "session"],
        help="kvroute policies, plus sglang-cache_aware / sglang-round_robin (needs sglang-router)",
    )
    compare.add_argument(
        "--no-sglang", action="store_true", help="do not add sglang-router even when it is installed"
    )
    compare.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="each replica's KV pool in tokens, for cache pressure (default: the replica's own)",
    )
    compare.add_argument(
        "--replica-arg", action="append", default=[], help="extra `kvroute replica` flag (repeatable)"
    )
    compare.add_argument(
        "--gateway-arg", action="append", default=[], help="extra `kvroute gateway` flag (repeatable)"
    )
    _add_workload_options(compare)
    compare.add_argument("--max-concurrency", type=int, default=8, help="concurrent conversations")
    compare.add_argument("--out", type=Path, default=Path("results/bench_compare.json"), help="JSON report")
    compare.set_defaults(bench_handler=_run_compare)


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        choices=DATASETS,
        default="multi-turn",
        metavar="NAME",
        help=f"the workload: {', '.join(DATASETS[:-1])} or jsonl (read from --dataset-path)",
    )
    w.add_argument(
        "--dataset-path", type=Path, help="the JSONL file of --dataset jsonl (default: none; jsonl needs it)"
    )
    w.add_argument("--num-prompts", type=int, default=200, help="requests in all (multi-turn: turns too)")
    w.add_argument(
        "--input-len",
        type=int,
        default=64,
        help="tokens of each request's own text: the random prompt, the shared-prefix suffix, or the"
        " multi-turn user message",
    )
    w.add_argument("--output-len", type=int, default=32, help="max_tokens of every request")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random: input length spread ±ratio")
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    w.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens per system prompt")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument(
        "--num-documents", type=int, help="multi-turn: distinct opening documents (default: conversations/2)"
    )
    w.add_argument(
        "--document-len",
        default="1024:4096",
        help="multi-turn: opening document length in tokens, MIN:MAX (uniform)",
    )
    w.add_argument("--think-time", type=float, default=0.0, help="multi-turn: mean seconds between turns")
    w.add_argument("--request-rate", type=float, default=math.inf, help="arrivals/s (Poisson); inf: at once")
    w.add_argument("--seed", type=int, default=0, help="seeds the workload's text and the arrivals")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    w.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    w.add_argument(
        "--tokenizer",
        type=Path,
        help="model directory whose tokenizer builds the workload and the oracle: give the served"
        " model's (default: SmolLM2; bench compare: --model-dir)",
    )
    w.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="the oracle's block size")
    w.add_argument(
        "--percentile-metrics", default="ttft,tpot,itl,e2el", help="comma list of ttft,tpot,itl,e2el"
    )
    w.add_argument("--metric-percentiles", default="90,99", help="comma list of percentiles to report")
    w.add_argument("--api-key", help="Bearer key sent to the server (default: env OPENAI_API_KEY)")
    w.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def workload_options(args: argparse.Namespace) -> dict[str, Any]:
    low, _, high = args.document_len.partition(":")
    document_len = (int(low), int(high or low))
    if document_len[0] > document_len[1] or document_len[0] < 1:
        raise ValueError(f"--document-len {args.document_len!r}: expected MIN:MAX with 1 <= MIN <= MAX")
    if args.dataset == "jsonl" and args.dataset_path is None:
        raise ValueError("--dataset jsonl needs --dataset-path FILE")
    if args.num_prompts < 1 or args.output_len < 1 or args.turns < 1:
        raise ValueError("--num-prompts, --output-len and --turns must be at least 1")
    return {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "num_prefixes": args.num_prefixes,
        "prefix_len": args.prefix_len,
        "turns": args.turns,
        "num_documents": args.num_documents,
        "document_len": document_len,
        "think_time": args.think_time,
        "dataset_path": args.dataset_path,
    }


def shown_metrics(args: argparse.Namespace) -> tuple[str, ...]:
    names = tuple(name.strip() for name in args.percentile_metrics.split(",") if name.strip())
    unknown = set(names) - {"ttft", "tpot", "itl", "e2el"}
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}")
    return names


def percentiles(args: argparse.Namespace) -> list[float]:
    values = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if any(not 0 < p < 100 for p in values):
        raise ValueError("--metric-percentiles must lie strictly between 0 and 100")
    return values


def _quiet_http_logs() -> None:
    """One INFO line per HTTP request would bury the report."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _run_serve(args: argparse.Namespace) -> None:
    from loadtests.serving.serve import run_serve_command

    _quiet_http_logs()
    run_serve_command(args)


def _run_compare(args: argparse.Namespace) -> None:
    from loadtests.serving.compare import run_compare_command

    _quiet_http_logs()
    run_compare_command(args)
