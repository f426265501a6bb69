"""``kv``: the replica where the request is cheapest, counting its cached prefix against its queue.

``cost(r) = uncached_prefill_tokens(r) + lam · load(r)``, with
``uncached = prompt_tokens − matched_tokens`` (blocks predicted or confirmed on ``r``, no credit
when its tokenizer fingerprint differs). Lowest cost wins; ties go to the lower load, then to the
replica that answered the conversation's last turn moments ago (its events of that answer may not
have reached the gateway yet), then to a uniformly random one. A hot prefix spreads on its own:
each request routed to its holder raises that holder's load, until recomputing the prefix on an
idle replica costs less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.policies.base import (
    Candidate,
    Decision,
    Policy,
    RouteRequest,
    Score,
    candidate_load,
    is_capped,
    matched_tokens,
    pick_lowest,
)


class KVPolicy(Policy):
    name = "kv"

    def kv_scores(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Score]:
        scores = []
        lam, decode_weight, max_queue = self.lam, self.decode_weight, self.max_queue
        for c in candidates:
            matched = matched_tokens(request, c)
            load = candidate_load(c, decode_weight)
            capped = is_capped(c, max_queue)
            cost = math.inf if capped else request.prompt_tokens - matched + lam * load
            scores.append(Score(c.replica_id, matched, load, cost, capped, c.continues))
        return scores

    def decide(self, scores: list[Score], policy: str) -> Decision:
        open_ = [
            ((s.cost, s.load, 0.0 if s.continues else 1.0), s.replica_id) for s in scores if not s.capped
        ]
        return Decision(pick_lowest(self.rng, open_) if open_ else None, scores, policy)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        return self.decide(self.kv_scores(request, candidates), self.name)
