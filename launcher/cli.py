"""The ``kvroute`` command: a dispatcher. Each component adds its own commands, whose options are its
settings dataclasses' fields (``kvroute.settings``): ``gateway.cli`` (``kvroute gateway``),
``replica.cli`` (``kvroute replica``), ``bridge.cli`` (``kvroute bridge``, a vLLM server's sidecar),
``replica.tools.cli`` (calibrate, prepare-model, make-test-model, memory); ``kvroute up`` is the
launcher's own (``launcher.stack.StackSettings``), and ``kvroute bench`` runs the load tests as a
program of their own (``python -m loadtests``). The commands import their heavy modules when they
run, so the gateway side never pays for torch."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from bridge import cli as bridge_cli
from gateway import cli as gateway_cli
from kvroute.settings import (
    HelpFormatter,
    add_command,
    add_options,
    examples,
    from_args,
    to_argv,
)
from launcher.stack import StackSettings
from replica import cli as replica_cli
from replica.engine.config import EngineConfig
from replica.tools import cli as tools_cli

DESCRIPTION = """\
kvroute serves an LLM from several torch engine replicas behind one
OpenAI-compatible gateway, which sends each request to the replica already
holding the longest part of its prompt in its KV cache (the replicas report
their caches and load through Redis). One command starts a whole local stack;
the others run its parts one by one, plan memory and measure a running server."""

EPILOG = """\
usual commands:
  kvroute up                    Redis, 2 SmolLM2-135M replicas (CPU) and the
                                gateway on http://127.0.0.1:8000
  kvroute up --engine sim       the same stack with simulated replicas
  kvroute bench serve --num-prompts 16 --document-len 256:512 --output-len 32
                                a short load test of the running stack
  kvroute bench compare --engine sim
                                every routing policy on the same workload
  kvroute memory MODEL_DIR --gpu-memory 80
                                weights and KV cache of a model on an 80 GiB GPU

Each command lists its options with their defaults: kvroute COMMAND --help"""

# The EngineConfig options `kvroute up` hands to every replica, with their help here.
UP_REPLICA_OPTIONS = {
    "dtype": "every replica's dtype, as in kvroute replica",
    "kv_cache_memory_gb": "KV pool budget per replica, GiB",
    "engine": "replica backend; sim is a SIMULATION (cost model, filler text; docs/SIMULATION.md)",
    "sim_profile": "--engine sim: the cost profile",
}


def _add_up_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "up",
        help="a private Redis, N replicas and the gateway on this machine, in one command",
        description="Starts a private redis-server (unless --redis), N `kvroute replica` processes on"
        " free loopback ports and one `kvroute gateway` in front of them, prints how to talk to it,"
        " and stops them all on Ctrl-C.",
        epilog=examples(
            "kvroute up                        # 2 SmolLM2-135M replicas on CPU, gateway on :8000",
            "kvroute up --replicas 4 --engine sim --profile h100-llama3-8b",
            "kvroute up --model MODEL_DIR --replica-arg=--device=cuda --replica-arg=--max-num-seqs=32",
        ),
    )
    add_options(p, StackSettings)
    add_options(p, EngineConfig, only=UP_REPLICA_OPTIONS)
    p.set_defaults(run=_run_up)


def _run_up(args: argparse.Namespace) -> None:
    from launcher.stack import run_stack

    if args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    replica_args = to_argv(EngineConfig, args, UP_REPLICA_OPTIONS) + args.replica_arg
    run_stack(from_args(StackSettings, args, replica_args=replica_args))


def _run_bench(args: argparse.Namespace) -> None:
    """The load tests are a program of their own: nothing the product runs imports them."""
    os.execv(sys.executable, [sys.executable, "-m", "loadtests", *args.bench_args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _add_up_parser(sub)
    replica_cli.add_parser(sub)
    gateway_cli.add_parser(sub)
    bridge_cli.add_parser(sub)
    tools_cli.add_parsers(sub)
    # `kvroute bench` only forwards its arguments, --help included, to `python -m loadtests`.
    p = sub.add_parser("bench", help="serving benchmark and policy comparison (load tests)", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="serve|compare and their options")
    p.set_defaults(run=_run_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = unknown + args.bench_args  # a leading --help lands in ``unknown``
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.run(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, FileNotFoundError) as error:  # bad settings or model files: no traceback
        sys.exit(f"kvroute {args.command}: error: {error}")


if __name__ == "__main__":
    main()
