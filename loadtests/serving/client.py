"""One streamed OpenAI request, timed chunk by chunk (aiohttp: the client must outpace the server).

Times are ``time.perf_counter()`` values. A chunk that carries text counts as output; TTFT is the
first of them, as in ``vllm bench serve``. Usage comes from the final ``include_usage`` chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

REPLICA_HEADER = "x-kvroute-replica"
PREDICTED_HEADER = "x-kvroute-predicted-cached-tokens"


@dataclass
class RequestRecord:
    """What one request did; ``error`` is set when it failed (then timings may be partial)."""

    conversation: int
    turn: int
    start: float
    end: float = 0.0
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every text-bearing chunk
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None  # x-kvroute-replica, when a kvroute gateway answered
    predicted_cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Endpoint:
    url: str  # e.g. http://127.0.0.1:8000/v1/chat/completions
    model: str
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        """Chat endpoints take messages; the completions endpoint a plain prompt."""
        return self.url.rstrip("/").endswith("/chat/completions")

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def completion_prompt(messages: list[dict[str, Any]]) -> str:
    """How a conversation becomes a plain prompt on the completions endpoint."""
    return "\n".join(str(message["content"]) for message in messages)


def request_body(endpoint: Endpoint, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **endpoint.extra_body,
    }
    if endpoint.chat:
        body["messages"] = messages
    else:
        body["prompt"] = completion_prompt(messages)
    return body


async def send(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    messages: list[dict[str, Any]],
    max_tokens: int,
    record: RequestRecord,
) -> RequestRecord:
    """Sends one streamed request and fills ``record``; never raises for a failed request."""
    body = request_body(endpoint, messages, max_tokens)
    text_key = "delta" if endpoint.chat else None
    parts: list[str] = []
    finished = False
    try:
        async with session.post(endpoint.url, json=body, headers=endpoint.headers()) as response:
            record.replica = response.headers.get(REPLICA_HEADER)
            if (predicted := response.headers.get(PREDICTED_HEADER)) is not None:
                record.predicted_cached_tokens = int(predicted)
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return record
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                _on_chunk(json.loads(data), record, parts, text_key, time.perf_counter())
        if record.error is None and not finished:
            record.error = "the stream ended before [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        record.error = f"{type(error).__name__}: {error}"
    finally:
        record.end = time.perf_counter()
        record.text = "".join(parts)
    return record


def _on_chunk(
    chunk: dict[str, Any], record: RequestRecord, parts: list[str], text_key: str | None, now: float
) -> None:
    if "error" in chunk:
        record.error = f"error event: {chunk['error'].get('message', chunk['error'])}"
        return
    for choice in chunk.get("choices") or ():
        text = (choice.get("delta") or {}).get("content") if text_key else choice.get("text")
        if text:
            if record.first_token is None:
                record.first_token = now
            record.chunk_times.append(now)
            parts.append(text)
    if usage := chunk.get("usage"):
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")
