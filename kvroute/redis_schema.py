"""What lives in Redis, byte for byte: the contract between replica publishers and gateway mirrors.

Keys (``prefix`` defaults to ``kvroute``):

- ``{prefix}:replicas``: SET of registered replica ids. A replica removes itself on graceful
  shutdown; a crashed one's id stays until it comes back or a gateway prunes it (with its blocks
  set) after ten minutes without a heartbeat, and readers skip any id whose heartbeat has expired.
- ``{prefix}:replica:{id}``: HASH heartbeat with a TTL (``HEARTBEAT_FIELDS``).
- ``{prefix}:blocks:{id}``: SET of the block hashes the replica holds in its current epoch, each an
  8-byte little-endian unsigned integer.
- ``{prefix}:events:{model}``: STREAM of cache events for one served model (``EVENT_FIELDS``).
- ``{prefix}:drained``: SET of replica ids an admin took out of rotation through any gateway; every
  gateway stops routing to them. A replica removes its own id when it deregisters (a drain lasts
  until the replica stops, or until an admin puts it back).

A replica applies each event batch to its blocks set and appends it to the stream in one
MULTI/EXEC, so a reader that takes the stream's last id, then the sets, then replays the stream
from that id converges on the truth.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from kvroute.blocks import PROTOCOL_VERSION

DEFAULT_PREFIX = "kvroute"


class EventKind(StrEnum):
    STORED = "s"
    REMOVED = "r"
    CLEARED = "c"  # everything the replica held before is gone; a new epoch starts with it


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    @property
    def replicas(self) -> str:
        return f"{self.prefix}:replicas"

    def heartbeat(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    def blocks(self, replica_id: str) -> str:
        return f"{self.prefix}:blocks:{replica_id}"

    def events(self, model: str) -> str:
        return f"{self.prefix}:events:{model}"

    @property
    def drained(self) -> str:
        return f"{self.prefix}:drained"


# Heartbeat hash fields: protocol version, identity, then load. All values are strings in Redis.
HEARTBEAT_FIELDS = (
    "v",  # protocol version
    "url",  # base URL gateways should call (the replica's --advertise-url)
    "model",  # served model name
    "fingerprint",  # tokenizer fingerprint (kvroute.tokenizer)
    "block_size",  # tokens per block
    "epoch",  # hex; changes whenever the replica's cache restarts from empty
    "kv_total_pages",
    "kv_used_pages",
    "running",  # sequences running
    "waiting",  # sequences waiting for admission
    "waiting_prefill_tokens",  # prompt tokens not yet computed
    "gateways",  # JSON {gateway id: [running, waiting, waiting_prefill_tokens]}: each gateway's share
    "ts",  # unix time of this heartbeat, seconds (float)
)

GATEWAY_ID_HEADER = "x-kvroute-gateway"
"""Sent by a gateway on every request to a replica, naming itself for the heartbeat's ``gateways``."""

_GATEWAY_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def is_gateway_id(value: str) -> bool:
    """Gateway ids are short and plain, so a heartbeat can carry them without escaping."""
    return _GATEWAY_ID.fullmatch(value) is not None


def encode_gateway_loads(loads: Mapping[str, tuple[int, int, int]]) -> str:
    """``{gateway id: (running, waiting, waiting_prefill_tokens)}`` as the heartbeat's JSON field."""
    return json.dumps({gateway: list(load) for gateway, load in loads.items()}, separators=(",", ":"))


def decode_gateway_loads(raw: bytes | None) -> dict[str, tuple[int, int, int]] | None:
    """The heartbeat's ``gateways`` field; None when absent (a replica that reports no shares)."""
    if raw is None:
        return None
    loads = json.loads(raw)
    if not isinstance(loads, dict):
        raise ValueError(f"heartbeat field gateways is not an object: {raw!r}")
    return {gateway: (int(r), int(w), int(p)) for gateway, (r, w, p) in loads.items()}


# Stream entry fields.
EVENT_FIELDS = (
    "v",  # protocol version
    "r",  # replica id
    "e",  # epoch (hex)
    "k",  # EventKind value
    "h",  # packed block hashes (8-byte little-endian each); empty for CLEARED
    "t",  # unix time the batch was published, seconds (float)
)


def pack_hashes(hashes: Iterable[int]) -> bytes:
    return np.fromiter(hashes, dtype="<u8").tobytes()


def unpack_hashes(packed: bytes) -> list[int]:
    return np.frombuffer(packed, dtype="<u8").tolist()


def hash_member(block_hash: int) -> bytes:
    """One block hash as a member of a replica's blocks set."""
    return block_hash.to_bytes(8, "little")


def encode_event(
    replica_id: str, epoch: str, kind: EventKind, hashes: Iterable[int], ts: float
) -> dict[str, bytes | str]:
    return {
        "v": str(PROTOCOL_VERSION),
        "r": replica_id,
        "e": epoch,
        "k": kind.value,
        "h": pack_hashes(hashes),
        "t": repr(ts),
    }


@dataclass(frozen=True)
class Event:
    replica_id: str
    epoch: str
    kind: EventKind
    hashes: list[int]
    ts: float


def decode_event(fields: Mapping[bytes, bytes]) -> Event:
    version = int(fields[b"v"])
    if version != PROTOCOL_VERSION:
        raise ValueError(f"event protocol version {version}, this build speaks {PROTOCOL_VERSION}")
    return Event(
        replica_id=fields[b"r"].decode(),
        epoch=fields[b"e"].decode(),
        kind=EventKind(fields[b"k"].decode()),
        hashes=unpack_hashes(fields[b"h"]),
        ts=float(fields[b"t"]),
    )
