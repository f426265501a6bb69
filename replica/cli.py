"""``kvroute replica``: its options are the fields of :class:`~replica.engine.config.EngineConfig`,
:class:`ReplicaServer` and, in their own group, :class:`~replica.publisher.PublisherConfig`
(``kvroute.settings``). Importing this loads no torch; running it does."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvroute.http import RequestLimits
from kvroute.http_server import ServerLimits
from kvroute.protocol import default_advertise_url, replica_id_for
from kvroute.settings import (
    HOST_HELP,
    LOG_LEVEL_HELP,
    add_command,
    add_options,
    examples,
    from_args,
    option,
)
from replica.engine.config import EngineConfig
from replica.publisher import PublisherConfig
from replica.tools.prepare_model import prepare_default_model


@dataclass
class ReplicaServer:
    """The HTTP server's settings: ``run_server``'s arguments beside the engine's."""

    host: str = option("127.0.0.1", "--host", HOST_HELP)
    port: int = option(8001, "--port", "port to listen on")
    api_key: str | None = option(
        None,
        "--api-key",
        "require Authorization: Bearer KEY on /v1, /tokenize, /detokenize, /kvroute/tokenizer and"
        " /reset_prefix_cache: a key only gateways hold (default: env KVROUTE_REPLICA_KEY, else open)",
        env="KVROUTE_REPLICA_KEY",
    )
    log_level: str = option("info", "--log-level", LOG_LEVEL_HELP)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_command(
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
    add_options(parser, EngineConfig)
    add_options(parser, ReplicaServer)
    add_options(parser, RequestLimits)
    add_options(parser, ServerLimits)
    add_options(parser, PublisherConfig, group="cache index (Redis)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    if args.profile is not None and args.engine != "sim":
        raise ValueError("--profile needs --engine sim")
    from replica.server.app import run_server  # torch

    config: EngineConfig = from_args(EngineConfig, args, model=args.model or prepare_default_model())
    server: ReplicaServer = from_args(ReplicaServer, args)
    run_server(
        config,
        server.host,
        server.port,
        request_limits=from_args(RequestLimits, args),
        limits=from_args(ServerLimits, args),
        log_level=server.log_level,
        publisher_config=publisher_config(args, server),
        api_key=server.api_key,
    )


def publisher_config(args: argparse.Namespace, server: ReplicaServer) -> PublisherConfig | None:
    """With --redis, what to publish there: the advertised URL and the id default to the listening
    address (a wildcard host advertised by its hostname)."""
    if args.redis is None:
        return None
    advertise_url = args.advertise_url or default_advertise_url(server.host, server.port)
    return from_args(
        PublisherConfig,
        args,
        advertise_url=advertise_url,
        replica_id=args.replica_id or replica_id_for(advertise_url),
    )
