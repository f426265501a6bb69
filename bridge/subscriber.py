"""Receives one vLLM server's KV event batches in sequence order, or says that order was lost.

vLLM numbers its batches 0, 1, 2, … from its start. The subscriber hands on each batch whose
number is the next one expected. A number lower than expected means the server restarted: a
``Restart`` comes first (its cache is gone). A number higher than expected is a gap: the missed
batches are asked for on the replay socket, when one is given, and handed on in order; if it has
no socket or cannot fill the gap (they fell out of its buffer, it timed out), a ``Restart``
comes first instead, since what was missed is unknown.

A *catch-up* (asked for when the bridge registers a server) replays every batch vLLM still
buffers, so a bridge started after vLLM learns what is already cached without waiting for its
next event; batches that were already queued on the live socket are then dropped as duplicates.
Without a replay socket, the next batch is simply taken as the first.

Endpoints follow vLLM's rule in reverse: the side with ``*`` (or ipc) binds, the other connects.
So vLLM on ``tcp://*:5557`` is reached with ``--events tcp://vllm-host:5557``; vLLM told to
connect to ``tcp://bridge-host:5557`` is met with ``--events tcp://*:5557``. The replay socket is
always vLLM's to bind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from bridge.vllm_events import END_OF_REPLAY, EventBatch, MalformedBatch, decode_frames

log = logging.getLogger("kvroute.bridge.events")

REPLAY_TIMEOUT_S = 2.0  # one replay answer, all its batches
POLL_MS = 100  # how soon a catch-up asked for starts while no batch arrives


@dataclass(frozen=True)
class Restart:
    """What vLLM holds is no longer known: forget it all, under a new epoch."""

    reason: str


def binds(endpoint: str) -> bool:
    return "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._context = zmq.asyncio.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        if binds(endpoint):
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._expected: int | None = None  # None: the next batch is taken as the first
        self._duplicates_below: int | None = None  # after a catch-up: queued batches it covered
        self._catch_up = asyncio.Event()
        self.gaps = self.replayed = self.restarts = self.malformed = 0

    def close(self) -> None:
        for socket in (self._sub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def request_catch_up(self) -> None:
        """Start over from what vLLM still buffers (see the module doc), before the next batch."""
        self._expected = None
        self._catch_up.set()

    async def stream(self) -> AsyncIterator[EventBatch | Restart]:
        """Batches in order, each ``Restart`` where the order broke; runs until cancelled."""
        while True:
            if self._catch_up.is_set():
                self._catch_up.clear()
                for batch in await self._caught_up():
                    yield batch
            if not await self._sub.poll(POLL_MS) or self._catch_up.is_set():
                continue  # (a catch-up asked for meanwhile goes first: it covers what is queued)
            frames = await self._sub.recv_multipart()
            try:
                batch = decode_frames(frames)
            except MalformedBatch as error:
                self.malformed += 1
                log.warning("dropped a message that is not a vLLM event batch: %s", error)
                continue
            async for item in self._in_order(batch):
                yield item

    async def _caught_up(self) -> list[EventBatch]:
        if self.replay_endpoint is None:
            return []
        buffered = await self._fetch_replay(0)
        if not buffered:
            return []  # nothing buffered, or no answer: the next batch is the first
        batches = _unbroken_tail(buffered)
        self._expected = self._duplicates_below = batches[-1].seq + 1
        self.replayed += len(batches)
        return batches

    async def _in_order(self, batch: EventBatch) -> AsyncIterator[EventBatch | Restart]:
        expected = self._expected
        if expected is not None and batch.seq < expected:
            if self._duplicates_below is not None and batch.seq < self._duplicates_below:
                return  # queued before a catch-up that already handed it on
            self.restarts += 1
            yield Restart(f"vLLM's sequence numbers restarted ({batch.seq} after {expected - 1})")
            expected = None
        self._duplicates_below = None
        if expected is not None and batch.seq > expected:
            self.gaps += 1
            missed = await self._replay_range(expected, batch.seq)
            if missed is None:
                self.restarts += 1
                yield Restart(f"batches {expected}..{batch.seq - 1} were lost and cannot be replayed")
            else:
                self.replayed += len(missed)
                for replayed in missed:
                    yield replayed
        self._expected = batch.seq + 1
        yield batch

    async def _replay_range(self, start: int, stop: int) -> list[EventBatch] | None:
        """Batches ``start``..``stop - 1``, or None if the replay socket cannot give them all."""
        buffered = await self._fetch_replay(start) if self.replay_endpoint is not None else None
        if buffered is None:
            return None
        missed = [buffered[seq] for seq in range(start, stop) if seq in buffered]
        if len(missed) != stop - start:
            log.warning(
                "vLLM could replay %d of batches %d..%d (its buffer holds the latest only)",
                len(missed),
                start,
                stop - 1,
            )
            return None
        return missed

    async def _fetch_replay(self, start: int) -> dict[int, EventBatch] | None:
        """Every batch from ``start`` that vLLM still buffers, by number; None if it does not answer."""
        assert self.replay_endpoint is not None
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.connect(self.replay_endpoint)
        got: dict[int, EventBatch] = {}
        try:
            await self._replay.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await self._replay.poll(REPLAY_TIMEOUT_S * 1000):
                    raise TimeoutError(f"no answer from {self.replay_endpoint} in {REPLAY_TIMEOUT_S} s")
                batch = decode_frames((await self._replay.recv_multipart())[1:])  # after the delimiter
                if batch.seq == END_OF_REPLAY:
                    return got
                if batch.seq >= start:
                    got[batch.seq] = batch
        except (TimeoutError, MalformedBatch, zmq.ZMQError) as error:
            log.warning("replay from batch %d failed: %s", start, error)
            self._replay.close(linger=0)  # a late answer must not be read as the next one's
            self._replay = None
            return None


def _unbroken_tail(buffered: dict[int, EventBatch]) -> list[EventBatch]:
    """The buffered batches in order, from the last break in their numbers on (vLLM's buffer is a
    window of its latest batches, unbroken; should it not be, only the latest run is trusted)."""
    numbers = sorted(buffered)
    first = len(numbers) - 1
    while first > 0 and numbers[first - 1] == numbers[first] - 1:
        first -= 1
    return [buffered[seq] for seq in numbers[first:]]
