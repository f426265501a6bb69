"""Reading replicas from Redis: each one's heartbeat, and with it the blocks set it publishes.

A heartbeat that is missing (expired, or the replica deregistered) or malformed reads as None; a
malformed one is warned about once per replica, not on every poll.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from kvroute.protocol import Heartbeat, Keys, unpack_hashes

log = logging.getLogger("kvroute.gateway.mirror")

# A replica's blocks set as ONE string of 8-byte members: redis-py parses a multi-bulk reply in
# pure Python, one object per member, while a single bulk string is one bytes object handed
# straight to numpy. Members that are not 8 bytes are left out.
_PACKED_MEMBERS = """#!lua flags=no-writes
local members = redis.call('SMEMBERS', KEYS[1])
local packed = table.concat(members)
if #packed == 8 * #members then
    return packed
end
local valid = {}
for _, member in ipairs(members) do
    if #member == 8 then
        valid[#valid + 1] = member
    end
end
return table.concat(valid)
"""


@dataclass(frozen=True)
class ReplicaHeartbeat:
    """One replica as its last heartbeat described it."""

    replica_id: str
    url: str
    model: str
    fingerprint: str
    block_size: int
    epoch: str
    kv_total_pages: int
    kv_used_pages: int
    running: int
    waiting: int
    waiting_prefill_tokens: int
    ts: float  # unix time of the heartbeat
    # each gateway's share of running, waiting and waiting_prefill_tokens (by gateway id); None
    # from a replica that does not report shares
    gateways: Mapping[str, tuple[int, int, int]] | None = None
    tokenizer_url: str | None = None  # where its tokenizer is served, if not at ``url``

    @classmethod
    def from_heartbeat(cls, replica_id: str, heartbeat: Heartbeat) -> ReplicaHeartbeat:
        return cls(replica_id, **{f.name: getattr(heartbeat, f.name) for f in dataclasses.fields(heartbeat)})


Snapshot = tuple[ReplicaHeartbeat | None, list[int]]  # a heartbeat and the blocks set read after it


class SnapshotReader:
    """Reads heartbeats, and heartbeats with blocks sets, of the replicas it is given."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self._bad_heartbeats: set[str] = set()  # replica ids already warned about

    async def heartbeats(self, redis: Redis, ids: Sequence[str]) -> dict[str, ReplicaHeartbeat | None]:
        async with redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(self.keys.heartbeat(rid))
            replies = await pipe.execute()
        return {rid: self._parse(rid, fields) for rid, fields in zip(ids, replies, strict=True)}

    async def snapshots(self, redis: Redis, ids: Sequence[str]) -> dict[str, Snapshot]:
        """Each replica's heartbeat and blocks set (the caller reads the stream positions first)."""
        async with redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(self.keys.heartbeat(rid))
                pipe.eval(_PACKED_MEMBERS, 1, self.keys.blocks(rid))  # a few hundred bytes: no EVALSHA
            replies = await pipe.execute()
        return {
            rid: (self._parse(rid, replies[2 * i]), unpack_hashes(replies[2 * i + 1]))
            for i, rid in enumerate(ids)
        }

    def _parse(self, replica_id: str, fields: Mapping[bytes, bytes]) -> ReplicaHeartbeat | None:
        """None for a missing heartbeat (expired or deregistered) or a malformed one (warned once)."""
        if not fields:
            return None
        try:
            beat = ReplicaHeartbeat.from_heartbeat(replica_id, Heartbeat.decode(fields))
        except (KeyError, ValueError) as error:
            if replica_id not in self._bad_heartbeats:
                self._bad_heartbeats.add(replica_id)
                log.warning("ignoring replica %s: bad heartbeat (%r)", replica_id, error)
            return None
        self._bad_heartbeats.discard(replica_id)
        return beat
