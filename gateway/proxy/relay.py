"""Forwarding one request to a replica: retried elsewhere until a byte has reached the client,
and relayed as the replica sent it, but for the usage the gateway asked for on its own behalf.

The gateway always asks the replica for usage (``stream_options.include_usage``) because usage
carries ``cached_tokens``, the real outcome of its routing decision. When the client did not ask,
that final usage-only SSE event is taken out; every other event passes through byte for byte.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.connection import UpstreamError, UpstreamResponse
from gateway.proxy.upstream import UpstreamPool
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest
from kvroute.protocol import PROMPT_IDS_FIELD

RETRYABLE_STATUSES = frozenset({503})  # the replica is draining or its engine is down
JSON_CONTENT = b"application/json"
_USAGE_EVENT_MARK = b'"choices":[]'  # the replica's compact JSON for the usage-only chunk
_DONE_EVENT = b"data: [DONE]"


class UpstreamUnavailable(Exception):
    """Every candidate failed before answering; nothing reached the client, so it gets a 503."""

    def __init__(self, failures: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{url}: {why}" for url, why in failures) or "no replica to try")
        self.failures = failures


@dataclass
class Upstream:
    """A replica's answer whose status and headers have arrived; the body is still to be read."""

    url: str
    response: UpstreamResponse
    failures: list[tuple[str, str]] = field(default_factory=list)  # earlier candidates that failed


async def open_upstream(
    pool: UpstreamPool,
    urls: Sequence[str],
    path: str,
    body: bytes,
    *,
    whole: bool = False,
    first_data_within: float | None = None,
    on_response: Callable[[str, UpstreamResponse], None] | None = None,
) -> Upstream:
    """POSTs the JSON ``body`` to each URL in turn until one answers with a status that is not
    retryable (``whole``: returns once the whole answer is in; ``first_data_within``: once its
    first body bytes are, see :meth:`UpstreamPool.post`). ``on_response(url, response)`` sees
    each attempt as it starts.

    Only failures before anything reached the client are retried (the gateway starts its own
    reply once this returns): after that, a second replica would duplicate the bytes.
    """
    failures: list[tuple[str, str]] = []
    for url in urls:
        seen = None if on_response is None else functools.partial(on_response, url)
        try:
            response = await pool.post(
                url,
                path,
                body,
                JSON_CONTENT,
                whole=whole,
                first_data_within=first_data_within,
                on_response=seen,
            )
        except UpstreamError as error:
            failures.append((url, str(error)))
            continue
        if response.status in RETRYABLE_STATUSES:
            response.close()
            failures.append((url, f"HTTP {response.status}"))
            continue
        return Upstream(url, response, failures)
    raise UpstreamUnavailable(failures)


def forwarded_body(
    raw: bytes, body: ChatCompletionRequest | CompletionRequest, prompt_ids: Sequence[int] | None = None
) -> tuple[bytes, bool]:
    """The request body to forward (a stream always asks for usage), and whether the client asked.
    ``prompt_ids``: the prompt's token ids, for a replica that takes them (``PROMPT_IDS_FIELD``).

    The client's bytes go through untouched unless members have to be added (usage asked for on
    the client's behalf, the prompt's ids) or taken out (ids a client sent itself: the replica
    serves only the ones this gateway routed on). Members the body does not name (not even as
    ``null``) are appended to the JSON object as it stands; else the object is re-encoded.
    """
    client_asked = not body.stream or body.include_usage  # non-streaming replies always carry usage
    clients_ids = body.kvroute_prompt_ids is not None
    added: dict[str, Any] = {}
    if not client_asked:
        added["stream_options"] = {"include_usage": True}
    if prompt_ids is not None:
        added[PROMPT_IDS_FIELD] = list(prompt_ids)
    if not added and not clients_ids:
        return raw, client_asked
    if not clients_ids and all(b'"%s"' % name.encode() not in raw for name in added):
        # a non-empty object (it holds "model"): its closing brace makes room for the members
        return raw.rstrip()[:-1] + b"," + json.dumps(added, separators=(",", ":")).encode()[1:], client_asked
    payload = json.loads(raw)
    payload.pop(PROMPT_IDS_FIELD, None)
    if not client_asked:
        added["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
    payload.update(added)
    return json.dumps(payload).encode(), client_asked


class SSERelay:
    """Iterates the replica's SSE body, whole events at a time (all those one read brought),
    recording usage, first-event time and whether ``[DONE]`` came.

    Closing the relay closes the upstream response, and the replica aborts the request when its
    connection drops.
    """

    def __init__(self, response: UpstreamResponse, forward_usage: bool) -> None:
        self.response = response
        self.forward_usage = forward_usage
        self.usage: dict[str, Any] | None = None
        self.first_event_at: float | None = None
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer = b""
        try:
            while data := await self.response.read_chunk():
                buffer += data
                if b"\n\n" not in buffer:
                    continue
                *events, buffer = buffer.split(b"\n\n")
                if self.first_event_at is None:
                    self.first_event_at = time.monotonic()
                out = [event + b"\n\n" for event in events if self._passes(event)]
                if out:
                    yield b"".join(out)
            if buffer:
                yield buffer
        finally:
            self.response.close()

    def _passes(self, event: bytes) -> bool:
        """False for the usage-only event the client did not ask for (its usage is kept)."""
        if event.startswith(_DONE_EVENT):
            self.finished = True
        elif _USAGE_EVENT_MARK in event and self._take_usage(event):
            return self.forward_usage
        return True

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
