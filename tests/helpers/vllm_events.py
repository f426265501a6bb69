"""vLLM's KV event messages, built as vLLM builds them: msgspec structs of the shapes in vLLM's
``vllm/distributed/kv_events.py`` (0.32: array-like batches of map-encoded tagged events; before
that, array-like events too), sent by a PUB socket as ``(topic, seq, payload)`` with vLLM's replay
ROUTER beside it. The bridge's tests send these; its slow tests use vLLM itself."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class OldBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    """An older vLLM's event: array-like, tag first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


def stored(
    hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int], block_size: int
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, block_size, None, "GPU", None)


def payload(*events: Any, ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts, list(events)))


class FakeVllmPublisher:
    """vLLM's ZmqEventPublisher's wire behaviour: a PUB socket (bound) numbering its batches from 0,
    and a ROUTER replay socket answering a start number with every buffered batch from there,
    then the -1 end marker. ``send(..., skip=True)`` numbers a batch but never sends it (a gap)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self._next = 0
        self._replay = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replays_served = 0
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._next

    def send(self, *events: Any, skip: bool = False) -> int:
        seq, self._next = self._next, self._next + 1
        body = payload(*events)
        self._buffer.append((seq, body))
        if not skip:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), body))
        return seq

    def restart_numbering(self) -> None:
        """As a restarted vLLM: numbers from 0 again, nothing buffered."""
        self._next = 0
        self._buffer.clear()

    def forget_buffer(self, keep_latest: int = 0) -> None:
        """As batches falling out of vLLM's replay buffer: all but the latest ``keep_latest``."""
        while len(self._buffer) > keep_latest:
            self._buffer.popleft()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while not self._stop.is_set():
            if not self._replay.poll(50):
                continue
            client, _, start = self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays_served += 1  # before the answer: a subscriber may act on it at once
            for seq, body in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), body))
            self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
