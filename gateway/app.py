"""The gateway's HTTP face: an OpenAI base URL that routes each request to a replica.

Per request: validate (the shared OpenAI schema, so bad input never reaches a replica), find the
model's live replicas in the Redis index mirror, tokenize exactly as they do (their own tokenizer,
fetched once and checked against the fingerprint they registered; ids reused across a chat's turns,
see ``gateway.tokenizer_registry``), hash the prompt's blocks, let the policy choose, then proxy
(``gateway.proxy`` over ``gateway.upstream``): retried on the next-best replica until a byte has
reached the client, streamed through untouched, with ``x-kvroute-replica`` and
``x-kvroute-predicted-cached-tokens`` headers.

The two generation endpoints are plain ASGI (:meth:`_GatewayAPI.serve_generation`): Starlette's
routing, middleware and response layers cost more CPU per request than the gateway's own work.
Every other endpoint is a Starlette route. uvicorn runs it on uvloop with httptools.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin import AdminAPI
from gateway.auth import GatewayAuth
from gateway.health import ReplicaHealth
from gateway.index_mirror import IndexMirror, ReplicaInfo
from gateway.metrics import GatewayMetrics, ReplicaStats
from gateway.policies import make_policy
from gateway.proxy import (
    SSERelay,
    UpstreamUnavailable,
    cached_tokens,
    forwarded_body,
    open_upstream,
)
from gateway.routing import RoutePlan, Router
from gateway.settings import GatewaySettings
from gateway.tokenizer_registry import TokenizerError, TokenizerRegistry
from gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from kvroute.http import FastPosts, http_error, openai_errors, read_body, unless_client_leaves
from kvroute.openai_api.errors import APIError, internal_error, model_not_found
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, parse_request
from kvroute.protocol import GATEWAY_ID_HEADER
from kvroute.text.prompt_ids import PromptIds
from kvroute.text.tokenizer import TextTokenizer

log = logging.getLogger("kvroute.gateway")

_LOAD_ONLY_POLICIES = frozenset({"round-robin", "least-loaded", "random"})  # need no index
_GENERATION_PATHS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


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
        self.replica_health = ReplicaHealth(
            self.http,
            eject_after=settings.eject_after,
            probe_interval_s=settings.probe_interval_s,
            ejections=self.metrics.ejections,
            static_urls=settings.replicas,
        )
        self.router = self._make_router(policy_settings)
        self.replica_stats: dict[str, ReplicaStats] = {}
        self.admin = AdminAPI(self)

    def routes(self) -> list[Route]:
        endpoints = [
            ("/v1/models", self.models, "GET"),
            ("/health", self.health, "GET"),
            ("/metrics", self.prometheus, "GET"),
        ]
        routes = [
            Route(path, openai_errors(handler), methods=[method]) for path, handler, method in endpoints
        ]
        return routes + self.admin.routes()

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
        return Router(
            self.mirror,
            policy,
            health=health,
            load_policy=load_policy,
            use_index=use_index,
            gateway_id=self.gateway_id,
        )

    async def _prompt(
        self, tokenizer: TextTokenizer, body: ChatCompletionRequest | CompletionRequest
    ) -> PromptIds:
        """The ids the replica will see (for a batch of completions prompts: the first one's)."""
        try:
            if isinstance(body, ChatCompletionRequest):
                return await self.tokenizers.encode_chat(tokenizer, *body.template_inputs())
            prompt = body.prompt[0]
            if isinstance(prompt, list):
                return PromptIds.of(prompt)
            return await self.tokenizers.encode_prompt(tokenizer, prompt)
        except OverflowError:
            raise APIError("Invalid 'prompt': token ids must be below 2**32.", param="prompt") from None
        except ValueError as error:
            raise APIError(f"Invalid 'messages': {error}", param="messages", code="invalid_value") from None

    async def decide(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[RoutePlan, PromptIds]:
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
        tokenizer = self.tokenizers.cached(body.model, fingerprint)
        if tokenizer is None:
            urls = [r.url for r in replicas if r.fingerprint == fingerprint]
            try:
                tokenizer = await self.tokenizers.get(body.model, fingerprint, urls)
            except TokenizerError as error:
                raise APIError(
                    f"Cannot tokenize for {body.model}: {error}", 503, code="tokenizer_unavailable"
                ) from None
        prompt = await self._prompt(tokenizer, body)
        route = self.router.route(
            body.model,
            fingerprint,
            replicas,
            prompt,
            request.headers.get("x-session-id"),
            policy=self.admin.policy_override(request),
        )
        return route, prompt

    # -- the generation endpoints (plain ASGI) ----------------------------------------------------

    async def serve_generation(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/chat/completions`` and ``POST /v1/completions``.

        Failures before the response starts become OpenAI error replies; after it has started (a
        stream), :meth:`_stream` reports them in the stream itself.
        """
        try:
            await self._generate(Request(scope, receive), send)
        except APIError as error:
            await error.to_response()(scope, receive, send)
        except ClientDisconnect:
            pass  # nobody to answer
        except Exception:
            log.exception("unhandled error in POST %s", scope["path"])
            await internal_error().to_response()(scope, receive, send)

    async def _generate(self, request: Request, send: Send) -> None:
        started = time.monotonic()
        raw = await read_body(request, self.settings.max_body_bytes)
        path = request.scope["path"]
        body = parse_request(_GENERATION_PATHS[path], raw)
        route, prompt = await self.decide(request, body)
        self.metrics.routing.observe(time.monotonic() - started)
        if route.decision.replica_id is None:
            raise APIError(
                "Every replica of this model has a full queue; retry later.", 429, code="rate_limit_exceeded"
            )
        forward, client_wants_usage = forwarded_body(raw, body)
        # Count the request on the winner before awaiting anything: decisions taken meanwhile (a
        # burst of requests with one new prefix) must see its load and its predicted blocks.
        replica = route.ordered[0]
        ticket = self._commit(route, replica, len(prompt), body.num_sequences)
        try:
            urls = [r.url for r in route.ordered]
            opening = open_upstream(self.upstream, urls, path, forward, whole=not body.stream)
            # A whole reply can take minutes: a client that leaves meanwhile cancels it, which
            # closes the replica connection, so the replica aborts the request (a stream's client
            # is watched the same way in _stream).
            if body.stream:
                upstream = await opening
            elif (upstream := await unless_client_leaves(request.receive, opening)) is None:
                raise ClientDisconnect()
        except UpstreamUnavailable as error:
            self.router.done(ticket)
            self._report_failures(route.ordered, error.failures)
            raise APIError(
                f"No replica could take the request: {error}", 503, code="service_unavailable"
            ) from None
        except BaseException:  # cancelled: the request is no longer in flight
            self.router.done(ticket)
            raise
        self._report_failures(route.ordered, upstream.failures)
        if upstream.url != replica.url:  # retried elsewhere: move the count and the prediction
            self.router.done(ticket)
            replica = next(r for r in route.ordered if r.url == upstream.url)
            ticket = self._commit(route, replica, len(prompt), body.num_sequences)
        response = upstream.response
        predicted = route.predicted_tokens.get(replica.replica_id, 0)
        model = self.metrics.model(body.model)
        self.metrics.requests_for(
            body.model, replica.replica_id, route.decision.policy, response.status
        ).inc()
        if upstream.failures:
            model.retries.inc(len(upstream.failures))
        model.prompt_tokens.inc(len(prompt))
        model.predicted_cached_tokens.inc(predicted)
        stats = self._stats(replica.replica_id)
        stats.requests += 1
        headers = [
            (b"x-kvroute-replica", replica.replica_id.encode()),
            (b"x-kvroute-predicted-cached-tokens", b"%d" % predicted),
        ]
        if body.stream and response.status == 200:
            relay = SSERelay(response, forward_usage=client_wants_usage)
            await self._stream(request, send, relay, headers, ticket, body.model, started, replica, predicted)
            return
        try:
            content = await response.read()
        except UpstreamError as error:
            self.replica_health.failed(replica.replica_id, replica.url, str(error))
            raise APIError(
                f"Replica {replica.replica_id} failed before completing the response ({error}).",
                502,
                code="upstream_failed",
            ) from None
        finally:
            response.close()
            self.router.done(ticket)
        model.e2e.observe(time.monotonic() - started)
        if response.status == 200:
            self.replica_health.succeeded(replica.replica_id)
            self._count_cached(body.model, replica.replica_id, predicted, json.loads(content).get("usage"))
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [*_JSON_HEADERS, (b"content-length", b"%d" % len(content)), *headers],
            }
        )
        await send({"type": "http.response.body", "body": content})

    async def _stream(
        self,
        request: Request,
        send: Send,
        relay: SSERelay,
        headers: list[tuple[bytes, bytes]],
        ticket: int,
        model: str,
        started: float,
        replica: ReplicaInfo,
        predicted: int,
    ) -> None:
        """Relays the replica's events. If the client leaves, the upstream request is closed, so the
        replica aborts it and frees its pages; if the replica breaks off (killed, connection lost),
        the client gets an OpenAI error event and ``[DONE]``."""
        response: UpstreamResponse = relay.response
        # The server answers receive() when the client disconnects (or once the response is over).
        client_left = asyncio.ensure_future(request.receive())
        client_left.add_done_callback(lambda _: response.close())
        broken: str | None = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [*_SSE_HEADERS, *headers]})
            async with aclosing(aiter(relay)) as events:
                try:
                    async for events_read in events:
                        if relay.finished:  # out of flight before the client can send its next turn
                            self.router.done(ticket)
                        await send({"type": "http.response.body", "body": events_read, "more_body": True})
                except UpstreamError as error:
                    broken = str(error)
            if client_left.done():
                return
            if broken is None and not relay.finished:
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
                event = b"data: " + json.dumps(error.to_dict()).encode() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except OSError:
            pass  # the client left (servers of ASGI spec 2.4 and later say so on send)
        finally:
            client_left.cancel()
            response.close()
            self.router.done(ticket)
            metrics = self.metrics.model(model)
            if relay.first_event_at is not None:
                metrics.ttft.observe(relay.first_event_at - started)
            metrics.e2e.observe(time.monotonic() - started)
            self._count_cached(model, replica.replica_id, predicted, relay.usage)

    def _commit(self, route: RoutePlan, replica: ReplicaInfo, prompt_tokens: int, sequences: int) -> int:
        """Marks the prompt's blocks as predicted on ``replica`` and counts it in flight there."""
        self.mirror.predict(replica.replica_id, route.hashes, self.settings.prediction_ttl_s)
        predicted = route.predicted_tokens.get(replica.replica_id, 0)
        return self.router.sent(replica.replica_id, prompt_tokens - predicted, sequences)

    def _report_failures(self, tried: list[ReplicaInfo], failures: list[tuple[str, str]]) -> None:
        by_url = {info.url: info for info in tried}
        for url, why in failures:
            if (info := by_url.get(url)) is not None:
                self.replica_health.failed(info.replica_id, url, why)

    def _stats(self, replica_id: str) -> ReplicaStats:
        stats = self.replica_stats.get(replica_id)
        if stats is None:
            stats = self.replica_stats[replica_id] = ReplicaStats()
        return stats

    def _count_cached(
        self, model: str, replica_id: str, predicted: int, usage: dict[str, Any] | None
    ) -> None:
        """Records the real outcome of a routing decision, when the replica's usage says it."""
        tokens = cached_tokens(usage)
        if tokens is None or usage is None:
            return
        self.metrics.model(model).cached_tokens.inc(tokens)
        stats = self._stats(replica_id)
        stats.usage_reports += 1
        prompt_tokens = usage.get("prompt_tokens")
        stats.prompt_tokens += prompt_tokens if isinstance(prompt_tokens, int) else 0
        stats.predicted_cached_tokens += predicted
        stats.cached_tokens += tokens

    # -- Starlette routes -------------------------------------------------------------------------

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


def build_app(settings: GatewaySettings) -> ASGIApp:
    """The gateway app; its lifespan starts the index mirror and closes the upstream pools."""
    if settings.metrics_key_required and not (settings.api_keys or settings.admin_key):
        raise ValueError("--metrics-key-required needs --api-key or --admin-key")
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
            await api.upstream.aclose()
            await api.http.aclose()

    routes = Starlette(routes=api.routes(), lifespan=lifespan, exception_handlers={HTTPException: http_error})
    return GatewayAuth(
        FastPosts(routes, dict.fromkeys(_GENERATION_PATHS, api.serve_generation)),
        api_keys=settings.api_keys,
        admin_key=settings.admin_key,
        metrics_key_required=settings.metrics_key_required,
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
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), loop="uvloop", http="httptools")
