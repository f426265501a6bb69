"""The contract between replicas and gateways, byte for byte: block hashes, Redis keys, the
heartbeat, the event stream, and the ids and headers that tie them together (docs/PROTOCOL.md).

**Blocks.** Token ids are cut into blocks of ``block_size`` tokens; only full blocks count. Block
i hashes the previous block's hash (8 bytes, little-endian) followed by its tokens (little-endian
uint32): ``h_i = xxh3_64(h_{i-1} || tokens_i)``. ``h_{-1}`` is a seed derived from the model
identity, so two models never share a hash. Equal hash therefore means equal whole prefix.

**Redis** (``prefix`` defaults to ``kvroute``):

- ``{prefix}:replicas``: SET of registered replica ids. A replica removes itself on graceful
  shutdown; a crashed one's id stays until it comes back or a gateway prunes it (with its blocks
  set) after ten minutes without a heartbeat, and readers skip any id whose heartbeat has expired.
- ``{prefix}:replica:{id}``: HASH heartbeat with a TTL (:class:`Heartbeat`).
- ``{prefix}:blocks:{id}``: SET of the block hashes the replica holds in its current epoch, each an
  8-byte little-endian unsigned integer.
- ``{prefix}:events:{model}``: STREAM of cache events for one served model (``EVENT_FIELDS``).
- ``{prefix}:drained``: SET of replica ids an admin took out of rotation through any gateway; every
  gateway stops routing to them. A replica removes its own id when it deregisters (a drain lasts
  until the replica stops, or until an admin puts it back).

A replica applies each event batch to its blocks set and appends it to the stream in one
MULTI/EXEC, so a reader that takes the stream's last id, then the sets, then replays the stream
from that id converges on the truth.

Needs only numpy, xxhash and the standard library: both sides import it, and the gateway never
imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

import numpy as np
import xxhash

PROTOCOL_VERSION = 1
DEFAULT_BLOCK_SIZE = 16

_xxh3 = xxhash.xxh3_64_intdigest


def model_seed(served_model_name: str, tokenizer_fingerprint: str) -> int:
    """h_{-1}: the chain's root, unique per (served model name, tokenizer fingerprint)."""
    identity = f"kvroute/v{PROTOCOL_VERSION}\x00{served_model_name}\x00{tokenizer_fingerprint}"
    return _xxh3(identity.encode())


def chain_hash(parent_hash: int, block_tokens: Sequence[int]) -> int:
    """Hash of one block given its parent's hash (used by the radix cache, one page at a time)."""
    payload = parent_hash.to_bytes(8, "little") + np.asarray(block_tokens, dtype="<u4").tobytes()
    return _xxh3(payload)


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, seed: int) -> list[int]:
    """Hashes of every full block of ``token_ids``, chained from ``seed``.

    Packing is vectorised: the tokens become one bytes object, and the loop runs once per block.
    """
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    packed = np.asarray(token_ids[: num_blocks * block_size], dtype="<u4").tobytes()
    stride = block_size * 4
    hashes: list[int] = []
    prev = seed
    for start in range(0, num_blocks * stride, stride):
        prev = _xxh3(prev.to_bytes(8, "little") + packed[start : start + stride])
        hashes.append(prev)
    return hashes


# -- Redis ----------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class Heartbeat:
    """A replica's heartbeat hash (``{prefix}:replica:{id}``): identity, then load. Every value is
    a string in Redis; :meth:`encode` and :meth:`decode` are the only code that writes or reads one."""

    url: str  # base URL gateways should call (the replica's --advertise-url)
    model: str  # served model name
    fingerprint: str  # tokenizer fingerprint (kvroute.text.tokenizer)
    block_size: int  # tokens per block
    epoch: str  # hex; changes whenever the replica's cache restarts from empty
    kv_total_pages: int
    kv_used_pages: int
    running: int  # sequences running
    waiting: int  # sequences waiting for admission
    waiting_prefill_tokens: int  # prompt tokens not yet computed
    ts: float  # unix time of this heartbeat, seconds
    # each gateway's share of running, waiting and waiting_prefill_tokens, by gateway id (see
    # GATEWAY_ID_HEADER); None from a replica that reports no shares
    gateways: Mapping[str, tuple[int, int, int]] | None = None
    # where GET /kvroute/tokenizer is served when ``url`` does not serve it (a vLLM server's
    # bridge); None: at ``url``
    tokenizer_url: str | None = None

    def encode(self) -> dict[str, str]:
        fields = {
            "v": str(PROTOCOL_VERSION),
            "url": self.url,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "block_size": str(self.block_size),
            "epoch": self.epoch,
            "kv_total_pages": str(self.kv_total_pages),
            "kv_used_pages": str(self.kv_used_pages),
            "running": str(self.running),
            "waiting": str(self.waiting),
            "waiting_prefill_tokens": str(self.waiting_prefill_tokens),
            "ts": repr(self.ts),
        }
        if self.gateways is not None:
            loads = {gateway: list(load) for gateway, load in self.gateways.items()}
            fields["gateways"] = json.dumps(loads, separators=(",", ":"))
        if self.tokenizer_url is not None:
            fields["tokenizer_url"] = self.tokenizer_url
        return fields

    @classmethod
    def decode(cls, fields: Mapping[bytes, bytes]) -> Heartbeat:
        """Parses a heartbeat hash; ValueError/KeyError if it is malformed or of another version."""
        version = int(fields[b"v"])
        if version != PROTOCOL_VERSION:
            raise ValueError(f"heartbeat protocol version {version}, this build speaks {PROTOCOL_VERSION}")

        def text(name: str) -> str:
            return fields[name.encode()].decode()

        return cls(
            url=text("url"),
            model=text("model"),
            fingerprint=text("fingerprint"),
            block_size=int(text("block_size")),
            epoch=text("epoch"),
            kv_total_pages=int(text("kv_total_pages")),
            kv_used_pages=int(text("kv_used_pages")),
            running=int(text("running")),
            waiting=int(text("waiting")),
            waiting_prefill_tokens=int(text("waiting_prefill_tokens")),
            ts=float(text("ts")),
            gateways=_decode_gateway_loads(fields.get(b"gateways")),
            tokenizer_url=tokenizer_url.decode() if (tokenizer_url := fields.get(b"tokenizer_url")) else None,
        )


HEARTBEAT_FIELDS = (*(f.name for f in dataclasses.fields(Heartbeat)), "v")
"""Every field of a heartbeat hash (``v``: the protocol version)."""


GATEWAY_ID_HEADER = "x-kvroute-gateway"
"""Sent by a gateway on every request to a replica, naming itself for the heartbeat's ``gateways``."""

PROMPT_IDS_FIELD = "kvroute_prompt_ids"
"""A request body member a gateway adds for a kvroute replica of its tokenizer's fingerprint: the
prompt's token ids as the gateway computed them to route it (a chat's rendered template, a
completions request's single text prompt). The replica serves those ids instead of tokenizing the
prompt a second time (docs/PROTOCOL.md says when they are sent)."""

_GATEWAY_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def is_gateway_id(value: str) -> bool:
    """Gateway ids are short and plain, so a heartbeat can carry them without escaping."""
    return _GATEWAY_ID.fullmatch(value) is not None


def _decode_gateway_loads(raw: bytes | None) -> dict[str, tuple[int, int, int]] | None:
    if raw is None:
        return None
    loads = json.loads(raw)
    if not isinstance(loads, dict):
        raise ValueError(f"heartbeat field gateways is not an object: {raw!r}")
    return {gateway: (int(r), int(w), int(p)) for gateway, (r, w, p) in loads.items()}


def default_advertise_url(host: str, port: int) -> str:
    """``http://host:port``; a wildcard bind address is no address to call, so it becomes the hostname."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def replica_id_for(url: str) -> str:
    """A replica's default id: ``host:port`` of the URL it is called at (characters outside
    ``[A-Za-z0-9._:-]`` become ``_``). Stable across restarts, so a restarted replica shows up as a
    new epoch of the same replica, and a gateway's static ``--replica URL`` is the same replica as
    its Redis registration."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return re.sub(r"[^A-Za-z0-9._:-]", "_", f"{parts.hostname}:{port}")


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
