"""The bridge's HTTP face: what gateways need of a replica that vLLM does not serve.

``GET /kvroute/tokenizer`` (the heartbeat's ``tokenizer_url`` points here), ``GET /health`` (200
while the vLLM server is registered, else 503) and ``GET /metrics`` (the bridge's own counters).
Generation requests go to vLLM, never here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.main import STARTUP_FAILURE

from bridge.service import Bridge
from kvroute.auth import SharedKeyAuth
from kvroute.http import http_error
from kvroute.http_server import DEFAULT_LIMITS, server_config
from kvroute.openai_api.errors import APIError

log = logging.getLogger("kvroute.bridge")


class _BridgeCollector(Collector):
    """Reads the bridge's counters at scrape time."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge

    def collect(self) -> Iterator[Metric]:
        bridge, subscriber, translator = self.bridge, self.bridge.subscriber, self.bridge.translator
        yield GaugeMetricFamily(
            "kvroute_bridge_engine_registered",
            "1 while the vLLM server is registered.",
            bridge.session is not None,
        )
        yield GaugeMetricFamily(
            "kvroute_bridge_blocks",
            "kvroute blocks the vLLM server caches now.",
            translator.num_blocks if translator else 0,
        )
        counters = {
            "sessions": ("Times the vLLM server was registered.", bridge.sessions),
            "epoch_restarts": ("New epochs for a restart or a lost gap.", bridge.epoch_restarts),
            "gaps": ("Gaps in vLLM's sequence numbers.", subscriber.gaps),
            "replayed_batches": ("Batches fetched from the replay socket.", subscriber.replayed),
            "malformed_messages": ("Messages that were not event batches.", subscriber.malformed),
        }
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(f"kvroute_bridge_{name}", help_text, value)
        if translator is not None:
            yield CounterMetricFamily(
                "kvroute_bridge_unknown_parent_blocks",
                "vLLM blocks not indexed in this session: their parent was never seen.",
                translator.unknown_parent,
            )
            yield CounterMetricFamily(
                "kvroute_bridge_skipped_blocks",
                "vLLM blocks not indexed in this session: LoRA, multimodal or another KV cache group.",
                translator.skipped,
            )


def build_app(
    bridge: Bridge, api_key: str | None = None, on_failure: Callable[[], None] | None = None
) -> Starlette:
    """``on_failure``: called if the bridge's loops end on an error (the server should then stop:
    an HTTP face that answers while nothing is bridged would hide it)."""
    registry = CollectorRegistry()
    registry.register(_BridgeCollector(bridge))

    async def tokenizer_files(request: Request) -> Response:
        if bridge.model is None:
            raise APIError(f"{bridge.engine_url} is not registered (not answering)", 503)
        files = bridge.tokenizer.served_files(bridge.model, bridge.block_size, bridge.max_model_len)
        return JSONResponse(files)

    async def health(request: Request) -> Response:
        if bridge.session is None:
            raise APIError(f"{bridge.engine_url} is not registered (not answering)", 503)
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), headers={"Content-Type": "text/plain; version=0.0.4"})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(bridge.run())

        def ended(done: asyncio.Task[None]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("the bridge stopped", exc_info=done.exception())
                if on_failure is not None:
                    on_failure()

        task.add_done_callback(ended)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            bridge.subscriber.close()

    routes = [
        Route("/kvroute/tokenizer", tokenizer_files),
        Route("/health", health),
        Route("/metrics", metrics),
    ]
    middleware = [Middleware(SharedKeyAuth, key=api_key)] if api_key else []
    return Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, APIError: _api_error},
    )


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return error.to_response()


def run_server(bridge: Bridge, host: str, port: int, *, api_key: str | None, log_level: str) -> None:
    """Serve until SIGINT/SIGTERM; the vLLM server is deregistered on the way out."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level.upper())
    failed = False

    def stop() -> None:
        nonlocal failed
        failed = server.should_exit = True

    app = build_app(bridge, api_key, stop)
    server = uvicorn.Server(server_config(app, host, port, log_level, DEFAULT_LIMITS))
    log.info(
        "bridging %s (events %s) at http://%s:%d", bridge.engine_url, bridge.subscriber.endpoint, host, port
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
    if failed:
        sys.exit(1)
