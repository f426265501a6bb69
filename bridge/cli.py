"""``kvroute bridge``: one per vLLM server, so gateways route over it by the same cache index as over
kvroute replicas. Its options are :class:`BridgeSettings` and, in their own group, the publisher's
(``replica.publisher.PublisherConfig``: Redis, replica id, heartbeats)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvroute.protocol import DEFAULT_BLOCK_SIZE, default_advertise_url, replica_id_for
from kvroute.settings import (
    HOST_HELP,
    LOG_LEVEL_HELP,
    REQUIRED,
    add_command,
    add_options,
    examples,
    from_args,
    option,
)
from replica.publisher import PublisherConfig

# The publisher's options a bridge takes (the URL it advertises is vLLM's, --engine-url).
PUBLISHER_OPTIONS = {
    "redis_url": "the Redis gateways read: redis://HOST:PORT/DB",
    "replica_id": "the vLLM server's stable name in Redis (default: host:port of --engine-url)",
    "prefix": None,
    "heartbeat_interval": "seconds between heartbeats, and between polls of vLLM's /metrics",
    "heartbeat_ttl": None,
    "stream_maxlen": None,
}


@dataclass
class BridgeSettings:
    engine_url: str = option(
        REQUIRED, "--engine-url", "the vLLM server's base URL: gateways send it requests, the bridge"
        " reads its /metrics and /v1/models", metavar="URL",
    )  # fmt: skip
    events: str = option(
        REQUIRED, "--events", "vLLM's KV event endpoint (its --kv-events-config endpoint): tcp://HOST:PORT"
        " to connect to one vLLM binds (tcp://*:PORT there), tcp://*:PORT to bind for a vLLM that"
        " connects", metavar="ZMQ",
    )  # fmt: skip
    model: str = option(
        REQUIRED, "--model", "the model directory vLLM serves (its tokenizer files)", metavar="DIR"
    )
    replay: str | None = option(
        None, "--replay", "vLLM's replay endpoint (its replay_endpoint, which it binds): missed batches"
        " are fetched from it (default: none, and a gap starts a new epoch)", metavar="ZMQ",
    )  # fmt: skip
    topic: str | None = option(
        None, "--topic", "vLLM's event topic (its kv-events-config topic; default: any, as vLLM's own)"
    )
    served_model_name: str | None = option(
        None, "--served-model-name", "the model name gateways route on (default: vLLM's /v1/models)"
    )
    block_size: int = option(
        DEFAULT_BLOCK_SIZE, "--block-size", "kvroute's block size (the kvroute replicas' of this"
        " model): it must divide vLLM's, whose blocks are indexed at this granularity",
    )  # fmt: skip
    host: str = option("127.0.0.1", "--host", HOST_HELP)
    port: int = option(8101, "--port", "port of the bridge's own /kvroute/tokenizer, /health and /metrics")
    tokenizer_url: str | None = option(
        None, "--tokenizer-url", "the bridge's URL as gateways reach it, for the tokenizer"
        " (default: http://HOST:PORT, the hostname for a wildcard host)", metavar="URL",
    )  # fmt: skip
    api_key: str | None = option(
        None, "--api-key", "the key gateways send replicas (their --replica-key): required on"
        " /kvroute/tokenizer and sent to vLLM (default: env KVROUTE_REPLICA_KEY, else none)",
        env="KVROUTE_REPLICA_KEY",
    )  # fmt: skip
    log_level: str = option("info", "--log-level", LOG_LEVEL_HELP)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = add_command(
        sub,
        "bridge",
        help="put a vLLM server in the cache index: its KV events re-hashed, its load polled",
        description="Subscribes to one vLLM server's KV cache events (ZMQ), re-hashes each stored block's"
        " tokens into kvroute's chain hashes, and publishes them with the server's load to Redis exactly"
        " as a kvroute replica does, so gateways route over vLLM and kvroute replicas alike. Requests go"
        " to vLLM directly; the bridge serves only the tokenizer, /health and /metrics.",
        epilog=examples(
            "vllm serve MODEL_DIR --enable-prefix-caching --enable-prompt-tokens-details \\",
            '  --kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq",',
            '  "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'',
            "kvroute bridge --engine-url http://127.0.0.1:8000 --events tcp://127.0.0.1:5557 \\",
            "  --replay tcp://127.0.0.1:5558 --model MODEL_DIR --redis redis://127.0.0.1:6379/0",
        ),
    )
    add_options(parser, BridgeSettings, required=("engine_url", "events", "model"))
    add_options(
        parser, PublisherConfig, only=PUBLISHER_OPTIONS, group="cache index (Redis)", required=("redis_url",)
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    from bridge.server import run_server
    from bridge.service import Bridge
    from bridge.subscriber import EventSubscriber
    from kvroute.text.tokenizer import TextTokenizer

    settings: BridgeSettings = from_args(BridgeSettings, args)
    if settings.block_size < 1:
        raise ValueError("--block-size must be at least 1")
    engine_url = settings.engine_url.rstrip("/")
    tokenizer = TextTokenizer.from_dir(Path(settings.model))
    publisher_config = from_args(
        PublisherConfig,
        args,
        advertise_url=engine_url,
        replica_id=args.replica_id or replica_id_for(engine_url),
        tokenizer_url=settings.tokenizer_url or default_advertise_url(settings.host, settings.port),
    )
    subscriber = EventSubscriber(settings.events, settings.replay, settings.topic or "")
    bridge = Bridge(
        publisher_config,
        tokenizer,
        subscriber,
        engine_url=engine_url,
        block_size=settings.block_size,
        served_model_name=settings.served_model_name,
        engine_key=settings.api_key,
    )
    run_server(bridge, settings.host, settings.port, api_key=settings.api_key, log_level=settings.log_level)
