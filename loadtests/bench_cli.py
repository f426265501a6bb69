"""The load tests' command line, ``kvroute bench serve|compare`` (also ``python -m loadtests``, which
``kvroute bench`` runs): its parser, whose workload options come from :mod:`loadtests.options`, and its
commands, whose work is imported only once one runs. The help uses ``launcher.cli``'s layout: every
default shown, examples last.

The component benchmarks have their own entry points: ``python -m loadtests.bench_engine``,
``loadtests.bench_gateway`` and ``loadtests.bench_index`` (see :mod:`loadtests.harness`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path

from kvroute.settings import HelpFormatter, add_command, examples
from loadtests.options import add_workload_options

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


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtests ARGV``, what ``kvroute bench ARGV`` runs: bad settings end in one line
    on stderr (``kvroute bench: error: ...``) and a non-zero status, no traceback."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_bench(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as error:
        print(f"kvroute bench: error: {error}", file=sys.stderr)
        return 1
    return 0


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, title="commands")
    _add_serve_command(sub)
    _add_compare_command(sub)


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
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
    add_workload_options(serve)
    serve.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        help="concurrent conversations at most; several values run a sweep (default: unlimited)",
    )
    serve.add_argument("--out", type=Path, default=Path("results/bench_serve.json"), help="JSON report")
    serve.add_argument("--label", default="bench serve", help="name in the report and the plot")
    serve.set_defaults(bench_handler=_run_serve)


def _add_compare_command(sub: argparse._SubParsersAction) -> None:
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
    add_workload_options(compare)
    compare.add_argument("--max-concurrency", type=int, default=8, help="concurrent conversations")
    compare.add_argument("--out", type=Path, default=Path("results/bench_compare.json"), help="JSON report")
    compare.set_defaults(bench_handler=_run_compare)


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
