"""The router's own load accounting: requests it sent count on their replica until a heartbeat
taken after them does (the heartbeat then counts them itself), and all of them while the index
cannot be trusted."""

from __future__ import annotations

import time

from gateway.index_mirror import IndexMirror, ReplicaInfo
from gateway.policies import make_policy
from gateway.routing import Router
from kvroute.prompt_cache import Prompt

DECODE_WEIGHT = 10.0


def replica(replica_id: str, heartbeat_ts: float) -> ReplicaInfo:
    return ReplicaInfo(replica_id, f"http://{replica_id}", "m", "fp", 16, "e", 100, 0, 0, 0, 0, heartbeat_ts)


def loads(router: Router, heartbeat_ts: float) -> dict[str, float]:
    replicas = [replica("a", heartbeat_ts), replica("b", heartbeat_ts)]
    plan = router.route("m", "fp", replicas, Prompt.of(range(64)), None)
    return {score.replica_id: score.load for score in plan.decision.scores}


def test_in_flight_requests_count_until_a_later_heartbeat() -> None:
    mirror = IndexMirror("redis://127.0.0.1:1/0")  # never started: an empty index
    mirror._set_stale(False)  # as after a bootstrap
    router = Router(mirror, make_policy("least-loaded", decode_weight=DECODE_WEIGHT))
    before = time.time() - 10
    first = router.sent("a", 100)
    second = router.sent("a", 50)
    assert router.inflight("a") == 2 and router.inflight("b") == 0
    assert loads(router, before) == {"a": 150 + 2 * DECODE_WEIGHT, "b": 0}
    assert loads(router, time.time() + 10) == {"a": 0, "b": 0}  # that heartbeat counts them itself
    assert loads(router, before) == {"a": 150 + 2 * DECODE_WEIGHT, "b": 0}  # counted again
    router.done(first)
    assert loads(router, before) == {"a": 50 + DECODE_WEIGHT, "b": 0}
    third = router.sent("b", 7)
    router.done(second)
    router.done(second)  # twice: ignored
    assert loads(router, before) == {"a": 0, "b": 7 + DECODE_WEIGHT}
    assert router.inflight("a") == 0 and router.inflight("b") == 1
    mirror._set_stale(True)  # Redis lost: the gateway's own count is all there is, heartbeats or not
    assert loads(router, time.time() + 10) == {"a": 0, "b": 7 + DECODE_WEIGHT}
    router.done(third)
    assert loads(router, before) == {"a": 0, "b": 0}
