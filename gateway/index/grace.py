"""When replicas missing from a heartbeat poll stay in rotation a while longer.

A replica that is really gone drops out at once: its heartbeat expires alone, or it deregisters.
But a missing heartbeat is also what a Redis fault looks like from here: a Redis that restarted
empty lists nobody until each replica registers again (within a heartbeat), and a Redis stall
longer than the heartbeat TTL (or replicas cut off from Redis) expires every heartbeat at once.
Dropping them then would leave a model with no replica, and clients with errors, for nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvroute.gateway.mirror")

STALL_POLLS = 2.0
"""Polls' worth of time without a successful one after which expired heartbeats are doubted."""

STALL_MIN_S = 1.0
"""...and never less than this: a stall shorter than a heartbeat's TTL less its interval (1.5 s by
default) expires nothing, while a busy host can delay a fast poll by a few hundred milliseconds,
and a replica that really crashed must still drop at once."""


class MissingGrace:
    """``seconds``: how long the replicas are kept; ``poll_interval``: the mirror's."""

    def __init__(self, seconds: float, poll_interval: float) -> None:
        self.seconds = seconds
        self.poll_interval = poll_interval
        self._restart_until = 0.0  # Redis restarted empty: every missing replica is kept until then
        self._expiry_until = 0.0  # heartbeats expired by a fault: registered ones are kept until then
        self._last_poll: float | None = None
        self._graced: set[str] = set()  # the expired replicas the current or last grace kept
        self._stall_after = max(STALL_POLLS * poll_interval, STALL_MIN_S)

    def restarted(self, now: float) -> None:
        """Redis's run id changed."""
        self._restart_until = now + self.seconds

    def polled(self, now: float, expired: set[str], known: int) -> None:
        """A poll found ``expired`` (registered, no heartbeat) of ``known`` replicas: a grace starts
        if the poll before was too long ago (this gateway could not reach Redis either) or if most
        expired together. Replicas a grace has kept do not start another when it ends: their
        heartbeats did not come back, so they leave."""
        self._graced &= expired  # those that refreshed may be graced again after a later fault
        fresh = expired - self._graced
        if fresh and now >= self._expiry_until:
            stalled = self._last_poll is not None and now - self._last_poll > self._stall_after
            together = len(fresh) >= 2 and 2 * len(fresh) >= known
            if stalled or together:
                self._expiry_until = now + self.seconds
                self._graced = set(fresh)
                log.warning(
                    "%d replica heartbeats expired %s; keeping those replicas for %g s while they refresh",
                    len(fresh),
                    "while Redis could not be polled" if stalled else "at once",
                    self.seconds,
                )
        elif now < self._expiry_until:
            self._graced |= fresh  # expired during the grace: kept by it, and leaving with it
        self._last_poll = now

    def keeps(self, replica_id: str, expired: frozenset[str], now: float) -> bool:
        """Whether a replica missing from the poll at ``now`` stays (one that deregistered does
        not, unless Redis restarted empty)."""
        return now < self._restart_until or (replica_id in expired and now < self._expiry_until)
