"""A person's chat through the official ``openai`` client: each turn sent the moment the previous
answer has arrived, recording which replica answered and how many prompt tokens it had cached."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from openai import OpenAI

FOLLOW_UPS = ("Tell me more.", "Why is that?", "Give me an example.", "Say it in one sentence.")


@dataclass(frozen=True)
class Turn:
    replica: str  # the gateway's x-kvroute-replica header
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens, as the replica served it


def converse(client: OpenAI, model: str, opening: str, *, turns: int = 5, stream: bool) -> list[Turn]:
    """``turns`` turns with no pause between them; streamed or whole answers."""
    messages = [{"role": "user", "content": opening}]
    record = []
    for turn in range(turns):
        answer, replica, cached = _ask(client, model, messages, stream)
        record.append(Turn(replica, cached))
        messages += [{"role": "assistant", "content": answer}]
        messages += [{"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    return record


def _ask(client: OpenAI, model: str, messages: list[dict[str, str]], stream: bool) -> tuple[str, str, int]:
    settings = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**settings)
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens or 0
        return reply.choices[0].message.content or "", raw.headers["x-kvroute-replica"], cached
    raw = client.chat.completions.with_raw_response.create(
        **settings, stream=True, stream_options={"include_usage": True}
    )
    text, cached = [], None
    for chunk in raw.parse():
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        elif chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    assert cached is not None, "the stream ended without its usage"
    return "".join(text), raw.headers["x-kvroute-replica"], cached


def lost_turns(record: list[Turn]) -> list[str]:
    """Every turn after the first that left the previous turn's replica or found nothing cached."""
    lost = []
    for number, (before, turn) in enumerate(itertools.pairwise(record), start=2):
        if turn.replica != before.replica or turn.cached_tokens == 0:
            lost.append(f"turn {number}: {before.replica} -> {turn.replica}, {turn.cached_tokens} cached")
    return lost
