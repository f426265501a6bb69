"""Deleting what crashed replicas left in Redis: their registration, drain entry and blocks set.

A crashed replica leaves its id and blocks set behind, and ids that change (a Kubernetes pod's
address) would otherwise pile up and be read on every poll. One that was only cut off from Redis
registers again with its next heartbeat, so a registration goes only after ``prune_after``
seconds without a heartbeat, as this mirror saw it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.asyncio import Redis

from kvroute.protocol import Keys

log = logging.getLogger("kvroute.gateway.mirror")


class SilentPruner:
    """Remembers since when each registered id has had no heartbeat, and prunes the long silent."""

    def __init__(self, keys: Keys, prune_after: float) -> None:
        self.keys = keys
        self.prune_after = prune_after
        self._silent_since: dict[str, float] = {}  # registered ids without a heartbeat -> first seen

    async def prune(self, redis: Redis, silent: Sequence[str], now: float) -> None:
        """``silent``: the registered ids without a heartbeat at this poll (loop time ``now``)."""
        self._silent_since = {rid: self._silent_since.get(rid, now) for rid in silent}
        expired = [rid for rid, since in self._silent_since.items() if now - since >= self.prune_after]
        if not expired:
            return
        async with redis.pipeline(transaction=False) as pipe:
            pipe.srem(self.keys.replicas, *expired)
            pipe.srem(self.keys.drained, *expired)
            pipe.delete(*(self.keys.blocks(rid) for rid in expired))
            await pipe.execute()
        for rid in expired:
            del self._silent_since[rid]
        log.info("pruned registrations silent for %gs: %s", self.prune_after, ", ".join(expired))
