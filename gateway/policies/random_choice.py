"""``random``: uniform over the replicas under the queue cap (cache and load ignored)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policies.base import Candidate, Decision, Policy, RouteRequest


class RandomPolicy(Policy):
    name = "random"
    needs_index = False

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        scores = self.load_scores(request, candidates)
        open_ = [s.replica_id for s in scores if not s.capped]
        return Decision(self.rng.choice(open_) if open_ else None, scores, self.name)
