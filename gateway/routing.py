"""From a tokenized prompt and a model's roster to a plan: index lookup, load, policy.

A replica's load is its last heartbeat corrected for this gateway's own traffic since
(:func:`candidate_for`): requests sent after it are added, requests that finished after it are
taken out. Routing answers with a :class:`RoutePlan` (or None when every replica is drained); the
request path turns what it cannot serve into the API's errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

from gateway.fleet.fleet import Fleet, Roster
from gateway.fleet.replica import Replica
from gateway.index.mirror import IndexMirror
from gateway.policies import POLICIES, Candidate, Decision, Policy, RouteRequest, make_policy
from gateway.settings import GatewaySettings
from kvroute.protocol import model_seed
from kvroute.text.prompt_ids import PromptIds

log = logging.getLogger("kvroute.gateway")

_NO_SHARE = (0, 0, 0)


def candidate_for(
    replica: Replica,
    gateway_id: str,
    *,
    cached_blocks: int,
    predicted_blocks: int,
    cache_comparable: bool,
    returning: int = 0,
    continues: bool = False,
) -> Candidate:
    """The replica's load as of now, as far as this gateway's own traffic goes.

    Its heartbeat (up to a poll plus a heartbeat old) still counts this gateway's requests that
    have finished since: without taking them out, the replica that just answered a chat looks
    busy and the chat's next turn leaves it. The heartbeat names this gateway's share of it
    (``gateways``), so: the heartbeat, less that share, plus what of the share is still in flight
    here (requests that finished are gone from both), plus what was sent after it. A replica
    without a heartbeat (a static one) has no load but this gateway's requests in flight.
    """
    info, flights = replica.heartbeat, replica.flights
    if info is None:
        return _own_load(replica, returning, continues, cached_blocks, predicted_blocks, cache_comparable)
    after, after_tokens = flights.since_heartbeat(info.ts)
    before = before_tokens = 0  # sent before the heartbeat and still in flight
    if info.gateways is not None:  # None: a replica that names no shares
        before, before_tokens = flights.sequences - after, flights.tokens - after_tokens
    share = (info.gateways or {}).get(gateway_id, _NO_SHARE)
    share_running, share_waiting, share_prefill = share
    # Which of the share's sequences are still live is unknown: count waiting ones first (the queue
    # cap looks at them), and any not in the share at all (in transit then) as waiting too.
    still_waiting = min(share_waiting, before)
    still_running = min(share_running, before - still_waiting)
    return Candidate(
        replica_id=replica.replica_id,
        waiting_prefill_tokens=max(0, info.waiting_prefill_tokens - share_prefill)
        + min(share_prefill, before_tokens),
        running=max(0, info.running - share_running) + still_running,
        waiting=max(0, info.waiting - share_waiting) + before - still_running,
        inflight=after,
        inflight_prefill_tokens=after_tokens,
        cached_blocks=cached_blocks,
        predicted_blocks=predicted_blocks,
        cache_comparable=cache_comparable,
        returning=returning,
        continues=continues,
    )


def _own_load(
    replica: Replica,
    returning: int = 0,
    continues: bool = False,
    cached_blocks: int = 0,
    predicted_blocks: int = 0,
    cache_comparable: bool = False,
) -> Candidate:
    """The replica as seen through this gateway's requests in flight there alone."""
    flights = replica.flights
    return Candidate(
        replica_id=replica.replica_id,
        cached_blocks=cached_blocks,
        predicted_blocks=predicted_blocks,
        waiting_prefill_tokens=0,
        running=0,
        waiting=0,
        inflight=flights.sequences,
        inflight_prefill_tokens=flights.tokens,
        cache_comparable=cache_comparable,
        returning=returning,
        continues=continues,
    )


@dataclass
class RoutePlan:
    """The decision and what the caller needs to act on it."""

    decision: Decision
    ordered: list[Replica]  # the winner first, then fallbacks by cost (none over the queue cap)
    prompt: PromptIds
    hashes: list[int]
    predicted_tokens: dict[str, int]  # per replica id
    roster: Roster  # what it was planned over (the policy scored its open replicas)

    @property
    def winner(self) -> str | None:
        """None: every replica is over its queue cap."""
        return self.decision.replica_id


class Router:
    """``load_policy`` routes while the index cannot be trusted (Redis down, or no Redis at all):
    it sees load from this gateway's own in-flight counters only, as heartbeat figures are stale
    then. ``use_index=False``: no Redis, the fleet's replicas are static ones alone.
    ``gateway_id``: what this gateway sends replicas as ``x-kvroute-gateway``, and so how their
    heartbeats name its share. ``prediction_ttl_s``: how long a routed request's blocks count as
    cached on its replica before the replica's events confirm them. ``expect_return_s``: how long
    a replica's answer counts as one sequence of load to other requests (its conversation's next
    turn may be on its way; sent at once, it would find the place taken)."""

    def __init__(
        self,
        fleet: Fleet,
        mirror: IndexMirror,
        policy: Policy,
        *,
        load_policy: Policy | None = None,
        use_index: bool = True,
        gateway_id: str = "",
        prediction_ttl_s: float = 2.0,
        expect_return_s: float = 2.0,
    ) -> None:
        self.fleet = fleet
        self.mirror = mirror
        self.policy = policy
        self.load_policy = load_policy or policy
        self.use_index = use_index
        self.gateway_id = gateway_id
        self.prediction_ttl_s = prediction_ttl_s
        self.expect_return_s = expect_return_s
        self._seeds: dict[tuple[str, str], int] = {}  # (model, fingerprint) -> block hash chain root
        self._overrides: dict[str, Policy] = {}  # built once each (round-robin keeps state)

    @classmethod
    def from_settings(
        cls, settings: GatewaySettings, fleet: Fleet, mirror: IndexMirror, gateway_id: str
    ) -> Router:
        """The configured policy, and a load-only one for when the index cannot be used."""
        policy_settings: dict[str, Any] = {"lam": settings.lam}
        if settings.max_queue is not None:
            policy_settings["max_queue"] = settings.max_queue
        policy = make_policy(settings.policy, **policy_settings)
        load_policy = policy
        if policy.needs_index:
            load_policy = make_policy("least-loaded", **policy_settings)
            if settings.redis_url is None:
                log.warning("policy %s needs the Redis index; routing least-loaded instead", policy.name)
        return cls(
            fleet,
            mirror,
            policy,
            load_policy=load_policy,
            use_index=settings.redis_url is not None,
            gateway_id=gateway_id,
            prediction_ttl_s=settings.prediction_ttl_s,
            expect_return_s=settings.expect_return_s,
        )

    @property
    def degraded(self) -> bool:
        """True when routing is load-only: no Redis, or the mirror is stale."""
        return not self.use_index or self.mirror.stale

    @property
    def index_status(self) -> str:
        """``none`` (no Redis), ``stale`` (Redis unreachable: the last state is served) or ``ok``."""
        return "none" if not self.use_index else "stale" if self.mirror.stale else "ok"

    def override(self, name: str) -> Policy | None:
        """The policy called ``name`` for one request (an admin's experiment), with this router's
        settings; None when it is the router's own. KeyError for a name no policy has."""
        if name not in POLICIES:
            raise KeyError(name)
        if name == self.policy.name:
            return None
        if name not in self._overrides:
            current = self.policy
            settings: dict[str, Any] = {"lam": current.lam, "decode_weight": current.decode_weight}
            settings["max_queue"] = current.max_queue
            self._overrides[name] = make_policy(name, **settings)
        return self._overrides[name]

    def plan(
        self, roster: Roster, prompt: PromptIds, session_id: str | None, policy: Policy | None = None
    ) -> RoutePlan | None:
        """The plan for ``prompt`` over the roster's open replicas; None when every one is drained.
        ``policy`` overrides the router's own for this request, unless routing is load-only."""
        replicas = roster.open
        if not replicas:
            return None
        model, fingerprint = roster.model, roster.fingerprint
        block_size = replicas[0].block_size
        seed = self._seeds.get((model, fingerprint))
        if seed is None:
            seed = self._seeds[(model, fingerprint)] = model_seed(model, fingerprint)
        hashes = prompt.block_hashes(block_size, seed)
        request = RouteRequest(model, len(prompt), block_size, session_id)
        within = self.expect_return_s
        if self.degraded:  # no cache, no heartbeat load
            candidates = []
            for replica in replicas:
                returning, held = replica.flights.awaited(prompt, within)
                candidates.append(_own_load(replica, returning, held > 0))
            return self._ordered(self.load_policy, request, candidates, roster, prompt, hashes)
        matches = self.mirror.lookup_with_predictions(model, hashes)
        candidates = []
        for replica in replicas:
            replica.flights.settle_prefills(partial(self.mirror.holds, replica.replica_id))
            match = matches.get(replica.replica_id)
            comparable = replica.fingerprint == fingerprint and replica.block_size == block_size
            returning, held = replica.flights.awaited(prompt, within)
            predicted = match.with_predicted if match and comparable else 0
            if comparable:  # what it answered of this conversation, its events of it on their way
                predicted = max(predicted, held // block_size)
            candidates.append(
                candidate_for(
                    replica,
                    self.gateway_id,
                    cached_blocks=match.confirmed if match and comparable else 0,
                    predicted_blocks=predicted,
                    cache_comparable=comparable,
                    returning=returning,
                    continues=held > 0,
                )
            )
        return self._ordered(policy or self.policy, request, candidates, roster, prompt, hashes)

    @staticmethod
    def _ordered(
        policy: Policy,
        request: RouteRequest,
        candidates: list[Candidate],
        roster: Roster,
        prompt: PromptIds,
        hashes: list[int],
    ) -> RoutePlan:
        decision = policy.choose(request, candidates)
        by_id = {replica.replica_id: replica for replica in roster.open}
        ranked = sorted((s for s in decision.scores if not s.capped), key=lambda s: s.cost)
        order = [s.replica_id for s in ranked if s.replica_id != decision.replica_id]
        if decision.replica_id is not None:
            order.insert(0, decision.replica_id)
        predicted = {s.replica_id: s.matched_tokens for s in decision.scores}
        return RoutePlan(decision, [by_id[rid] for rid in order], prompt, hashes, predicted, roster)

    def commit(self, plan: RoutePlan, replica: Replica, prompt_tokens: int, sequences: int) -> int:
        """Marks the prompt's blocks as predicted on ``replica`` and counts it in flight there;
        returns the fleet's ticket for it."""
        self.mirror.predict(replica.replica_id, plan.hashes, self.prediction_ttl_s)
        prompt = plan.prompt
        for listed in plan.roster.open:  # wherever it goes, what it continues is no longer awaited
            listed.flights.returned(prompt)
        predicted = plan.predicted_tokens.get(replica.replica_id, 0)
        last_block = plan.hashes[-1] if plan.hashes else None
        prompt_key = (len(prompt), prompt.digest(len(prompt)))
        return self.fleet.sent(replica, prompt_tokens - predicted, sequences, last_block, prompt_key)
