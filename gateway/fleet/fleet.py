"""Every replica this gateway knows, one :class:`Replica` record per id, and which of them are routable.

Fed by the index mirror's heartbeat polls (:meth:`Fleet.heard`: the replicas Redis lists and the
drain set), by static discovery (:meth:`Fleet.discovered`, from ``gateway.health``), by admins'
drains, and by the request path (outcomes that eject a replica, requests in flight). No I/O.

A model's routable replicas (:meth:`Fleet.routable`) are those Redis lists, or for a model none of
those serves, the static ones that answered. Ejected replicas are left out while any other is left
(when all are ejected, they are tried anyway rather than refusing the model); drained ones stay in
the roster, whose fingerprint they count towards, and out of its ``open`` list. A roster is kept
until anything it depends on changes; load figures are read from the records when routing.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from gateway.fleet.replica import InFlight, Replica, ReplicaStats, StaticReplica, Watched
from gateway.index.snapshots import ReplicaHeartbeat
from kvroute.protocol import replica_id_for

log = logging.getLogger("kvroute.gateway.health")

# A stream from a replica whose heartbeat ended is given up once no byte has come for this long
# (checked at every poll): a hung replica's heartbeat expires seconds after its last token, while
# one that stops gracefully (it leaves the index first, then finishes what it serves) or only lost
# Redis (its publisher, a bridge) keeps streaming.
STREAM_SILENCE_S = 2.0


@dataclass(frozen=True, slots=True)
class Roster:
    """A model's routable replicas."""

    model: str
    fingerprint: str  # the one most of them registered: the cache-comparable one
    replicas: list[Replica]  # sorted by id (Redis ones, else static ones); drained ones included
    open: list[Replica]  # the replicas that are not drained
    mismatched: tuple[str, ...]  # ids of the replicas with another fingerprint

    def tokenizer_urls(self) -> list[str]:
        """Where the roster's tokenizer can be fetched from."""
        return [replica.tokenizer_url for replica in self.replicas if replica.fingerprint == self.fingerprint]


def _roster(model: str, listed: list[Replica]) -> Roster:
    replicas = [replica for replica in listed if not replica.ejected] or listed
    fingerprints = {replica.fingerprint for replica in replicas}
    if len(fingerprints) == 1:
        fingerprint = fingerprints.pop()
    else:
        fingerprint = collections.Counter(r.fingerprint for r in replicas).most_common(1)[0][0]
    open_ = [replica for replica in replicas if not replica.drained]
    mismatched = tuple(r.replica_id for r in replicas if r.fingerprint != fingerprint)
    return Roster(model, fingerprint, replicas, open_, mismatched)


RECENT_MODEL_S = 60.0
"""How long a model whose replicas all vanished still counts as served (503 with retry-after)."""


class Fleet:
    """``eject_after``: failures in a row that eject a replica (``ejections`` counts them).
    ``static_urls``: the ``--replica`` URLs."""

    def __init__(
        self, *, eject_after: int, static_urls: Sequence[str] = (), ejections: Counter | None = None
    ) -> None:
        if eject_after < 1:
            raise ValueError("eject_after must be >= 1")
        self.eject_after = eject_after
        self._ejections = ejections
        self._records: dict[str, Replica] = {}
        self._redis: list[Replica] = []  # listed by Redis at the last poll, sorted by id
        self._left: list[Replica] = []  # no longer listed, with answers still streaming from them
        self.static_urls = [url.rstrip("/") for url in static_urls]
        self._static = {url: self._record(replica_id_for(url)) for url in self.static_urls}
        self._answering: list[Replica] = []  # static replicas that answered their discovery, by id
        self._shared_drains: frozenset[str] = frozenset()  # as of the last poll, and ours since
        self._drained_here: set[str] = set()  # drains that could not be shared through Redis
        self._rosters: dict[str, Roster] = {}
        self._flying: dict[int, Replica] = {}  # ticket -> where it flies
        self._next_ticket = 0
        self._last_listed: dict[str, float] = {}  # model -> monotonic time a poll last listed it

    def _record(self, replica_id: str) -> Replica:
        replica = self._records.get(replica_id)
        if replica is None:
            replica = self._records[replica_id] = Replica(replica_id)
        return replica

    def _changed(self) -> None:
        """Something a roster depends on changed: drains, membership, identity or ejection."""
        drained = self.drained
        for replica in self._records.values():
            replica.drained = replica.replica_id in drained
        self._rosters.clear()

    # -- what the replicas are ----------------------------------------------------------------------

    def heard(self, heartbeats: Sequence[ReplicaHeartbeat], drained: frozenset[str]) -> None:
        """A heartbeat poll: the replicas Redis lists now (sorted by id), and the drain set."""
        listed = []
        now = time.monotonic()
        for beat in heartbeats:
            self._last_listed[beat.model] = now
            replica = self._record(beat.replica_id)
            replica.heartbeat = beat
            replica.describe()
            listed.append(replica)
        ids = {beat.replica_id for beat in heartbeats}
        left = [replica for replica in self._redis if replica.replica_id not in ids]
        for replica in left:
            replica.heartbeat = None
            replica.describe()
        self._left = [r for r in (*self._left, *left) if r.replica_id not in ids and r.static is None]
        for replica in self._left:
            self._abandon(
                replica,
                f"replica {replica.replica_id} left the index (its heartbeat ended)",
                spare_streaming=True,
            )
        self._left = [replica for replica in self._left if replica.watched]
        self._redis = listed
        self._shared_drains = drained
        self._changed()

    def discovered(self, url: str, found: StaticReplica | None) -> StaticReplica | None:
        """What static ``url`` answered (None: it did not); returns what it had answered before."""
        replica = self._static[url]
        previous, replica.static = replica.static, found
        if found != previous:
            replica.describe()
            answering = {r.replica_id: r for r in self._static.values() if r.static is not None}
            self._answering = sorted(answering.values(), key=lambda r: r.replica_id)
            self._changed()
        return previous

    def static_answer(self, url: str) -> StaticReplica | None:
        return self._static[url].static

    def static_ids(self) -> dict[str, str]:
        """Replica id (``host:port``) -> URL of every static replica, answering or not."""
        return {replica.replica_id: url for url, replica in self._static.items()}

    def get(self, replica_id: str) -> Replica | None:
        return self._records.get(replica_id)

    def stats(self, replica_id: str) -> ReplicaStats:
        replica = self._records.get(replica_id)
        return ReplicaStats() if replica is None else replica.stats

    # -- which are routable -------------------------------------------------------------------------

    def listed(self, model: str | None = None) -> list[Replica]:
        """The replicas Redis lists (of ``model``); the static ones that answered for a model none
        of those serves."""
        indexed = self._redis if model is None else [r for r in self._redis if r.model == model]
        models = {replica.model for replica in indexed}
        return indexed + [
            replica
            for replica in self._answering
            if replica.heartbeat is None
            and replica.model not in models
            and (model is None or replica.model == model)
        ]

    def routable(self, model: str) -> Roster | None:
        """The model's roster; None when no replica serves it."""
        roster = self._rosters.get(model)
        if roster is None:
            listed = self.listed(model)
            if not listed:
                return None
            roster = self._rosters[model] = _roster(model, listed)
        return roster

    def listed_lately(self, model: str, within_s: float = RECENT_MODEL_S) -> bool:
        """Whether a poll listed a replica of ``model`` in the last ``within_s`` seconds: a model
        that had replicas a moment ago is unavailable, not unknown (503, not 404)."""
        listed_at = self._last_listed.get(model)
        return listed_at is not None and time.monotonic() - listed_at <= within_s

    @property
    def drained(self) -> frozenset[str]:
        """Replica ids out of rotation: drained through any gateway (shared in Redis), or through
        this one while Redis could not take it (or with no Redis at all)."""
        shared = self._shared_drains
        return shared | self._drained_here if self._drained_here else shared

    def drain(self, replica_id: str, drained: bool, *, shared: bool = False) -> None:
        """Drains ``replica_id`` (or puts it back) here, at once; ``shared``: Redis holds it now,
        so every gateway applies it and it is no longer this one's alone."""
        if shared:
            change = self._shared_drains.union if drained else self._shared_drains.difference
            self._shared_drains = change((replica_id,))
            self._drained_here.discard(replica_id)
        elif drained:
            self._drained_here.add(replica_id)
        else:
            self._drained_here.discard(replica_id)
        self._changed()

    # -- health: the request path's reports, and the probes' --------------------------------------

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0

    def failed(self, replica: Replica, why: str) -> None:
        """A connect error, a 503 or a stream that broke: ejects it after ``eject_after`` in a row."""
        replica.failures += 1
        if replica.failures >= self.eject_after and replica.ejected_url is None:
            replica.ejected_url = replica.url
            if self._ejections is not None:
                self._ejections.labels(replica.replica_id).inc()
            log.warning(
                "replica %s ejected after %d failures in a row (last: %s)",
                replica.replica_id,
                replica.failures,
                why,
            )
            self._changed()
            self._abandon(replica, f"replica {replica.replica_id} was ejected ({why})")

    def report_failures(self, tried: Sequence[Replica], failures: Sequence[tuple[str, str]]) -> None:
        """``failures``: (url, why) of the candidates that failed before one answered."""
        if failures:
            by_url = {replica.url: replica for replica in tried}
            for url, why in failures:
                if (replica := by_url.get(url)) is not None:
                    self.failed(replica, why)

    def ejected(self) -> dict[str, str]:
        """Replica id -> the URL to probe, of every ejected replica."""
        return {r.replica_id: r.ejected_url for r in self._records.values() if r.ejected_url is not None}

    def restored(self, replica_id: str) -> None:
        """Its health probe answered: routing to it again."""
        replica = self._records.get(replica_id)
        if replica is not None and replica.ejected_url is not None:
            replica.ejected_url = None
            replica.failures = 0
            log.warning("replica %s answers its health probe again; routing to it", replica_id)
            self._changed()

    # -- in flight ----------------------------------------------------------------------------------

    def watch(self, replica: Replica, answer: Watched) -> None:
        """Gives up ``answer`` (a request waiting on or streaming from ``replica``) if it is ejected,
        or if the index drops it and no bytes stream (``STREAM_SILENCE_S``): one not answered yet
        goes to the next replica, a stream ends in an error event, instead of waiting out a wedged
        replica (``unwatch`` when it is over)."""
        replica.watched.add(answer)

    def unwatch(self, replica: Replica, answer: Watched) -> None:
        replica.watched.discard(answer)

    def _abandon(self, replica: Replica, why: str, *, spare_streaming: bool = False) -> None:
        """Gives up the answers under way from ``replica`` (but those still streaming, if asked)."""
        given_up = [a for a in replica.watched if not (spare_streaming and a.flowing(STREAM_SILENCE_S))]
        replica.watched.difference_update(given_up)
        for answer in given_up:
            answer.abandon(why)

    def sent(
        self,
        replica: Replica,
        uncached_tokens: int,
        sequences: int = 1,
        last_block: int | None = None,
        prompt_key: tuple[int, int] | None = None,
    ) -> int:
        """Records a request in flight to ``replica``; returns the ticket to pass to ``done``.
        ``last_block``: its prompt's last full block hash, whose event ends its counted prefill;
        ``prompt_key``: its prompt's length and digest, which its conversation's next turn starts with."""
        self._next_ticket += 1
        ticket = self._next_ticket
        flight = InFlight(time.time(), uncached_tokens, sequences, last_block, prompt_key)
        replica.flights.add(ticket, flight)
        self._flying[ticket] = replica
        return ticket

    def done(self, ticket: int, completion_tokens: int = 0) -> None:
        """The request is over (ignored for a ticket already done); ``completion_tokens`` from its
        answer's usage, where one came."""
        replica = self._flying.pop(ticket, None)
        if replica is not None:
            replica.flights.remove(ticket, completion_tokens)
