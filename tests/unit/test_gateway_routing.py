"""The router's own load accounting: requests it sent count on their replica until a heartbeat
taken after them does (the heartbeat then counts them itself), and all of them while the index
cannot be trusted; a heartbeat that names this gateway's share loses the requests that finished
since it was taken."""

from __future__ import annotations

import time

import pytest

from gateway.index_mirror import IndexMirror, ReplicaInfo
from gateway.policies import make_policy
from gateway.routing import Router
from kvroute.protocol import model_seed
from kvroute.text.prompt_ids import PromptIds

DECODE_WEIGHT = 10.0


def replica(replica_id: str, heartbeat_ts: float) -> ReplicaInfo:
    return ReplicaInfo(replica_id, f"http://{replica_id}", "m", "fp", 16, "e", 100, 0, 0, 0, 0, heartbeat_ts)


def loads(router: Router, heartbeat_ts: float) -> dict[str, float]:
    replicas = [replica("a", heartbeat_ts), replica("b", heartbeat_ts)]
    plan = router.route("m", "fp", replicas, PromptIds.of(range(64)), None)
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


GATEWAY = "gw-1"


def heartbeat_after_our_request(replica_id: str, taken_at: float, **share: int) -> ReplicaInfo:
    """A heartbeat taken while this gateway's request ran there (running, or waiting with its
    prefill), which still says so after the request finished."""
    running, waiting, prefill = share.get("running", 0), share.get("waiting", 0), share.get("prefill", 0)
    return ReplicaInfo(
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
    mirror = IndexMirror("redis://127.0.0.1:1/0")
    mirror._set_stale(False)
    router = Router(mirror, make_policy("kv"), gateway_id=GATEWAY)
    for replica_id in ("holder", "idle"):
        mirror.index.add_replica(replica_id, "m")
    taken_at = time.time()
    ticket = router.sent("holder", 900)
    router.done(ticket)  # the answer arrived: the client sends its next turn at once
    replicas = [
        heartbeat_after_our_request("holder", taken_at, **share),
        heartbeat_after_our_request("idle", taken_at),
    ]
    for blocks in range(1, 41):
        prompt = PromptIds.of(range(blocks * 16 + 5))
        mirror.index.stored("holder", prompt.block_hashes(16, model_seed("m", "fp"))[:blocks])
        for _ in range(20):
            plan = router.route("m", "fp", replicas, prompt, None)
            assert plan.decision.replica_id == "holder", plan.decision.scores


def test_requests_still_in_flight_keep_counting_against_a_heartbeat_that_names_them() -> None:
    """The share of the heartbeat that is still in flight here counts once, not twice; what was
    sent after the heartbeat is added; what finished is gone."""
    mirror = IndexMirror("redis://127.0.0.1:1/0")
    mirror._set_stale(False)
    router = Router(mirror, make_policy("least-loaded", decode_weight=DECODE_WEIGHT), gateway_id=GATEWAY)
    first, second = router.sent("a", 100), router.sent("a", 50)
    taken_at = time.time()
    other = {GATEWAY: (1, 1, 50), "other-gateway": (3, 0, 0)}  # ours: one running, one waiting
    beat = ReplicaInfo("a", "http://a", "m", "fp", 16, "e", 100, 0, 4, 1, 50, taken_at, gateways=other)
    idle = replica("b", taken_at)

    def load_of_a() -> float:
        plan = router.route("m", "fp", [beat, idle], PromptIds.of(range(64)), None)
        return next(score.load for score in plan.decision.scores if score.replica_id == "a")

    assert load_of_a() == 50 + 5 * DECODE_WEIGHT  # exactly the heartbeat: both of ours are in it
    router.done(first)
    assert load_of_a() == 50 + 4 * DECODE_WEIGHT  # one of ours finished: still counted as waiting
    router.done(second)
    assert load_of_a() == 3 * DECODE_WEIGHT  # only the other gateway's three
    time.sleep(0.01)
    router.sent("a", 70)
    assert load_of_a() == 70 + 4 * DECODE_WEIGHT  # sent after the heartbeat: added
