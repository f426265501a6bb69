"""Bearer keys, the one rule gateways and replicas both apply.

``Authorization: Bearer <key>``: the scheme in any case (RFC 7235), the key compared with every
configured key in constant time (``hmac.compare_digest``), so timing tells nothing about which
key, or how much of one, matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from kvroute.openai_api.errors import APIError


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (raw ASGI headers), else None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def key_matches(token: bytes | None, keys: Iterable[bytes]) -> bool:
    """True if ``token`` equals one of ``keys``; compares against all of them, in constant time."""
    if token is None:
        return False
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


def parse_keys(flags: Iterable[str] | None, env_value: str | None) -> tuple[str, ...]:
    """Keys from repeated flags, else from a comma-separated environment value; blanks dropped."""
    keys = list(flags or []) or (env_value or "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def unauthorized(message: str) -> APIError:
    """The OpenAI error for a missing or wrong key (401)."""
    return APIError(message, 401, type="authentication_error", code="invalid_api_key")


class SharedKeyAuth:
    """Requires ``Authorization: Bearer <key>`` (the key only gateways hold) on every path but
    ``open_paths``; 401 with an OpenAI error otherwise. A replica's and a bridge's guard."""

    def __init__(self, app: ASGIApp, key: str, open_paths: Iterable[str] = ("/health", "/metrics")) -> None:
        self.app = app
        self.keys = (key.encode(),)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["path"] not in self.open_paths
        if guarded and not key_matches(bearer_token(scope["headers"]), self.keys):
            await unauthorized("Missing or incorrect replica key.").to_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
