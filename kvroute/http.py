"""HTTP pieces the replica server and the gateway share: bounded bodies, OpenAI-shaped failures."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvroute.openai_api.errors import APIError, internal_error
from kvroute.settings import DEFAULT_MAX_BODY_BYTES, option

DEFAULT_BODY_TIMEOUT_S = 30.0

log = logging.getLogger("kvroute.http")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; nobody reads it

Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


def openai_errors(handler: Handler) -> Handler:
    """Turns whatever a handler raises into an OpenAI error reply (500s logged with traceback),
    because clients parse every reply and Starlette's own pages are plain text or HTML."""

    @functools.wraps(handler)
    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as error:
            return error.to_response()
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return internal_error().to_response()

    return guarded


class FastPosts:
    """Sends POSTs to a few hot paths straight to their own ASGI apps, everything else to ``app``.

    Starlette's exception middleware, router and endpoint wrappers cost more CPU per request than
    a generation request's own work in front of a fast replica (the gateway) or a cached prompt (the
    replica); the hot paths handle their own errors. Other methods on those paths get a 405.
    """

    def __init__(self, app: ASGIApp, posts: Mapping[str, ASGIApp]) -> None:
        self.app = app
        self.posts = dict(posts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.posts.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
        elif scope["method"] == "POST":
            await handler(scope, receive, send)
        else:
            response = APIError("Method Not Allowed", 405).to_response()
            response.headers["allow"] = "POST"
            await response(scope, receive, send)


def asgi_endpoint(handler: Handler) -> ASGIApp:
    """A request handler as a bare ASGI app, for :class:`FastPosts`."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


async def _disconnected(receive: Receive) -> None:
    """Returns once the client hangs up (the body has been read, so only that message is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(receive: Receive, work: Awaitable[T]) -> T | None:
    """Awaits ``work`` in this task, cancelling it if the client hangs up first; then None.

    The replica's engine requests and the gateway's upstream requests abort on that cancellation.
    One watcher task a request, and none for ``work`` itself: cheaper than racing two tasks.
    """
    task = asyncio.current_task()
    assert task is not None
    watching = True

    def client_left(watcher: asyncio.Future[None]) -> None:
        if watching and not watcher.cancelled():
            task.cancel()

    watcher = asyncio.ensure_future(_disconnected(receive))
    watcher.add_done_callback(client_left)
    try:
        return await work
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise  # cancelled from outside
        task.uncancel()
        return None
    finally:
        watching = False
        watcher.cancel()


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (unknown route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    return APIError(str(exc.detail), exc.status_code).to_response()


@dataclass(frozen=True)
class RequestLimits:
    """What a server accepts of one request: body size, the time its body may take to arrive, and
    (when set) prompt characters, beyond what the model's window allows (``kvroute.text.bounds``).
    The same flags on the gateway and on a replica."""

    max_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES, "--max-body-bytes", "request body limit in bytes; 413 above"
    )
    body_timeout_s: float = option(
        DEFAULT_BODY_TIMEOUT_S, "--body-timeout", "seconds a client may take to send a body; 408 after"
    )
    max_prompt_chars: int | None = option(
        None,
        "--max-prompt-chars",
        "prompt characters accepted at most, refused with 400 before tokenizing (default: what the"
        " model's window allows)",
    )


async def read_body(request: Request, limit: RequestLimits) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit.max_body_bytes`` (never
    read in full), and with 408 (closing the connection) if it takes longer than its timeout."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise APIError("Invalid Content-Length header.")
    if declared is not None and int(declared) > limit.max_body_bytes:
        raise _too_large(limit.max_body_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limit.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit.max_body_bytes:
                    raise _too_large(limit.max_body_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            f"The request body did not arrive within {limit.body_timeout_s:g} s.",
            408,
            code="request_timeout",
            headers={"connection": "close"},  # the rest of the body may still come: not a next request
        ) from None
    return b"".join(chunks)


DEFAULT_REQUEST_LIMITS = RequestLimits()


def _too_large(limit: int) -> APIError:
    return APIError(f"Request body too large: the limit is {limit} bytes.", 413, code="request_too_large")
