"""From a tokenized prompt to an ordered list of replicas: index lookup, load, policy.

The gateway's own in-flight requests count as load only until the replica's next heartbeat,
which already includes them (as running or waiting sequences).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.index_mirror import IndexMirror, ReplicaInfo
from gateway.policies import Candidate, Decision, Policy, RouteRequest
from kvroute.blocks import block_hashes, model_seed


@dataclass
class _InFlight:
    replica_id: str
    sent_at: float  # unix time, comparable with heartbeat ``ts``
    uncached_tokens: int


@dataclass
class Route:
    """The decision and what the caller needs to act on it."""

    decision: Decision
    ordered: list[ReplicaInfo]  # the winner first, then fallbacks by cost
    hashes: list[int]
    predicted_tokens: dict[str, int] = field(default_factory=dict)  # per replica id


class Router:
    def __init__(self, mirror: IndexMirror, policy: Policy) -> None:
        self.mirror = mirror
        self.policy = policy
        self._inflight: dict[int, _InFlight] = {}
        self._next_ticket = 0

    def replicas_by_fingerprint(self, model: str) -> tuple[str | None, list[ReplicaInfo]]:
        """The model's live replicas and the fingerprint most of them registered (cache-comparable)."""
        replicas = self.mirror.replicas(model)
        if not replicas:
            return None, []
        fingerprint = Counter(r.fingerprint for r in replicas).most_common(1)[0][0]
        return fingerprint, replicas

    def route(
        self,
        model: str,
        fingerprint: str,
        replicas: Sequence[ReplicaInfo],
        prompt_ids: Sequence[int],
        session_id: str | None,
    ) -> Route:
        block_size = replicas[0].block_size
        hashes = block_hashes(prompt_ids, block_size, model_seed(model, fingerprint))
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
        decision = self.policy.choose(request, candidates)
        by_id = {info.replica_id: info for info in replicas}
        ranked = sorted((s for s in decision.scores if not s.capped), key=lambda s: s.cost)
        order = [s.replica_id for s in ranked if s.replica_id != decision.replica_id]
        if decision.replica_id is not None:
            order.insert(0, decision.replica_id)
        predicted = {s.replica_id: s.matched_tokens for s in decision.scores}
        return Route(decision, [by_id[rid] for rid in order], hashes, predicted)

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
