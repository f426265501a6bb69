"""From a tokenized prompt to an ordered list of replicas: index lookup, load, policy.

The gateway's own in-flight requests count as load only until the replica's next heartbeat,
which already includes them (as running or waiting sequences).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.health import ReplicaHealth
from gateway.index_mirror import IndexMirror, ReplicaInfo
from gateway.policies import Candidate, Decision, Policy, RouteRequest
from kvroute.blocks import block_hashes, model_seed
from kvroute.errors import APIError


@dataclass
class _InFlight:
    replica_id: str
    sent_at: float  # unix time, comparable with heartbeat ``ts``
    uncached_tokens: int


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
    ``use_index=False``: no Redis, replicas come from ``health``'s static list alone."""

    def __init__(
        self,
        mirror: IndexMirror,
        policy: Policy,
        *,
        health: ReplicaHealth | None = None,
        load_policy: Policy | None = None,
        use_index: bool = True,
    ) -> None:
        self.mirror = mirror
        self.policy = policy
        self.health = health
        self.load_policy = load_policy or policy
        self.use_index = use_index
        self.drained: set[str] = set()  # replica ids the admin API took out of rotation
        self._inflight: dict[int, _InFlight] = {}
        self._next_ticket = 0

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
        fingerprint = Counter(r.fingerprint for r in replicas).most_common(1)[0][0]
        return fingerprint, replicas

    def route(
        self,
        model: str,
        fingerprint: str,
        replicas: Sequence[ReplicaInfo],
        prompt_ids: Sequence[int],
        session_id: str | None,
        *,
        policy: Policy | None = None,
    ) -> RoutePlan:
        """``policy`` overrides the router's own for this request (an admin's experiment)."""
        replicas = [info for info in replicas if info.replica_id not in self.drained]
        if not replicas:
            raise APIError("Every replica of this model is drained.", 503, code="service_unavailable")
        block_size = replicas[0].block_size
        hashes = block_hashes(prompt_ids, block_size, model_seed(model, fingerprint))
        if self.degraded:
            return self._route_by_own_load(model, replicas, prompt_ids, block_size, hashes, session_id)
        matches = self.mirror.lookup_with_predictions(model, hashes)
        pending = self._pending_since_heartbeat(replicas)
        candidates = []
        for info in replicas:
            match = matches.get(info.replica_id)
            comparable = info.fingerprint == fingerprint and info.block_size == block_size
            count, tokens = pending.get(info.replica_id, (0, 0))
            candidates.append(
                Candidate(
                    replica_id=info.replica_id,
                    cached_blocks=match.confirmed if match and comparable else 0,
                    predicted_blocks=match.with_predicted if match and comparable else 0,
                    waiting_prefill_tokens=info.waiting_prefill_tokens,
                    running=info.running,
                    waiting=info.waiting,
                    inflight=count,
                    inflight_prefill_tokens=tokens,
                    cache_comparable=comparable,
                )
            )
        request = RouteRequest(model, len(prompt_ids), block_size, session_id)
        return self._ordered(policy or self.policy, request, candidates, replicas, hashes)

    def _route_by_own_load(
        self,
        model: str,
        replicas: Sequence[ReplicaInfo],
        prompt_ids: Sequence[int],
        block_size: int,
        hashes: list[int],
        session_id: str | None,
    ) -> RoutePlan:
        """Load-only routing from this gateway's in-flight requests (no cache, no heartbeat load)."""
        own: dict[str, tuple[int, int]] = {}
        for flight in self._inflight.values():
            count, tokens = own.get(flight.replica_id, (0, 0))
            own[flight.replica_id] = (count + 1, tokens + flight.uncached_tokens)
        candidates = []
        for info in replicas:
            count, tokens = own.get(info.replica_id, (0, 0))
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
        request = RouteRequest(model, len(prompt_ids), block_size, session_id)
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

    def sent(self, replica_id: str, uncached_tokens: int) -> int:
        """Records a request in flight to ``replica_id``; returns the ticket to pass to ``done``."""
        self._next_ticket += 1
        self._inflight[self._next_ticket] = _InFlight(replica_id, time.time(), uncached_tokens)
        return self._next_ticket

    def done(self, ticket: int) -> None:
        self._inflight.pop(ticket, None)

    def inflight(self, replica_id: str) -> int:
        return sum(1 for f in self._inflight.values() if f.replica_id == replica_id)

    def _pending_since_heartbeat(self, replicas: Sequence[ReplicaInfo]) -> dict[str, tuple[int, int]]:
        """Per replica: requests (and their uncached tokens) sent after its last heartbeat."""
        heartbeat = {info.replica_id: info.ts for info in replicas}
        pending: dict[str, tuple[int, int]] = {}
        for flight in self._inflight.values():
            ts = heartbeat.get(flight.replica_id)
            if ts is not None and flight.sent_at > ts:
                count, tokens = pending.get(flight.replica_id, (0, 0))
                pending[flight.replica_id] = (count + 1, tokens + flight.uncached_tokens)
        return pending
