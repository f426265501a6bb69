"""The drain set every gateway sharing a Redis applies (``{p}:drained``, see docs/PROTOCOL.md).

An admin's drain through any gateway is written here; every gateway reads the set back with its
heartbeat poll (:meth:`SharedDrains.read` queues the read in the poll's pipeline), so a drain takes
a replica out of every gateway's rotation within a poll. A replica removes its own id when it
stops, and a pruned registration's id goes with it (``gateway.index.pruning``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from kvroute.protocol import Keys

log = logging.getLogger("kvroute.gateway")


class SharedDrains:
    """Reads and writes ``{p}:drained`` through ``client`` (the mirror's connection).

    A poll's read can miss this gateway's own drain made while the poll was in flight (the write
    lands after the read); applying that read would put the replica back in rotation for a poll.
    So the writes that complete after a read was queued are kept and laid over what it returned.
    """

    def __init__(self, keys: Keys, client: Callable[[], Redis]) -> None:
        self._key = keys.drained
        self._client = client
        self._written_since_read: list[tuple[str, bool]] = []

    def read(self, pipe: Pipeline) -> None:
        """Queues the read of the whole set; its reply goes to :meth:`members` (one read at a time:
        every write completed before this one is queued shows in its reply)."""
        self._written_since_read.clear()
        pipe.smembers(self._key)

    def members(self, reply: Iterable[bytes]) -> frozenset[str]:
        """The set as of now: ``reply`` with this gateway's writes since the read laid over it."""
        members = {member.decode() for member in reply}
        for replica_id, drained in self._written_since_read:
            if drained:
                members.add(replica_id)
            else:
                members.discard(replica_id)
        return frozenset(members)

    async def share(self, replica_id: str, drained: bool) -> bool:
        """Drains ``replica_id`` (or puts it back) for every gateway sharing this Redis; False when
        Redis could not be written (then the caller's drain stays its own)."""
        try:
            redis = self._client()
            if drained:
                await redis.sadd(self._key, replica_id)
            else:
                await redis.srem(self._key, replica_id)
        except (RedisError, OSError) as error:
            log.warning("could not share the drain of %s through Redis (%s)", replica_id, error)
            return False
        self._written_since_read.append((replica_id, drained))
        return True
