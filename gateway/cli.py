"""``kvroute gateway``: its options are :class:`~gateway.settings.GatewaySettings`' fields and
:class:`GatewayServer`'s (``kvroute.settings``). Importing this loads no torch, and neither does
running it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from gateway.priority import DEFAULT_NICE
from gateway.settings import GatewaySettings
from kvroute.http import RequestLimits
from kvroute.http_server import ServerLimits
from kvroute.settings import HOST_HELP, LOG_LEVEL_HELP, add_command, add_options, examples, from_args, option


@dataclass
class GatewayServer:
    """Where the gateway listens, how much it logs and at what CPU priority it runs: ``run_gateway``'s
    arguments beside its settings."""

    host: str = option("127.0.0.1", "--host", HOST_HELP)
    port: int = option(8000, "--port", "port to listen on")
    log_level: str = option("info", "--log-level", LOG_LEVEL_HELP)
    nice: int = option(
        DEFAULT_NICE,
        "--nice",
        "nice value to run at, where the system allows it (root or CAP_SYS_NICE; else the current one"
        " stays): ahead of replicas on the same cores, requests do not wait for their threads",
    )


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_command(
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
    add_options(parser, GatewayServer)
    add_options(parser, ServerLimits)
    add_options(parser, RequestLimits)
    add_options(parser, GatewaySettings)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    settings: GatewaySettings = from_args(
        GatewaySettings, args, request_limits=from_args(RequestLimits, args)
    )
    if settings.redis_url is None and not settings.replicas:
        sys.exit("kvroute gateway: give --redis URL, or --replica URL (repeatable), or both")
    from gateway.app import run_gateway

    server: GatewayServer = from_args(GatewayServer, args)
    run_gateway(
        settings, server.host, server.port, server.log_level, from_args(ServerLimits, args), server.nice
    )
