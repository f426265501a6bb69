"""The router's own load accounting: requests it sent count on their replica until a heartbeat
taken after them does (the heartbeat then counts them itself), and all of them while the index
cannot be trusted; a heartbeat that names this gateway's share loses the requests that finished
since it was taken."""

from __future__ import annotations

import time

import pytest

from gateway.fleet.fleet import Fleet
from gateway.index.mirror import IndexMirror
from gateway.index.snapshots import ReplicaHeartbeat
from gateway.policies import Policy, make_policy
from gateway.routing import RoutePlan, Router
from kvroute.protocol import model_seed
from kvroute.text.prompt_ids import PromptIds

DECODE_WEIGHT = 10.0


def replica(replica_id: str, heartbeat_ts: float) -> ReplicaHeartbeat:
    return ReplicaHeartbeat(
        replica_id, f"http://{replica_id}", "m", "fp", 16, "e", 100, 0, 0, 0, 0, heartbeat_ts
    )


def route(router: Router, heartbeats: list[ReplicaHeartbeat], prompt: PromptIds) -> RoutePlan:
    """The plan for ``prompt`` once the fleet has heard these heartbeats (as after a poll)."""
    router.fleet.heard(heartbeats, frozenset())
    roster = router.fleet.routable("m")
    assert roster is not None
    plan = router.plan(roster, prompt, None)
    assert plan is not None
    return plan


def loads(router: Router, heartbeat_ts: float) -> dict[str, float]:
    plan = route(router, [replica("a", heartbeat_ts), replica("b", heartbeat_ts)], PromptIds.of(range(64)))
    return {score.replica_id: score.load for score in plan.decision.scores}


def new_router(policy: Policy, gateway_id: str = "") -> Router:
    """A router over an empty fleet and a mirror never started (an empty index), as after a
    bootstrap."""
    mirror = IndexMirror("redis://127.0.0.1:1/0")
    mirror._set_stale(False)
    return Router(Fleet(eject_after=3), mirror, policy, gateway_id=gateway_id)


def sent(router: Router, replica_id: str, uncached_tokens: int) -> int:
    replica = router.fleet.get(replica_id)
    assert replica is not None
    return router.fleet.sent(replica, uncached_tokens)


def inflight(router: Router, replica_id: str) -> int:
    replica = router.fleet.get(replica_id)
    return 0 if replica is None else replica.inflight


def test_in_flight_requests_count_until_a_later_heartbeat() -> None:
    router = new_router(make_policy("least-loaded", decode_weight=DECODE_WEIGHT))
    mirror, fleet = router.mirror, router.fleet
    before = time.time() - 10
    fleet.heard([replica("a", before), replica("b", before)], frozenset())
    first = sent(router, "a", 100)
    second = sent(router, "a", 50)
    assert inflight(router, "a") == 2 and inflight(router, "b") == 0
    assert loads(router, before) == {"a": 150 + 2 * DECODE_WEIGHT, "b": 0}
    assert loads(router, time.time() + 10) == {"a": 0, "b": 0}  # that heartbeat counts them itself
    assert loads(router, before) == {"a": 150 + 2 * DECODE_WEIGHT, "b": 0}  # counted again
    fleet.done(first)
    assert loads(router, before) == {"a": 50 + DECODE_WEIGHT, "b": 0}
    third = sent(router, "b", 7)
    fleet.done(second)
    fleet.done(second)  # twice: ignored
    assert loads(router, before) == {"a": 0, "b": 7 + DECODE_WEIGHT}
    assert inflight(router, "a") == 0 and inflight(router, "b") == 1
    mirror._set_stale(True)  # Redis lost: the gateway's own count is all there is, heartbeats or not
    assert loads(router, time.time() + 10) == {"a": 0, "b": 7 + DECODE_WEIGHT}
    fleet.done(third)
    assert loads(router, before) == {"a": 0, "b": 0}


GATEWAY = "gw-1"


def heartbeat_after_our_request(replica_id: str, taken_at: float, **share: int) -> ReplicaHeartbeat:
    """A heartbeat taken while this gateway's request ran there (running, or waiting with its
    prefill), which still says so after the request finished."""
    running, waiting, prefill = share.get("running", 0), share.get("waiting", 0), share.get("prefill", 0)
    return ReplicaHeartbeat(
        replica_id, f"http://{replica_id}", "m", "fp", 16, "e", 100, 0, running, waiting, prefill,
        taken_at, gateways={GATEWAY: (running, waiting, prefill)} if running or waiting else {},
    )  # fmt: skip


@pytest.mark.parametrize(
    "share", [{"running": 1}, {"waiting": 1, "prefill": 900}], ids=["decoding", "prefilling"]
)
def test_the_replica_that_just_answered_keeps_the_chat_whatever_its_length(share: dict[str, int]) -> None:
    """Two idle replicas, one holding the chat's prefix (1 to 40 blocks) and still reporting the
    finished request in its heartbeat: the holder wins every time (the default kv policy, ties
    at random), because the heartbeat names this gateway's share and nothing of it is in flight."""
    router = new_router(make_policy("kv"), gateway_id=GATEWAY)
    mirror = router.mirror
    for replica_id in ("holder", "idle"):
        mirror.index.add_replica(replica_id, "m")
    taken_at = time.time()
    replicas = [
        heartbeat_after_our_request("holder", taken_at, **share),
        heartbeat_after_our_request("idle", taken_at),
    ]
    router.fleet.heard(replicas, frozenset())
    ticket = sent(router, "holder", 900)
    router.fleet.done(ticket)  # the answer arrived: the client sends its next turn at once
    for blocks in range(1, 41):
        prompt = PromptIds.of(range(blocks * 16 + 5))
        mirror.index.stored("holder", prompt.block_hashes(16, model_seed("m", "fp"))[:blocks])
        for _ in range(20):
            plan = route(router, replicas, prompt)
            assert plan.decision.replica_id == "holder", plan.decision.scores


def test_requests_still_in_flight_keep_counting_against_a_heartbeat_that_names_them() -> None:
    """The share of the heartbeat that is still in flight here counts once, not twice; what was
    sent after the heartbeat is added; what finished is gone."""
    router = new_router(make_policy("least-loaded", decode_weight=DECODE_WEIGHT), gateway_id=GATEWAY)
    router.fleet.heard([replica("a", 0.0), replica("b", 0.0)], frozenset())
    first, second = sent(router, "a", 100), sent(router, "a", 50)
    taken_at = time.time()
    other = {GATEWAY: (1, 1, 50), "other-gateway": (3, 0, 0)}  # ours: one running, one waiting
    beat = ReplicaHeartbeat("a", "http://a", "m", "fp", 16, "e", 100, 0, 4, 1, 50, taken_at, gateways=other)
    idle = replica("b", taken_at)

    def load_of_a() -> float:
        plan = route(router, [beat, idle], PromptIds.of(range(64)))
        return next(score.load for score in plan.decision.scores if score.replica_id == "a")

    assert load_of_a() == 50 + 5 * DECODE_WEIGHT  # exactly the heartbeat: both of ours are in it
    router.fleet.done(first)
    assert load_of_a() == 50 + 4 * DECODE_WEIGHT  # one of ours finished: still counted as waiting
    router.fleet.done(second)
    assert load_of_a() == 3 * DECODE_WEIGHT  # only the other gateway's three
    time.sleep(0.01)
    sent(router, "a", 70)
    assert load_of_a() == 70 + 4 * DECODE_WEIGHT  # sent after the heartbeat: added
