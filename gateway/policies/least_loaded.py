"""``least-loaded``: the replica with the lowest load (cache ignored), ties at random."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policies.base import Candidate, Decision, Policy, RouteRequest, pick_lowest


class LeastLoadedPolicy(Policy):
    name = "least-loaded"
    needs_index = False

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        scores = self.load_scores(request, candidates)
        open_ = [((s.load,), s.replica_id) for s in scores if not s.capped]
        return Decision(pick_lowest(self.rng, open_) if open_ else None, scores, self.name)
