"""The replica's HTTP face: OpenAI routes, vLLM's /tokenize, /detokenize, /health and /metrics.

Every failure leaves as an OpenAI error object: validation and limits as 4xx, anything unexpected
as a logged 500, never Starlette's plain-text or HTML pages, because clients parse every reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp
from uvicorn.main import STARTUP_FAILURE

from kvroute.auth import SharedKeyAuth
from kvroute.http import (
    DEFAULT_REQUEST_LIMITS,
    FastPosts,
    Handler,
    RequestLimits,
    asgi_endpoint,
    http_error,
    openai_errors,
    read_body,
)
from kvroute.http_server import DEFAULT_LIMITS, ServerLimits, server_config
from kvroute.openai_api.errors import APIError, model_not_found
from kvroute.openai_api.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from kvroute.text.tokenizer import TextTokenizer
from replica.engine.async_engine import AsyncEngine
from replica.engine.config import EngineConfig
from replica.kvcache.events import KVEventOutbox
from replica.publisher import KVPublisher, PublisherConfig
from replica.server.metrics import ReplicaMetrics
from replica.server.openai_serving import OpenAIServing

log = logging.getLogger("kvroute.replica")

GRACEFUL_SHUTDOWN_S = 30  # in-flight requests get this long to finish on SIGTERM


def _tokenize(tokenizer: TextTokenizer, body: TokenizeRequest) -> list[int]:
    """vLLM's /tokenize: plain text adds special tokens by default, a chat does not."""
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    messages, tools, template_kwargs = body.template_inputs()
    text = tokenizer.render_chat(messages, tools, body.add_generation_prompt, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


class _ReplicaAPI:
    """The route handlers of one app, bound to its engine."""

    def __init__(self, engine: AsyncEngine, request_limits: RequestLimits) -> None:
        self.engine = engine
        self.request_limits = request_limits
        self.metrics = ReplicaMetrics(engine.stats, engine.served_model_name)
        self.serving = OpenAIServing(engine, self.metrics, request_limits.max_prompt_chars)
        self.created = int(time.time())

    def generation_endpoints(self) -> dict[str, ASGIApp]:
        """The two hot endpoints, served past Starlette's routing layers (see ``FastPosts``)."""
        return {
            "/v1/chat/completions": asgi_endpoint(openai_errors(self.chat)),
            "/v1/completions": asgi_endpoint(openai_errors(self.completions)),
        }

    def routes(self) -> list[Route]:
        endpoints: list[tuple[str, Handler, str]] = [
            ("/v1/models", self.models, "GET"),
            ("/v1/models/{model:path}", self.model, "GET"),
            ("/tokenize", self.tokenize, "POST"),
            ("/detokenize", self.detokenize, "POST"),
            ("/kvroute/tokenizer", self.tokenizer_files, "GET"),
            ("/reset_prefix_cache", self.reset_prefix_cache, "POST"),
            ("/health", self.health, "GET"),
            ("/metrics", self.prometheus, "GET"),
        ]
        return [Route(path, openai_errors(handler), methods=[method]) for path, handler, method in endpoints]

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.served_model_name:
            raise model_not_found(model)

    async def chat(self, request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_body(request, self.request_limits))
        self._check_model(body.model)
        return await self.serving.chat(body, request)

    async def completions(self, request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_body(request, self.request_limits))
        self._check_model(body.model)
        return await self.serving.completions(body, request)

    def _model_card(self) -> dict[str, Any]:
        name = self.engine.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvroute",
            "root": name,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize (``_tokenize``)."""
        body = parse_request(TokenizeRequest, await read_body(request, self.request_limits))
        self._check_model(body.model)
        tokenizer = self.engine.tokenizer
        if body.messages is not None and len(body.messages) > self.engine.max_model_len:
            raise APIError(  # a token a message at least: no prompt of this model
                f"Invalid 'messages': {len(body.messages)} messages are more than this model's"
                f" {self.engine.max_model_len} tokens of context.",
                param="messages",
                code="context_length_exceeded",
            )
        try:  # rendering and encoding a long chat takes a while: off the event loop
            tokens = await asyncio.to_thread(_tokenize, tokenizer, body)
        except ValueError as error:
            raise APIError(f"Invalid 'messages': {error}", param="messages", code="invalid_value") from None
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: Request) -> Response:
        body = parse_request(DetokenizeRequest, await read_body(request, self.request_limits))
        self._check_model(body.model)
        vocab_size = self.engine.tokenizer.vocab_size
        if body.tokens and max(body.tokens) >= vocab_size:
            raise APIError(
                f"Invalid 'tokens': token id {max(body.tokens)} is out of vocabulary (size {vocab_size}).",
                param="tokens",
                code="invalid_value",
            )
        return JSONResponse({"prompt": self.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def tokenizer_files(self, request: Request) -> Response:
        """The tokenizer's source files (``TextTokenizer.served_files``)."""
        engine = self.engine
        files = engine.tokenizer.served_files(
            engine.served_model_name, engine.stats().block_size, engine.max_model_len
        )
        return JSONResponse(files)

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's endpoint: drop every cached page no running request uses (removed events follow)."""
        return JSONResponse({"evicted_pages": await self.engine.reset_prefix_cache()})

    async def health(self, request: Request) -> Response:
        if not self.engine.is_running:
            raise APIError("The engine is not running.", 503)
        return Response(status_code=200)

    async def prometheus(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})


def build_app(
    engine: AsyncEngine,
    *,
    request_limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
    publisher_config: PublisherConfig | None = None,
    api_key: str | None = None,
) -> Starlette:
    """The replica app; its lifespan starts the engine thread and shuts it down on exit.

    With ``publisher_config`` (which needs an engine built with a ``KVEventOutbox``) the lifespan
    also publishes the cache to Redis: started after the engine, stopped (deregistered) before it.
    With ``api_key`` every route but /health and /metrics requires it as a Bearer token.
    """
    publisher = None if publisher_config is None else _make_publisher(engine, publisher_config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        engine.start()
        try:
            if publisher is not None:
                await publisher.start()
            try:
                yield
            finally:
                if publisher is not None:
                    await publisher.stop()
        finally:
            await engine.shutdown()

    api = _ReplicaAPI(engine, request_limits)
    middleware = [] if not api_key else [Middleware(SharedKeyAuth, key=api_key)]
    middleware.append(Middleware(FastPosts, posts=api.generation_endpoints()))
    app = Starlette(
        routes=api.routes(),
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.publisher = publisher
    return app


class _DeregisterFirstServer(uvicorn.Server):
    """uvicorn, except that the first shutdown signal also takes the replica out of Redis at once:
    gateways stop routing here while in-flight requests get their graceful period, instead of
    sending new work to a replica that no longer accepts connections."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self._app = app
        self._deregistration: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        publisher: KVPublisher | None = self._app.state.publisher
        loop: asyncio.AbstractEventLoop | None = getattr(self._app.state, "loop", None)
        if publisher is not None and loop is not None and not self.should_exit:
            log.info("shutting down: leaving the cache index now, finishing in-flight requests")
            loop.call_soon_threadsafe(self._start_deregistration, publisher)
        super().handle_exit(sig, frame)

    def _start_deregistration(self, publisher: KVPublisher) -> None:
        self._deregistration = asyncio.create_task(publisher.stop())


def _make_publisher(engine: AsyncEngine, config: PublisherConfig) -> KVPublisher:
    outbox = engine.engine.cache.outbox
    if outbox is None:
        raise ValueError("publishing to Redis needs an engine built with a KVEventOutbox")
    return KVPublisher(
        config,
        model=engine.served_model_name,
        fingerprint=engine.tokenizer.fingerprint,
        block_size=engine.engine.pool.page_size,
        outbox=outbox,
        stats=engine.stats,
    )


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(
    config: EngineConfig,
    host: str,
    port: int,
    *,
    request_limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
    limits: ServerLimits = DEFAULT_LIMITS,
    log_level: str = "info",
    publisher_config: PublisherConfig | None = None,
    api_key: str | None = None,
) -> None:
    """Load the model, then serve it until SIGINT/SIGTERM (in-flight requests get to finish).

    With ``publisher_config`` the cache and load are published to Redis; without it the replica
    runs standalone and its cache keeps no event outbox.
    """
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level.upper())  # also when a caller configured logging first
    outbox = None if publisher_config is None else KVEventOutbox()
    engine = AsyncEngine.from_config(config, outbox)
    app = build_app(engine, request_limits=request_limits, publisher_config=publisher_config, api_key=api_key)
    log.info("serving %s at %s/v1", engine.served_model_name, _url(host, port))
    if publisher_config is not None:
        log.info(
            "publishing the KV cache index to Redis as replica %s, advertised at %s",
            publisher_config.replica_id,
            publisher_config.advertise_url,
        )
    server_settings = server_config(
        app, host, port, log_level, limits, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
    )
    server = _DeregisterFirstServer(server_settings, app)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)  # e.g. the port is taken: as uvicorn.run does
