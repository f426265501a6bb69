"""``round-robin``: the next replica by id after the last one chosen for the model, skipping capped ones.

The rotation remembers the last id chosen per model rather than a position, so it stays stable
when replicas come and go: a new replica takes its turn when the rotation reaches its id, and a
removed one is simply no longer there.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from gateway.policies.base import Candidate, Decision, Policy, RouteRequest


class RoundRobinPolicy(Policy):
    name = "round-robin"
    needs_index = False

    def __init__(self, **settings) -> None:
        super().__init__(**settings)
        self._last: dict[str, str] = {}  # model -> replica id chosen last

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        scores = self.load_scores(request, candidates)
        open_ids = sorted(s.replica_id for s in scores if not s.capped)
        if not open_ids:
            return Decision(None, scores, self.name)
        last = self._last.get(request.model)
        start = 0 if last is None else bisect.bisect_right(open_ids, last)
        chosen = open_ids[start % len(open_ids)]
        self._last[request.model] = chosen
        return Decision(chosen, scores, self.name)
