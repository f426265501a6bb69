"""The options the load tests share, and what turns them into settings: the workload of the serving
benchmarks (``kvroute bench serve`` and ``kvroute bench compare``) and the sizes of the component
benchmarks (``python -m loadtests.bench_engine``, ``bench_gateway``, ``bench_index``).

It imports nothing else of loadtests: the CLI and the benchmarks import it, never the reverse."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.protocol import DEFAULT_BLOCK_SIZE

DATASETS = ("random", "shared-prefix", "multi-turn", "jsonl")
LATENCY_NAMES = frozenset({"ttft", "tpot", "itl", "e2el"})

# -- the serving benchmarks' workload ------------------------------------------------------------


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The ``workload`` group of ``bench serve`` and ``bench compare``."""
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
    """The workload builders' options (:func:`loadtests.serving.workloads.build_workload`), checked."""
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
    unknown = set(names) - LATENCY_NAMES
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}")
    return names


def percentiles(args: argparse.Namespace) -> list[float]:
    values = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if any(not 0 < p < 100 for p in values):
        raise ValueError("--metric-percentiles must lie strictly between 0 and 100")
    return values


# -- the component benchmarks' sizes -------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """A component benchmark's sizes: ``full`` by default, ``quick`` with --quick, each one
    overridden by its own option (``--NAME``, of the default's type)."""

    full: dict[str, Any]
    quick: dict[str, Any]
    quick_help: str = "small sizes"  # what --quick gives, in its help

    def add_options(self, parser: argparse.ArgumentParser, out: str) -> None:
        """--NAME for every size, then --quick and --out (the JSON report, ``out`` by default)."""
        for name, default in self.full.items():
            parser.add_argument(
                f"--{name.replace('_', '-')}",
                type=type(default),
                help=f"default {default} (--quick: {self.quick[name]})",
            )
        parser.add_argument("--quick", action="store_true", help=f"{self.quick_help}, for a smoke run")
        parser.add_argument("--out", default=out, help="JSON report path")

    def chosen(self, args: argparse.Namespace) -> dict[str, Any]:
        """Each size from its option, else from ``quick`` (with --quick) or ``full``."""
        defaults = self.quick if args.quick else self.full
        return {
            name: value if (value := getattr(args, name)) is not None else defaults[name]
            for name in self.full
        }
