"""The radix cache's record of what it stored and removed, waiting to be published to Redis."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.protocol import EventKind


@dataclass
class KVEvent:
    kind: EventKind
    block_hashes: list[int]  # in insertion order (parents before children); empty for CLEARED
    timestamp: float


class KVEventOutbox:
    """Thread-safe FIFO between the engine thread (producer) and a publisher (consumer).

    Consecutive events of the same kind are merged so a burst of inserts costs one entry.
    ``notify`` (set by the publisher) is called, on the producer's thread, whenever an append
    finds the outbox empty: a consumer can sleep until there is something to publish.
    """

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()
        self.notify: Callable[[], None] | None = None

    def append(self, kind: EventKind, block_hashes: list[int], timestamp: float) -> None:
        with self._lock:
            was_empty = not self._events
            last = self._events[-1] if self._events else None
            if last is not None and last.kind is kind and kind is not EventKind.CLEARED:
                last.block_hashes.extend(block_hashes)
                last.timestamp = timestamp
            else:
                self._events.append(KVEvent(kind, list(block_hashes), timestamp))
        if was_empty and self.notify is not None:
            self.notify()

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
