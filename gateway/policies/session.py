"""``session``: rendezvous (highest-random-weight) hashing of ``x-session-id`` onto a replica.

Each replica's weight for a session is ``xxh3_64(session_id ‖ 0 ‖ replica_id)``; the highest wins.
A session therefore sticks to one replica, and when replicas come and go only the sessions whose
winner changed move: a new replica takes about 1/N of them, a removed one hands over only its own.
Requests without a session id, or whose replica is at the queue cap, are routed by ``kv`` (the
decision then names ``kv`` as its policy). Scores are always ``kv``'s, for explainability.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from gateway.policies.base import Candidate, Decision, RouteRequest
from gateway.policies.kv import KVPolicy


def session_weight(session_id: str, replica_id: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{session_id}\0{replica_id}".encode())


class SessionPolicy(KVPolicy):
    name = "session"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        scores = self.kv_scores(request, candidates)
        if request.session_id is not None and scores:
            sid = request.session_id
            # Ids are unique, so the (weight, id) order is total: no randomness needed.
            chosen = max(scores, key=lambda s: (session_weight(sid, s.replica_id), s.replica_id))
            if not chosen.capped:
                return Decision(chosen.replica_id, scores, self.name)
        return self.decide(scores, KVPolicy.name)
