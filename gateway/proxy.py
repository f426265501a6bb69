"""Forwarding one request to a replica: retried elsewhere until a byte has reached the client,
and relayed as the replica sent it, but for the usage the gateway asked for on its own behalf.

The gateway always asks the replica for usage (``stream_options.include_usage``) because usage
carries ``cached_tokens``, the real outcome of its routing decision. When the client did not ask,
that final usage-only SSE event is taken out; every other event passes through byte for byte.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRYABLE_STATUSES = frozenset({503})  # the replica is draining or its engine is down
_USAGE_EVENT_MARK = b'"choices":[]'  # the replica's compact JSON for the usage-only chunk


class UpstreamUnavailable(Exception):
    """Every candidate failed before answering; nothing reached the client, so it gets a 503."""

    def __init__(self, failures: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{url}: {why}" for url, why in failures) or "no replica to try")
        self.failures = failures


@dataclass
class Upstream:
    """A replica's answer whose status and headers have arrived; the body is still to be read."""

    url: str
    response: httpx.Response
    failures: list[tuple[str, str]] = field(default_factory=list)  # earlier candidates that failed


async def open_upstream(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    path: str,
    body: bytes,
    headers: dict[str, str],
) -> Upstream:
    """Sends to each URL in turn until one answers with something other than a retryable status.

    Only failures before the response headers are retried: after that, bytes may be on their way
    to the client and a second replica would duplicate them.
    """
    failures: list[tuple[str, str]] = []
    for url in urls:
        request = client.build_request("POST", url + path, content=body, headers=headers)
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as error:
            failures.append((url, f"{type(error).__name__}: {error}"))
            continue
        if response.status_code in RETRYABLE_STATUSES:
            await response.aclose()
            failures.append((url, f"HTTP {response.status_code}"))
            continue
        return Upstream(url, response, failures)
    raise UpstreamUnavailable(failures)


def with_usage_requested(payload: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The request body to forward (streams always ask for usage), and whether the client asked."""
    if not payload.get("stream"):
        return payload, True  # non-streaming replies always carry usage
    options = payload.get("stream_options") or {}
    client_asked = bool(options.get("include_usage"))
    return {**payload, "stream_options": {**options, "include_usage": True}}, client_asked


class SSERelay:
    """Iterates the replica's SSE body event by event, recording usage and first-byte time.

    Closing the relay (or the client going away, which cancels its consumer) closes the upstream
    response, and the replica aborts the request when its connection drops.
    """

    def __init__(self, response: httpx.Response, forward_usage: bool) -> None:
        self.response = response
        self.forward_usage = forward_usage
        self.usage: dict[str, Any] | None = None
        self.first_event_at: float | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        try:
            async for data in self.response.aiter_bytes():
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if self.first_event_at is None:
                        self.first_event_at = time.monotonic()
                    if _USAGE_EVENT_MARK in event and self._take_usage(event) and not self.forward_usage:
                        continue
                    yield event + b"\n\n"
            if buffer:
                yield buffer
        finally:
            await self.response.aclose()

    def _take_usage(self, event: bytes) -> bool:
        """Records the usage of a usage-only chunk; False if the event is something else."""
        if not event.startswith(b"data: {"):
            return False
        chunk = json.loads(event[len(b"data: ") :])
        if chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
            return True
        return False


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, when the replica reported it."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None
