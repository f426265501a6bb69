"""The gateway's HTTP face: an OpenAI base URL that routes each request to a replica.

:class:`Gateway` builds the parts from the settings and wires them: the fleet (every replica, fed
by the index mirror's polls and the static discovery of ``gateway.health``), the router over the
fleet and the index, the request path (``gateway.pipeline``), the admin API. The two generation
endpoints are plain ASGI (:meth:`gateway.pipeline.Pipeline.serve`); every other endpoint is a
Starlette route. The lifespan starts the mirror and the health checks and closes the clients.
uvicorn runs it on uvloop with httptools.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway.admin import AdminAPI
from gateway.auth import GatewayAuth
from gateway.fleet.fleet import Fleet
from gateway.health import HealthChecks
from gateway.index.mirror import IndexMirror
from gateway.metrics import GatewayMetrics
from gateway.pipeline import GENERATION_PATHS, Pipeline
from gateway.priority import DEFAULT_NICE, raise_priority
from gateway.proxy.upstream import UpstreamPool
from gateway.routing import Router
from gateway.settings import GatewaySettings
from gateway.tokenizer_registry import TokenizerRegistry
from kvroute.http import FastPosts, http_error, openai_errors
from kvroute.http_server import DEFAULT_LIMITS, ServerLimits, server_config
from kvroute.protocol import GATEWAY_ID_HEADER

log = logging.getLogger("kvroute.gateway")


class Gateway:
    """Every part of one gateway, built from its settings."""

    def __init__(self, settings: GatewaySettings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = GatewayMetrics(registry)
        auth = {"authorization": f"Bearer {settings.replica_key}"} if settings.replica_key else {}
        self.gateway_id = secrets.token_hex(8)  # replicas report this gateway's share of their load
        self.http = httpx.AsyncClient(  # everything but proxying: tokenizer fetches, discovery, probes
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=2.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=16),
            headers=auth,
        )
        self.upstream = UpstreamPool(
            read_timeout=settings.upstream_timeout_s, headers={**auth, GATEWAY_ID_HEADER: self.gateway_id}
        )
        self.tokenizers = TokenizerRegistry(self.http, cache_bytes=settings.tokenizer_cache_bytes)
        self.fleet = Fleet(
            eject_after=settings.eject_after, static_urls=settings.replicas, ejections=self.metrics.ejections
        )
        self.mirror = IndexMirror(  # never started without Redis: it then stays empty
            settings.redis_url or "",
            prefix=settings.redis_prefix,
            poll_interval=settings.poll_interval_s,
            registry=registry,
            on_poll=self.fleet.heard,
        )
        self.health = HealthChecks(self.http, self.fleet, probe_interval_s=settings.probe_interval_s)
        self.router = Router.from_settings(settings, self.fleet, self.mirror, self.gateway_id)
        self.pipeline = Pipeline(
            self.fleet,
            self.router,
            self.tokenizers,
            self.upstream,
            self.metrics,
            request_limits=settings.request_limits,
            ttfb_timeout_s=settings.ttfb_timeout_s,
        )
        self.admin = AdminAPI(
            self.fleet,
            self.router,
            self.pipeline,
            self.metrics,
            self.mirror.index,
            drains=self.mirror.drains if settings.redis_url is not None else None,
            request_limits=settings.request_limits,
        )

    def routes(self) -> list[Route]:
        endpoints = [
            ("/v1/models", self.models, "GET"),
            ("/health", self.health_status, "GET"),
            ("/metrics", self.prometheus, "GET"),
        ]
        routes = [
            Route(path, openai_errors(handler), methods=[method]) for path, handler, method in endpoints
        ]
        return routes + self.admin.routes()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.settings.redis_url is not None:
            await self.mirror.start()
        await self.health.start()
        try:
            yield
        finally:
            await self.health.stop()
            await self.mirror.stop()
            await self.upstream.aclose()
            await self.http.aclose()

    async def models(self, request: Request) -> Response:
        names = sorted({replica.model for replica in self.fleet.listed()})
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvroute"} for name in names]
        return JSONResponse({"object": "list", "data": data})

    async def health_status(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "redis": self.router.index_status,
                "replicas": len(self.fleet.listed()),
                "ejected": sorted(self.fleet.ejected()),
            }
        )

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: GatewaySettings) -> ASGIApp:
    """The gateway app; its lifespan starts the index mirror and closes the upstream pools."""
    if settings.metrics_key_required and not (settings.api_keys or settings.admin_key):
        raise ValueError("--metrics-key-required needs --api-key or --admin-key")
    gateway = Gateway(settings, CollectorRegistry())
    routes = Starlette(
        routes=gateway.routes(), lifespan=gateway.lifespan, exception_handlers={HTTPException: http_error}
    )
    return GatewayAuth(
        FastPosts(routes, dict.fromkeys(GENERATION_PATHS, gateway.pipeline.serve)),
        api_keys=settings.api_keys,
        admin_key=settings.admin_key,
        metrics_key_required=settings.metrics_key_required,
        rate_limits=settings.rate_limits,
    )


def run_gateway(
    settings: GatewaySettings,
    host: str,
    port: int,
    log_level: str = "info",
    limits: ServerLimits = DEFAULT_LIMITS,
    nice: int = DEFAULT_NICE,
) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level.upper())
    raise_priority(nice)
    app = build_app(settings)
    log.info(
        "gateway at http://%s:%d/v1 (policy %s, index from %s)",
        host,
        port,
        settings.policy,
        settings.redis_url,
    )
    uvicorn.Server(server_config(app, host, port, log_level, limits, loop="uvloop")).run()
