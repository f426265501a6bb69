"""uvicorn as the gateway and the replicas run it: bounded connections, no secret in a log line.

uvicorn alone lets a client hold a connection forever by sending half a request (it times out
idle keep-alive connections only after a response), answers a malformed request in plain text,
and logs every request line with its query string, where a key sent as ``?api_key=`` would end
up. :class:`GuardedProtocol` (its httptools protocol) adds a connection cap (JSON 503 with
``retry-after`` above it), a deadline for the request head, and OpenAI-shaped errors for what it
refuses; :class:`NoQueryInLogs` keeps query strings out of the access log. The body's deadline
is ``kvroute.http.read_body``'s, where the application reads it (``--body-timeout``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvroute.openai_api.errors import APIError
from kvroute.settings import option


@dataclass(frozen=True)
class ServerLimits:
    """What one server process admits; the same flags on the gateway and on a replica."""

    max_connections: int = option(
        1024, "--max-connections", "open client connections this process accepts; above, a 503 at once"
    )
    header_timeout_s: float = option(
        10.0, "--header-timeout", "seconds a client may take to send a request's line and headers"
    )
    keep_alive_s: float = option(5.0, "--keep-alive", "seconds an idle keep-alive connection stays open")


DEFAULT_LIMITS = ServerLimits()


def _error_bytes(error: APIError, *extra_headers: bytes) -> bytes:
    """A whole HTTP/1.1 response carrying ``error``, written straight to the transport."""
    body = json.dumps(error.to_dict()).encode()
    head = [
        f"HTTP/1.1 {error.status} {_REASONS[error.status]}".encode(),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"connection: close",
        *extra_headers,
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap, a deadline for each request's head,
    and JSON errors. The limits come from :meth:`with_limits` (one subclass per server)."""

    limits = ServerLimits()

    @classmethod
    def with_limits(cls, limits: ServerLimits) -> type[GuardedProtocol]:
        return type("GuardedProtocol", (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            refusal = APIError("This server has too many open connections; retry shortly.", 503)
            transport.write(_error_bytes(refusal, b"retry-after: 1"))
            transport.close()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a keep-alive connection's next request
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse: an OpenAI error instead of uvicorn's plain text."""
        error = APIError("Invalid HTTP request: the request line or a header is malformed.", 400)
        self.transport.write(_error_bytes(error))
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            error = APIError("The request's line and headers did not arrive in time.", 408)
            self.transport.write(_error_bytes(error))
            self.transport.close()


class NoQueryInLogs(logging.Filter):
    """Drops the query string from uvicorn's access-log lines: a key sent as ``?api_key=`` (refused
    with 401, but still a key) must not reach a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?…", *args[3:])
        return True


def server_config(
    app: Any, host: str, port: int, log_level: str, limits: ServerLimits, **extra: Any
) -> uvicorn.Config:
    """The uvicorn configuration both the gateway and a replica run with."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        http=GuardedProtocol.with_limits(limits),
        timeout_keep_alive=limits.keep_alive_s,
        **extra,
    )
    logging.getLogger("uvicorn.access").addFilter(NoQueryInLogs())
    return config
