"""Receives one vLLM server's KV event batches in sequence order, or says that order was lost.

vLLM numbers its batches 0, 1, 2, … from its start. The subscriber hands on each batch whose
number is the next one expected. A number lower than expected means the server restarted: a
``Restart`` comes first (its cache is gone). A number higher than expected is a gap: the missed
batches are asked for on the replay socket, when one is given, and handed on in order; if it has
no socket or cannot fill the gap (they fell out of its buffer, it timed out), a ``Restart``
comes first instead, since what was missed is unknown. The first batch after the bridge starts is
taken as it comes; with a replay socket, the batches before it that vLLM still buffers are
replayed first, so a bridge started late learns what is already cached.

Endpoints follow vLLM's rule in reverse: the side with ``*`` (or ipc) binds, the other connects.
So vLLM on ``tcp://*:5557`` is reached with ``--events tcp://vllm-host:5557``; vLLM told to
connect to ``tcp://bridge-host:5557`` is met with ``--events tcp://*:5557``. The replay socket is
always vLLM's to bind.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from bridge.vllm_events import END_OF_REPLAY, EventBatch, MalformedBatch, decode_frames

log = logging.getLogger("kvroute.bridge.events")

REPLAY_TIMEOUT_S = 2.0  # one replay answer, all its batches


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
        self._expected: int | None = None
        self.gaps = self.replayed = self.restarts = self.malformed = 0

    def close(self) -> None:
        for socket in (self._sub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    async def stream(self) -> AsyncIterator[EventBatch | Restart]:
        """Batches in order, each ``Restart`` where the order broke; runs until cancelled."""
        while True:
            frames = await self._sub.recv_multipart()
            try:
                batch = decode_frames(frames)
            except MalformedBatch as error:
                self.malformed += 1
                log.warning("dropped a message that is not a vLLM event batch: %s", error)
                continue
            async for item in self._in_order(batch):
                yield item

    def forget_position(self) -> None:
        """After a restart found elsewhere (the server's start time changed): the next batch is
        taken as the first, whatever its number."""
        self._expected = None

    async def _in_order(self, batch: EventBatch) -> AsyncIterator[EventBatch | Restart]:
        expected = self._expected
        if expected is not None and batch.seq < expected:
            self.restarts += 1
            yield Restart(f"vLLM's sequence numbers restarted ({batch.seq} after {expected - 1})")
            expected = None
        first = expected is None
        if expected is None:
            expected = 0 if self.replay_endpoint is not None and batch.seq > 0 else batch.seq
        if batch.seq > expected:
            self.gaps += not first
            missed = await self._replay_range(expected, batch.seq, whole=not first)
            if missed is None:
                self.restarts += 1
                yield Restart(f"batches {expected}..{batch.seq - 1} were lost and cannot be replayed")
            else:
                self.replayed += len(missed)
                for replayed in missed:
                    yield replayed
        self._expected = batch.seq + 1
        yield batch

    async def _replay_range(self, start: int, stop: int, *, whole: bool = True) -> list[EventBatch] | None:
        """Batches ``start``..``stop - 1`` from the replay socket, or None if it cannot give them all;
        unless ``whole`` is False (what came before a first batch): then the latest ones it still
        buffers will do, as long as they run unbroken up to ``stop``."""
        if self.replay_endpoint is None:
            return None
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.connect(self.replay_endpoint)
        got: dict[int, EventBatch] = {}
        try:
            await self._replay.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await self._replay.poll(REPLAY_TIMEOUT_S * 1000):
                    raise TimeoutError(f"no answer from {self.replay_endpoint} in {REPLAY_TIMEOUT_S} s")
                frames = await self._replay.recv_multipart()
                batch = decode_frames(frames[1:])  # drop the DEALER's empty delimiter
                if batch.seq == END_OF_REPLAY:
                    break
                if start <= batch.seq < stop:
                    got[batch.seq] = batch
        except (TimeoutError, MalformedBatch, zmq.ZMQError) as error:
            log.warning("replay of batches %d..%d failed: %s", start, stop - 1, error)
            self._replay.close(linger=0)  # a late answer must not be read as the next one's
            self._replay = None
            return None
        if not whole and got:
            start = min(got)
        if len(got) != stop - start:
            log.warning(
                "vLLM could replay %d of batches %d..%d (its buffer holds the latest only)",
                len(got),
                start,
                stop - 1,
            )
            return None
        return [got[seq] for seq in range(start, stop)]
