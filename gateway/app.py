"""The gateway's HTTP face: an OpenAI base URL that routes each request to a replica.

Per request: validate (the shared OpenAI schema, so bad input never reaches a replica), find the
model's live replicas in the Redis index mirror, tokenize exactly as they do (their own tokenizer,
fetched once and checked against the fingerprint they registered), hash the prompt's blocks, let
the policy choose, then proxy (``gateway.proxy``): retried on the next-best replica until a byte
has reached the client, streamed through untouched, with ``x-kvroute-replica`` and
``x-kvroute-predicted-cached-tokens`` headers.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.admin import AdminAPI
from gateway.auth import GatewayAuth
from gateway.health import DEFAULT_EJECT_AFTER, DEFAULT_PROBE_INTERVAL_S, ReplicaHealth
from gateway.index_mirror import IndexMirror, ReplicaInfo
from gateway.metrics import GatewayMetrics
from gateway.policies import make_policy
from gateway.proxy import SSERelay, UpstreamUnavailable, cached_tokens, open_upstream, with_usage_requested
from gateway.routing import RoutePlan, Router
from gateway.tokenizers import TokenizerError, TokenizerRegistry
from kvroute.errors import APIError, model_not_found
from kvroute.http import http_error, openai_errors, read_body
from kvroute.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request
from kvroute.redis_schema import DEFAULT_PREFIX
from kvroute.tokenizer import TextTokenizer

log = logging.getLogger("kvroute.gateway")

_JSON = {"content-type": "application/json"}
_LOAD_ONLY_POLICIES = frozenset({"round-robin", "least-loaded", "random"})  # need no index


@dataclass
class GatewaySettings:
    redis_url: str | None  # None: no index, replicas from ``replicas`` alone (load-only routing)
    redis_prefix: str = DEFAULT_PREFIX
    policy: str = "kv"
    lam: float = 1.0
    max_queue: int | None = None  # per-replica cap on waiting + in-flight requests
    prediction_ttl_s: float = 2.0  # how long routed blocks count as held before events confirm them
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    poll_interval_s: float = 0.5
    replicas: tuple[str, ...] = ()  # static replica URLs: fallback with Redis, the only source without
    eject_after: int = DEFAULT_EJECT_AFTER  # consecutive failures that take a replica out of rotation
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S  # between health probes of ejected replicas
    api_keys: tuple[str, ...] = ()  # Bearer keys for /v1 (none: open); see gateway.auth
    admin_key: str | None = None  # Bearer key for /admin (none: the admin API is disabled)
    metrics_key_required: bool = False  # /metrics needs a data or admin key
    replica_key: str | None = None  # Bearer key sent on every call to a replica


class _GatewayAPI:
    def __init__(self, settings: GatewaySettings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.mirror = IndexMirror(  # never started without Redis: it then stays empty
            settings.redis_url or "",
            prefix=settings.redis_prefix,
            poll_interval=settings.poll_interval_s,
            registry=registry,
        )
        policy_settings: dict[str, Any] = {"lam": settings.lam}
        if settings.max_queue is not None:
            policy_settings["max_queue"] = settings.max_queue
        self.metrics = GatewayMetrics(registry)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=2.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            headers={"authorization": f"Bearer {settings.replica_key}"} if settings.replica_key else None,
        )
        self.tokenizers = TokenizerRegistry(self.http)
        self.replica_health = ReplicaHealth(
            self.http,
            eject_after=settings.eject_after,
            probe_interval_s=settings.probe_interval_s,
            ejections=self.metrics.ejections,
            static_urls=settings.replicas,
        )
        self.router = self._make_router(policy_settings)
        self.admin = AdminAPI(self)

    def routes(self) -> list[Route]:
        endpoints = [
            ("/v1/chat/completions", self.chat, "POST"),
            ("/v1/completions", self.completions, "POST"),
            ("/v1/models", self.models, "GET"),
            ("/health", self.health, "GET"),
            ("/metrics", self.prometheus, "GET"),
        ]
        routes = [
            Route(path, openai_errors(handler), methods=[method]) for path, handler, method in endpoints
        ]
        return routes + self.admin.routes()

    async def chat(self, request: Request) -> Response:
        raw = await read_body(request, self.settings.max_body_bytes)
        return await self._generate(
            request, raw, parse_request(ChatCompletionRequest, raw), "/v1/chat/completions"
        )

    async def completions(self, request: Request) -> Response:
        raw = await read_body(request, self.settings.max_body_bytes)
        return await self._generate(request, raw, parse_request(CompletionRequest, raw), "/v1/completions")

    def _make_router(self, policy_settings: dict[str, Any]) -> Router:
        """The configured policy, and a load-only one for when the index cannot be used."""
        policy = make_policy(self.settings.policy, **policy_settings)
        load_policy = policy
        if policy.name not in _LOAD_ONLY_POLICIES:
            load_policy = make_policy("least-loaded", **policy_settings)
            if self.settings.redis_url is None:
                log.warning("policy %s needs the Redis index; routing least-loaded instead", policy.name)
        use_index = self.settings.redis_url is not None
        health = self.replica_health
        return Router(self.mirror, policy, health=health, load_policy=load_policy, use_index=use_index)

    async def _prompt_ids(
        self, tokenizer: TextTokenizer, body: ChatCompletionRequest | CompletionRequest
    ) -> list[int]:
        """The ids the replica will see (for a batch of completions prompts: the first one's)."""
        try:
            if isinstance(body, ChatCompletionRequest):
                return await self.tokenizers.encode_chat(tokenizer, *body.template_inputs())
            prompt = body.prompt[0]
            return (
                list(prompt)
                if isinstance(prompt, list)
                else await self.tokenizers.encode_prompt(tokenizer, prompt)
            )
        except ValueError as error:
            raise APIError(f"Invalid 'messages': {error}", param="messages", code="invalid_value") from None

    async def decide(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[RoutePlan, list[int]]:
        """Tokenize as the replicas do and let the policy (or an admin's override) choose.

        The request path and ``POST /admin/route`` both call this, so the explained decision is
        the one a real request would get.
        """
        fingerprint, replicas = self.router.replicas_by_fingerprint(body.model)
        if fingerprint is None:
            raise model_not_found(body.model)
        for info in replicas:
            if info.fingerprint != fingerprint:
                self.metrics.fingerprint_mismatches.labels(body.model, info.replica_id).inc()
        urls = [r.url for r in replicas if r.fingerprint == fingerprint]
        try:
            tokenizer = await self.tokenizers.get(body.model, fingerprint, urls)
        except TokenizerError as error:
            raise APIError(
                f"Cannot tokenize for {body.model}: {error}", 503, code="tokenizer_unavailable"
            ) from None
        prompt_ids = await self._prompt_ids(tokenizer, body)
        route = self.router.route(
            body.model,
            fingerprint,
            replicas,
            prompt_ids,
            request.headers.get("x-session-id"),
            policy=self.admin.policy_override(request),
        )
        return route, prompt_ids

    async def _generate(
        self, request: Request, raw: bytes, body: ChatCompletionRequest | CompletionRequest, path: str
    ) -> Response:
        started = time.monotonic()
        route, prompt_ids = await self.decide(request, body)
        self.metrics.routing.observe(time.monotonic() - started)
        if route.decision.replica_id is None:
            raise APIError(
                "Every replica of this model has a full queue; retry later.", 429, code="rate_limit_exceeded"
            )
        payload, client_wants_usage = with_usage_requested(json.loads(raw))
        # Count the request on the winner before awaiting anything: decisions taken meanwhile (a
        # burst of requests with one new prefix) must see its load and its predicted blocks.
        replica = route.ordered[0]
        ticket = self._commit(route, replica, len(prompt_ids))
        try:
            upstream = await open_upstream(
                self.http, [r.url for r in route.ordered], path, json.dumps(payload).encode(), _JSON
            )
        except UpstreamUnavailable as error:
            self.router.done(ticket)
            self._report_failures(route.ordered, error.failures)
            raise APIError(
                f"No replica could take the request: {error}", 503, code="service_unavailable"
            ) from None
        self._report_failures(route.ordered, upstream.failures)
        if upstream.url != replica.url:  # retried elsewhere: move the count and the prediction
            self.router.done(ticket)
            replica = next(r for r in route.ordered if r.url == upstream.url)
            ticket = self._commit(route, replica, len(prompt_ids))
        predicted = route.predicted_tokens.get(replica.replica_id, 0)
        labels = (body.model, replica.replica_id, route.decision.policy, str(upstream.response.status_code))
        self.metrics.requests.labels(*labels).inc()
        self.metrics.retries.labels(body.model).inc(len(upstream.failures))
        self.metrics.prompt_tokens.labels(body.model).inc(len(prompt_ids))
        self.metrics.predicted_cached_tokens.labels(body.model).inc(predicted)
        headers = {
            "x-kvroute-replica": replica.replica_id,
            "x-kvroute-predicted-cached-tokens": str(predicted),
        }
        if body.stream and upstream.response.status_code == 200:
            relay = SSERelay(upstream.response, forward_usage=client_wants_usage)
            events = self._relay(relay, ticket, body.model, started, replica)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            content = await upstream.response.aread()
        except httpx.HTTPError as error:
            why = f"{type(error).__name__}: {error}"
            self.replica_health.failed(replica.replica_id, replica.url, why)
            raise APIError(
                f"Replica {replica.replica_id} failed before completing the response ({why}).",
                502,
                code="upstream_failed",
            ) from None
        finally:
            await upstream.response.aclose()
            self.router.done(ticket)
        self.metrics.e2e.labels(body.model).observe(time.monotonic() - started)
        if upstream.response.status_code == 200:
            self.replica_health.succeeded(replica.replica_id)
            self._count_cached(body.model, json.loads(content).get("usage"))
        return Response(
            content, status_code=upstream.response.status_code, headers=headers, media_type="application/json"
        )

    def _commit(self, route: RoutePlan, replica: ReplicaInfo, prompt_tokens: int) -> int:
        """Marks the prompt's blocks as predicted on ``replica`` and counts it in flight there."""
        self.mirror.predict(replica.replica_id, route.hashes, self.settings.prediction_ttl_s)
        predicted = route.predicted_tokens.get(replica.replica_id, 0)
        return self.router.sent(replica.replica_id, prompt_tokens - predicted)

    def _report_failures(self, tried: list[ReplicaInfo], failures: list[tuple[str, str]]) -> None:
        by_url = {info.url: info for info in tried}
        for url, why in failures:
            if (info := by_url.get(url)) is not None:
                self.replica_health.failed(info.replica_id, url, why)

    async def _relay(
        self, relay: SSERelay, ticket: int, model: str, started: float, replica: ReplicaInfo
    ) -> AsyncIterator[bytes]:
        """The replica's events; however the stream ends (the client may leave), the upstream
        request is closed, so the replica aborts it and frees its pages. If the replica breaks
        off (killed, connection lost), the client gets an OpenAI error event and ``[DONE]``."""
        broken: str | None = None
        finished = False
        try:
            async with aclosing(aiter(relay)) as events:
                try:
                    async for event in events:
                        finished = finished or event.startswith(b"data: [DONE]")
                        yield event
                except httpx.HTTPError as error:
                    broken = f"{type(error).__name__}: {error}"
            if broken is None and not finished:
                broken = "the stream ended without [DONE]"
            if broken is None:
                self.replica_health.succeeded(replica.replica_id)
            else:
                self.replica_health.failed(replica.replica_id, replica.url, broken)
                log.warning("stream from replica %s broke off: %s", replica.replica_id, broken)
                error = APIError(
                    f"Replica {replica.replica_id} failed mid-stream ({broken}); the response is incomplete.",
                    502,
                    code="upstream_failed",
                )
                yield b"data: " + json.dumps(error.to_dict()).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            self.router.done(ticket)
            if relay.first_event_at is not None:
                self.metrics.ttft.labels(model).observe(relay.first_event_at - started)
            self.metrics.e2e.labels(model).observe(time.monotonic() - started)
            self._count_cached(model, relay.usage)

    def _count_cached(self, model: str, usage: dict[str, Any] | None) -> None:
        tokens = cached_tokens(usage)
        if tokens is not None:
            self.metrics.cached_tokens.labels(model).inc(tokens)

    async def models(self, request: Request) -> Response:
        names = sorted({r.model for r in self.router.known_replicas()})
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "kvroute"} for name in names]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "redis": "none" if not self.router.use_index else "stale" if self.mirror.stale else "ok",
                "replicas": len(self.router.known_replicas()),
                "ejected": sorted(self.replica_health.ejected),
            }
        )

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: GatewaySettings) -> Starlette:
    """The gateway app; its lifespan starts the index mirror and closes the upstream pool."""
    api = _GatewayAPI(settings, CollectorRegistry())

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if settings.redis_url is not None:
            await api.mirror.start()
        await api.replica_health.start()
        try:
            yield
        finally:
            await api.replica_health.stop()
            await api.mirror.stop()
            await api.http.aclose()

    if settings.metrics_key_required and not (settings.api_keys or settings.admin_key):
        raise ValueError("--metrics-key-required needs --api-key or --admin-key")
    auth = Middleware(
        GatewayAuth,
        api_keys=settings.api_keys,
        admin_key=settings.admin_key,
        metrics_key_required=settings.metrics_key_required,
    )
    return Starlette(
        routes=api.routes(),
        middleware=[auth],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )


def run_gateway(settings: GatewaySettings, host: str, port: int, log_level: str = "info") -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level.upper())
    app = build_app(settings)
    log.info(
        "gateway at http://%s:%d/v1 (policy %s, index from %s)",
        host,
        port,
        settings.policy,
        settings.redis_url,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
