"""From a tokenized prompt to an ordered list of replicas: index lookup, load, policy.

A replica's load is its last heartbeat corrected for this gateway's own traffic since
(:func:`candidate_for`): requests sent after it are added, requests that finished after it are
taken out.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from gateway.health import ReplicaHealth
from gateway.index_mirror import IndexMirror, ReplicaInfo
from gateway.policies import Candidate, Decision, Policy, RouteRequest
from kvroute.openai_api.errors import APIError
from kvroute.protocol import model_seed
from kvroute.text.prompt_ids import PromptIds

log = logging.getLogger("kvroute.gateway")


@dataclass
class _InFlight:
    replica_id: str
    sent_at: float  # unix time, comparable with heartbeat ``ts``
    uncached_tokens: int
    sequences: int  # engine sequences it makes: prompts x n


class _ReplicaFlights:
    """One replica's requests in flight from this gateway, with running totals (kept as requests
    come and go, so routing reads them in O(1)): all of them, and those sent after ``since``, the
    time of the heartbeat last asked about."""

    __slots__ = ("flights", "pending", "pending_tokens", "sequences", "since", "tokens")

    def __init__(self) -> None:
        self.flights: dict[int, _InFlight] = {}
        self.sequences = 0
        self.tokens = 0
        self.since = 0.0
        self.pending = 0
        self.pending_tokens = 0

    def count(self, flight: _InFlight, sign: int) -> None:
        """Adds (sign 1) or takes away (-1) one flight in the totals."""
        self.sequences += sign * flight.sequences
        self.tokens += sign * flight.uncached_tokens
        if flight.sent_at > self.since:
            self.pending += sign * flight.sequences
            self.pending_tokens += sign * flight.uncached_tokens

    def since_heartbeat(self, ts: float) -> tuple[int, int]:
        """Sequences sent after the heartbeat stamped ``ts``, and their uncached tokens."""
        if ts != self.since:
            self.since = ts
            later = [flight for flight in self.flights.values() if flight.sent_at > ts]
            self.pending = sum(flight.sequences for flight in later)
            self.pending_tokens = sum(flight.uncached_tokens for flight in later)
        return self.pending, self.pending_tokens


_NO_SHARE = (0, 0, 0)


def candidate_for(
    info: ReplicaInfo,
    gateway_id: str,
    flights: _ReplicaFlights | None,
    *,
    cached_blocks: int,
    predicted_blocks: int,
    cache_comparable: bool,
) -> Candidate:
    """The replica's load as of now, as far as this gateway's own traffic goes.

    Its heartbeat (up to a poll plus a heartbeat old) still counts this gateway's requests that
    have finished since: without taking them out, the replica that just answered a chat looks
    busy and the chat's next turn leaves it. The heartbeat names this gateway's share of it
    (``gateways``), so: the heartbeat, less that share, plus what of the share is still in flight
    here (requests that finished are gone from both), plus what was sent after it.
    """
    after, after_tokens = (0, 0) if flights is None else flights.since_heartbeat(info.ts)
    before = before_tokens = 0  # sent before the heartbeat and still in flight
    if flights is not None and info.gateways is not None:  # None: a replica that names no shares
        before, before_tokens = flights.sequences - after, flights.tokens - after_tokens
    share = (info.gateways or {}).get(gateway_id, _NO_SHARE)
    share_running, share_waiting, share_prefill = share
    # Which of the share's sequences are still live is unknown: count waiting ones first (the queue
    # cap looks at them), and any not in the share at all (in transit then) as waiting too.
    still_waiting = min(share_waiting, before)
    still_running = min(share_running, before - still_waiting)
    return Candidate(
        replica_id=info.replica_id,
        waiting_prefill_tokens=max(0, info.waiting_prefill_tokens - share_prefill)
        + min(share_prefill, before_tokens),
        running=max(0, info.running - share_running) + still_running,
        waiting=max(0, info.waiting - share_waiting) + before - still_running,
        inflight=after,
        inflight_prefill_tokens=after_tokens,
        cached_blocks=cached_blocks,
        predicted_blocks=predicted_blocks,
        cache_comparable=cache_comparable,
    )


@dataclass
class RoutePlan:
    """The decision and what the caller needs to act on it."""

    decision: Decision
    ordered: list[ReplicaInfo]  # the winner first, then fallbacks by cost
    hashes: list[int]
    predicted_tokens: dict[str, int] = field(default_factory=dict)  # per replica id


class Router:
    """``health`` (optional) supplies the ejected set and the static replicas. ``load_policy``
    routes while the index cannot be trusted (Redis down, or no Redis at all): it sees load from
    this gateway's own in-flight counters only, as heartbeat figures are stale then.
    ``use_index=False``: no Redis, replicas come from ``health``'s static list alone.
    ``gateway_id``: what this gateway sends replicas as ``x-kvroute-gateway``."""

    def __init__(
        self,
        mirror: IndexMirror,
        policy: Policy,
        *,
        health: ReplicaHealth | None = None,
        load_policy: Policy | None = None,
        use_index: bool = True,
        gateway_id: str = "",
    ) -> None:
        self.mirror = mirror
        self.gateway_id = gateway_id  # how replicas' heartbeats name this gateway's share
        self.policy = policy
        self.health = health
        self.load_policy = load_policy or policy
        self.use_index = use_index
        self._drained_here: set[str] = set()  # drains that could not be shared through Redis
        self._seeds: dict[tuple[str, str], int] = {}  # (model, fingerprint) -> block hash chain root
        self._flights: dict[str, _ReplicaFlights] = {}
        self._replica_of: dict[int, str] = {}  # ticket -> replica id
        self._next_ticket = 0

    @property
    def drained(self) -> frozenset[str]:
        """Replica ids out of rotation: drained through any gateway (shared in Redis), or through
        this one while Redis could not take it (or with no Redis at all)."""
        shared = self.mirror.drained if self.use_index else frozenset()
        return shared | self._drained_here if self._drained_here else shared

    async def set_drained(self, replica_id: str, drained: bool) -> bool:
        """Drains ``replica_id`` (or puts it back); True when every gateway sharing this Redis
        will see it, False when only this one does (no Redis, or Redis unreachable now)."""
        if drained:
            self._drained_here.add(replica_id)
        else:
            self._drained_here.discard(replica_id)
        if not self.use_index:
            return False
        try:
            await self.mirror.set_drained(replica_id, drained)
        except (RedisError, OSError) as error:
            log.warning("could not share the drain of %s through Redis (%s)", replica_id, error)
            return False
        self._drained_here.discard(replica_id)
        return True

    @property
    def degraded(self) -> bool:
        """True when routing is load-only: no Redis, or the mirror is stale."""
        return not self.use_index or self.mirror.stale

    def known_replicas(self, model: str | None = None) -> list[ReplicaInfo]:
        """The index's live replicas (of ``model``); static ones for a model the index lacks."""
        indexed = self.mirror.replicas(model) if self.use_index else []
        if self.health is None:
            return indexed
        models = {info.model for info in indexed}
        return indexed + [info for info in self.health.static_replicas(model) if info.model not in models]

    def replicas_by_fingerprint(self, model: str) -> tuple[str | None, list[ReplicaInfo]]:
        """The model's live replicas and the fingerprint most of them registered (cache-comparable).

        Ejected replicas are left out while any other is left (when all are ejected, they are
        tried anyway rather than refusing the model)."""
        replicas = self.known_replicas(model)
        if not replicas:
            return None, []
        if self.health is not None:
            replicas = [r for r in replicas if not self.health.is_ejected(r.replica_id)] or replicas
        fingerprints = {r.fingerprint for r in replicas}
        if len(fingerprints) == 1:
            return fingerprints.pop(), replicas
        return Counter(r.fingerprint for r in replicas).most_common(1)[0][0], replicas

    def route(
        self,
        model: str,
        fingerprint: str,
        replicas: Sequence[ReplicaInfo],
        prompt: PromptIds,
        session_id: str | None,
        *,
        policy: Policy | None = None,
    ) -> RoutePlan:
        """``policy`` overrides the router's own for this request (an admin's experiment)."""
        if drained := self.drained:
            replicas = [info for info in replicas if info.replica_id not in drained]
            if not replicas:
                raise APIError("Every replica of this model is drained.", 503, code="service_unavailable")
        block_size = replicas[0].block_size
        seed = self._seeds.get((model, fingerprint))
        if seed is None:
            seed = self._seeds[(model, fingerprint)] = model_seed(model, fingerprint)
        hashes = prompt.block_hashes(block_size, seed)
        if self.degraded:
            return self._route_by_own_load(model, replicas, len(prompt), block_size, hashes, session_id)
        matches = self.mirror.lookup_with_predictions(model, hashes)
        candidates = []
        for info in replicas:
            match = matches.get(info.replica_id)
            comparable = info.fingerprint == fingerprint and info.block_size == block_size
            candidates.append(
                candidate_for(
                    info,
                    self.gateway_id,
                    self._flights.get(info.replica_id),
                    cached_blocks=match.confirmed if match and comparable else 0,
                    predicted_blocks=match.with_predicted if match and comparable else 0,
                    cache_comparable=comparable,
                )
            )
        request = RouteRequest(model, len(prompt), block_size, session_id)
        return self._ordered(policy or self.policy, request, candidates, replicas, hashes)

    def _route_by_own_load(
        self,
        model: str,
        replicas: Sequence[ReplicaInfo],
        prompt_tokens: int,
        block_size: int,
        hashes: list[int],
        session_id: str | None,
    ) -> RoutePlan:
        """Load-only routing from this gateway's in-flight requests (no cache, no heartbeat load)."""
        candidates = []
        for info in replicas:
            flights = self._flights.get(info.replica_id)
            count, tokens = (0, 0) if flights is None else (flights.sequences, flights.tokens)
            candidates.append(
                Candidate(
                    replica_id=info.replica_id,
                    cached_blocks=0,
                    predicted_blocks=0,
                    waiting_prefill_tokens=0,
                    running=0,
                    waiting=0,
                    inflight=count,
                    inflight_prefill_tokens=tokens,
                    cache_comparable=False,
                )
            )
        request = RouteRequest(model, prompt_tokens, block_size, session_id)
        return self._ordered(self.load_policy, request, candidates, replicas, hashes)

    @staticmethod
    def _ordered(
        policy: Policy,
        request: RouteRequest,
        candidates: list[Candidate],
        replicas: Sequence[ReplicaInfo],
        hashes: list[int],
    ) -> RoutePlan:
        decision = policy.choose(request, candidates)
        by_id = {info.replica_id: info for info in replicas}
        ranked = sorted((s for s in decision.scores if not s.capped), key=lambda s: s.cost)
        order = [s.replica_id for s in ranked if s.replica_id != decision.replica_id]
        if decision.replica_id is not None:
            order.insert(0, decision.replica_id)
        predicted = {s.replica_id: s.matched_tokens for s in decision.scores}
        return RoutePlan(decision, [by_id[rid] for rid in order], hashes, predicted)

    def sent(self, replica_id: str, uncached_tokens: int, sequences: int = 1) -> int:
        """Records a request in flight to ``replica_id``; returns the ticket to pass to ``done``."""
        self._next_ticket += 1
        ticket = self._next_ticket
        flight = _InFlight(replica_id, time.time(), uncached_tokens, sequences)
        flights = self._flights.get(replica_id)
        if flights is None:
            flights = self._flights[replica_id] = _ReplicaFlights()
        flights.flights[ticket] = flight
        flights.count(flight, 1)
        self._replica_of[ticket] = replica_id
        return ticket

    def done(self, ticket: int) -> None:
        replica_id = self._replica_of.pop(ticket, None)
        if replica_id is None:
            return
        flights = self._flights[replica_id]
        flights.count(flights.flights.pop(ticket), -1)
        if not flights.flights:
            del self._flights[replica_id]

    def inflight(self, replica_id: str) -> int:
        flights = self._flights.get(replica_id)
        return 0 if flights is None else len(flights.flights)
