"""Incremental detokenization with stop strings that are never emitted, even in part."""

from __future__ import annotations

from typing import Protocol


class DecodeStream(Protocol):
    def step(self, token_id: int) -> str: ...


class StopTextTracker:
    """Accumulates decoded text and holds back any tail that might still grow into a stop string."""

    def __init__(self, stream: DecodeStream, stop: list[str]) -> None:
        self._stream = stream
        self._stop = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self._emitted = 0

    def add_token(self, token_id: int) -> bool:
        """Appends the token's text; True when a stop string appeared (the text is cut before it)."""
        before = len(self.text)
        self.text += self._stream.step(token_id)
        if not self._stop:
            return False
        search_from = max(0, before - self._longest_stop + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def take_delta(self, final: bool) -> str:
        """New text safe to show; on ``final`` everything that is left."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self._emitted)
        delta, self._emitted = self.text[self._emitted : end], end
        return delta

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        for length in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
