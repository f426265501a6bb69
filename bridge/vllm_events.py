"""vLLM's KV cache events, decoded from the bytes its ZMQ publisher sends.

vLLM (``--kv-events-config``, publisher ``zmq``) sends each batch as three frames: the topic, an
8-byte big-endian sequence number, and a msgpack payload ``KVEventBatch(ts, events,
data_parallel_rank)`` encoded by msgspec as an array. The events are tagged structs
``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``: older vLLM versions encode each as an
array whose first element is the tag, newer ones as a map whose ``type`` field is the tag and whose
default-valued fields are left out. Both shapes are read here, from plain msgpack, so the bridge
needs neither vLLM nor its classes. vLLM's block hashes are opaque (ints, or bytes from its
sha256 hashing): they are only ever used as keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

VllmHash = int | bytes
END_OF_REPLAY = -1  # the sequence number (8 bytes, signed) that ends an answer from the replay socket

# Field order of the array-encoded events (msgspec writes struct fields in declaration order).
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx",
)  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedBatch(ValueError):
    """Frames or a payload that are not a vLLM KV event batch."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    plain: bool = True  # no LoRA, multimodal or salt keys: the blocks are a pure token prefix
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: list[KVEvent]


def decode_frames(frames: Sequence[bytes]) -> EventBatch:
    """One published message ``(topic, seq, payload)`` as a batch; MalformedBatch if it is not one."""
    if len(frames) != 3:
        raise MalformedBatch(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    _, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise MalformedBatch(f"sequence number of {len(seq_bytes)} bytes, expected 8")
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    if seq == END_OF_REPLAY:
        return EventBatch(seq, 0.0, [])
    ts, events = decode_payload(payload)
    return EventBatch(seq, ts, events)


def decode_payload(payload: bytes) -> tuple[float, list[KVEvent]]:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as error:
        raise MalformedBatch(f"payload is not msgpack: {error}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedBatch("payload is not an array [ts, events, ...]")
    try:
        return float(raw[0]), [_event(item) for item in raw[1]]
    except (TypeError, ValueError, KeyError) as error:
        raise MalformedBatch(f"bad event: {type(error).__name__}: {error}") from None


def _event(item: Any) -> KVEvent:
    tag, fields = _tag_and_fields(item)
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields["block_hashes"]), fields.get("medium"), fields.get("group_idx"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {tag!r}")


def _tag_and_fields(item: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(item, dict):
        return str(item["type"]), item
    if isinstance(item, list) and item:
        tag = str(item[0])
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        return tag, dict(zip(names, item[1:], strict=False))
    raise ValueError(f"an event must be a map or an array, not {type(item).__name__}")


def _stored(fields: dict[str, Any]) -> BlockStored:
    token_ids = [int(token) for token in fields["token_ids"]]
    block_size = int(fields["block_size"])
    hashes = _hashes(fields["block_hashes"])
    if block_size < 1 or len(token_ids) != len(hashes) * block_size:
        raise ValueError(f"{len(hashes)} blocks of {block_size} tokens but {len(token_ids)} token ids")
    extra = fields.get("extra_keys")
    plain = (
        fields.get("lora_id") is None
        and fields.get("lora_name") is None
        and not (extra and any(key for key in extra))
    )
    parent = fields.get("parent_block_hash")
    return BlockStored(
        hashes,
        None if parent is None else _hash(parent),
        token_ids,
        block_size,
        fields.get("medium"),
        plain,
        fields.get("group_idx"),
    )


def _hashes(values: Any) -> list[VllmHash]:
    if not isinstance(values, list):
        raise ValueError("block_hashes must be an array")
    return [_hash(value) for value in values]


def _hash(value: Any) -> VllmHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise ValueError(f"a block hash must be an int or bytes, not {type(value).__name__}")
    return value
