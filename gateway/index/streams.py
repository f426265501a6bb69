"""Where a mirror stands in each model's event stream, and whether it lost entries there.

Streams are trimmed (approximate MAXLEN), so a slow mirror can lose entries. Redis does not record
trimmed ids in ``max-deleted-entry-id`` (only XDEL does), so after every read that returns entries
the mirror checks, with ``XINFO STREAM``, that the entry it had read last is still in the stream;
trimming removes oldest entries first, so if it is, nothing after it was lost. If not, the model is
bootstrapped again. (A false alarm needs a mirror already a whole MAXLEN behind, where a fresh
bootstrap is the right move anyway.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from redis.asyncio import Redis

from kvroute.protocol import Keys

NO_ENTRY = b"0-0"


@dataclass
class StreamPosition:
    """Where the mirror stands in one model's event stream."""

    key: str
    last_id: bytes  # the last entry read (or the newest at bootstrap); 0-0 if there was none
    removed_at_bootstrap: int  # entries-added − length when bootstrapped (for last_id == 0-0)


async def stream_positions(redis: Redis, keys: Keys, models: Iterable[str]) -> dict[str, StreamPosition]:
    """The newest entry of each model's stream (0-0 if none), with the counters that let the
    tail tell a trim from a quiet stream. XINFO STREAM gives both in one atomic reply."""
    ordered = sorted(models)
    stream_keys = [keys.events(model) for model in ordered]
    async with redis.pipeline(transaction=False) as pipe:
        for key in stream_keys:
            pipe.xinfo_stream(key)
        replies = await pipe.execute(raise_on_error=False)
    positions = {}
    for model, key, info in zip(ordered, stream_keys, replies, strict=True):
        if isinstance(info, Exception):  # no such stream yet
            positions[model] = StreamPosition(key, NO_ENTRY, 0)
            continue
        last = info["last-entry"][0] if info["length"] else NO_ENTRY
        positions[model] = StreamPosition(key, last, info["entries-added"] - info["length"])
    return positions


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    return int(ms), int(seq or 0)


def missed_entries(stream: StreamPosition, info: Mapping[str, object] | Exception) -> bool:
    """Whether entries after ``stream.last_id`` were trimmed before this mirror read them.

    If the last entry read is still in the stream, every later one is too (trimming removes the
    oldest first). With no entry read yet, any entry removed since the bootstrap counts.
    """
    if isinstance(info, Exception):
        return True  # the stream vanished between XREAD and XINFO
    if stream.last_id == NO_ENTRY:
        return info["entries-added"] - info["length"] > stream.removed_at_bootstrap  # type: ignore[operator]
    first = info["first-entry"]
    return first is None or _entry_id(first[0]) > _entry_id(stream.last_id)  # type: ignore[index]
