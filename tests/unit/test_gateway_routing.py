"""The router's own load accounting: requests it sent count on their replica until a heartbeat
taken after them does (the heartbeat then counts them itself), and all of them while the index
cannot be trusted; a heartbeat that names this gateway's share loses the requests that finished
since it was taken."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from gateway.fleet.fleet import Fleet
from gateway.index.mirror import IndexMirror
from gateway.index.snapshots import ReplicaHeartbeat
from gateway.pipeline import _prompt_ids_to_forward
from gateway.policies import Policy, make_policy
from gateway.routing import RoutePlan, Router
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, parse_request
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


def test_a_request_whose_prompt_the_replica_has_stored_no_longer_counts_its_prefill() -> None:
    """Three chats on three replicas, as a first-time user's test might send them: chat C's first
    (unstreamed) turn went to the replica that holds chat B (a shared template prefix), moments
    before B's next turn. While C's prefill may still be queued there, B's history does not
    outweigh it and B leaves (the cost model's choice, 212 against 208 here); once the replica's
    events store C's last full prompt block, C's prefill is over, and B stays, though no heartbeat
    has said so yet."""
    router = new_router(make_policy("kv"), gateway_id=GATEWAY)
    mirror, seed = router.mirror, model_seed("m", "fp")
    for replica_id in ("holder", "idle"):
        mirror.index.add_replica(replica_id, "m")
    taken_at = time.time() - 0.2  # the heartbeats predate C's turn
    replicas = [replica("holder", taken_at), replica("idle", taken_at)]
    chat_b = PromptIds.of(range(208))
    mirror.index.stored("holder", chat_b.block_hashes(16, seed)[:11])  # 176 tokens of B's history
    chat_c = PromptIds.of(range(1000, 1116))  # 7 full blocks, nothing cached anywhere
    plan_c = route(router, replicas, chat_c)
    holder = router.fleet.get("holder")
    assert holder is not None
    router.commit(plan_c, holder, len(chat_c), 1)
    scores = {s.replica_id: s.cost for s in route(router, replicas, chat_b).decision.scores}
    assert scores == {"holder": 208 - 176 + 64 + 116, "idle": 208}
    mirror.index.stored("holder", chat_c.block_hashes(16, seed))  # C's prefill is done
    plan_b = route(router, replicas, chat_b)
    assert plan_b.decision.replica_id == "holder", plan_b.decision.scores
    assert {s.replica_id: s.cost for s in plan_b.decision.scores} == {"holder": 208 - 176 + 64, "idle": 208}


def test_a_chat_just_answered_keeps_its_place_for_its_next_turn() -> None:
    """Chat B's first turn was just answered by "holder"; chat A's first turn, which shares only
    the template's opening (three blocks) with it, arrives before B's next turn. Both replicas are
    idle by their load, so the cached opening alone would send A to the holder, where B's next turn
    would then find A's prefill queued (and could leave). B's awaited turn counts as one sequence
    there for everyone but B: A goes to the idle replica, B's next turn to the holder. Once B's turn
    came, or the wait is over, nothing is awaited."""
    router = new_router(make_policy("kv"), gateway_id=GATEWAY)
    mirror, fleet, seed = router.mirror, router.fleet, model_seed("m", "fp")
    for replica_id in ("holder", "idle"):
        mirror.index.add_replica(replica_id, "m")
    taken_at = time.time() - 0.2
    replicas = [replica("holder", taken_at), replica("idle", taken_at)]
    opening = list(range(48))
    chat_b = PromptIds.of([*opening, *range(500, 560)])  # 108 tokens, 6 full blocks
    chat_a = PromptIds.of([*opening, *range(700, 760)])
    chat_b_next = PromptIds.of([*chat_b.ids, *range(900, 960)])  # B's answer and next message
    plan_b = route(router, replicas, chat_b)
    holder = fleet.get("holder")
    assert holder is not None
    ticket = router.commit(plan_b, holder, len(chat_b), 1)
    mirror.index.stored("holder", chat_b.block_hashes(16, seed))
    fleet.done(ticket)

    plan_a = route(router, replicas, chat_a)
    assert {s.replica_id: s.cost for s in plan_a.decision.scores} == {"holder": 108 - 48 + 64, "idle": 108}
    assert plan_a.winner == "idle"
    plan_b = route(router, replicas, chat_b_next)
    assert {s.replica_id: s.cost for s in plan_b.decision.scores} == {"holder": 168 - 96, "idle": 168}
    fleet.done(router.commit(plan_b, holder, len(chat_b_next), 1))
    assert list(holder.flights.answered) == [(168, chat_b_next.digest(168))], "B's turn came"

    router.expect_return_s = 0.05
    assert route(router, replicas, chat_a).winner == "idle"  # B's next-but-one turn is awaited
    time.sleep(0.06)  # no next turn came in time: the cached opening wins again
    assert route(router, replicas, chat_a).winner == "holder"


def sharing_an_opening(
    router: Router, replica_ids: tuple[str, str]
) -> tuple[list[ReplicaHeartbeat], list[int]]:
    """Two replicas that both hold a chat template's opening (three blocks), and their heartbeats,
    taken just before the requests to come; returns those and the opening."""
    opening = list(range(48))
    for replica_id in replica_ids:
        router.mirror.index.add_replica(replica_id, "m")
        router.mirror.index.stored(replica_id, PromptIds.of(opening).block_hashes(16, model_seed("m", "fp")))
    taken_at = time.time() - 0.2
    return [replica(replica_id, taken_at) for replica_id in replica_ids], opening


@pytest.mark.parametrize("seed", range(8))
def test_a_short_chats_next_turn_stays_before_the_answer_is_in_the_index(seed: int) -> None:
    """Chat B's first turn is short: its only full blocks are the template's opening, which both
    replicas hold. B's next turn comes before the holder's events of B's answer reach the gateway,
    so both replicas match the opening alone at equal load: the tie goes to the replica that just
    answered B, whatever the random draw (by chance, half of such turns left). Chat A's first turn,
    which shares the opening but not B's prompt, continues nothing there: B's awaited turn keeps
    counting as load for it, and A goes to the idle replica."""
    router = new_router(make_policy("kv", rng=random.Random(seed)), gateway_id=GATEWAY)
    fleet = router.fleet
    replicas, opening = sharing_an_opening(router, ("holder", "idle"))
    chat_b = PromptIds.of([*opening, *range(500, 510)])  # 58 tokens: the opening's 3 full blocks
    plan_b = route(router, replicas, chat_b)
    holder = fleet.get("holder")
    assert holder is not None
    fleet.done(router.commit(plan_b, holder, len(chat_b), 1))

    chat_a = PromptIds.of([*opening, *range(700, 710)])
    plan_a = route(router, replicas, chat_a)
    assert not any(score.continues for score in plan_a.decision.scores)
    assert plan_a.winner == "idle", plan_a.decision.scores
    chat_b_next = PromptIds.of([*chat_b.ids, *range(900, 930)])  # B's answer and next message
    plan_next = route(router, replicas, chat_b_next)
    costs = {s.replica_id: (s.cost, s.continues) for s in plan_next.decision.scores}
    assert costs == {"holder": (88 - 48, True), "idle": (88 - 48, False)}
    assert plan_next.winner == "holder"


def test_a_chats_next_turn_counts_its_answer_as_cached_where_it_was_answered() -> None:
    """Three chats on two replicas: chat X's first turn (93 tokens, 5 full blocks) was just
    answered by "holder" in 24 tokens, while chat Y's first turn is in flight there with 45 tokens
    of prefill to do; chat Z was answered by "other" and its next turn is awaited. X's next turn
    (131 tokens) comes before the holder's events of X's answer: counting only X's last prompt as
    cached there (80 tokens), the holder costs 131 - 80 + 64 + 45 = 160 against the other's
    131 - 48 + 64 = 147 and X leaves. The answer is cached too, all but its last token: 116
    tokens, 7 blocks, and X stays."""
    router = new_router(make_policy("kv"), gateway_id=GATEWAY)
    fleet = router.fleet
    replicas, opening = sharing_an_opening(router, ("holder", "other"))
    chat_x = PromptIds.of([*opening, *range(500, 545)])
    chat_z = PromptIds.of([*opening, *range(600, 645)])
    route(router, replicas, chat_x)  # hears the heartbeats
    holder, other = fleet.get("holder"), fleet.get("other")
    assert holder is not None and other is not None
    fleet.done(router.commit(route(router, replicas, chat_z), other, len(chat_z), 1), completion_tokens=24)
    x_ticket = router.commit(route(router, replicas, chat_x), holder, len(chat_x), 1)
    chat_y = PromptIds.of([*opening, *range(700, 745)])
    router.commit(route(router, replicas, chat_y), holder, len(chat_y), 1)
    fleet.done(x_ticket, completion_tokens=24)

    x_next = PromptIds.of([*chat_x.ids, *range(900, 924), *range(950, 964)])  # answer, next message
    plan = route(router, replicas, x_next)
    costs = {s.replica_id: s.cost for s in plan.decision.scores}
    assert costs == {"holder": 131 - 112 + 64 + 45, "other": 131 - 48 + 64}
    assert plan.winner == "holder"


class Answer:
    """An answer under way, as the fleet watches it: streaming (bytes came lately) or not."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.given_up: str | None = None

    def abandon(self, why: str) -> None:
        self.given_up = why

    def flowing(self, within_s: float) -> bool:
        return self.streaming


def test_a_replica_that_leaves_the_index_keeps_its_streams_while_they_flow() -> None:
    """Its heartbeat ended: an answer not streaming is given up at once (to be retried elsewhere);
    a stream still flowing is let run, and given up at a later poll once it goes silent, unless
    the replica is back; an ejection gives up everything."""
    fleet = new_router(make_policy("kv")).fleet
    now = time.time()
    fleet.heard([replica("a", now), replica("b", now)], frozenset())
    a, b = fleet.get("a"), fleet.get("b")
    assert a is not None and b is not None
    waiting, streaming, other = Answer(streaming=False), Answer(streaming=True), Answer(streaming=True)
    for answer in (waiting, streaming):
        fleet.watch(a, answer)
    fleet.watch(b, other)
    fleet.heard([replica("b", now)], frozenset())  # a's heartbeat ended
    assert waiting.given_up is not None and "left the index" in waiting.given_up
    assert streaming.given_up is None and other.given_up is None
    fleet.heard([replica("b", now)], frozenset())  # still flowing at the next poll
    assert streaming.given_up is None
    streaming.streaming = False
    fleet.heard([replica("b", now)], frozenset())  # silent now: given up
    assert streaming.given_up is not None
    back = Answer(streaming=True)
    fleet.watch(a, back)
    fleet.heard([replica("a", now), replica("b", now)], frozenset())  # a is back: nothing given up
    back.streaming = False
    fleet.heard([replica("a", now), replica("b", now)], frozenset())
    assert back.given_up is None
    for _ in range(3):
        fleet.failed(b, "connection reset")
    assert other.given_up is not None and "ejected" in other.given_up


def test_the_prompt_ids_go_along_only_to_replicas_that_take_them() -> None:
    """A kvroute replica serves the ids the gateway routed on instead of tokenizing again; a vLLM
    server (its bridge names the tokenizer's URL apart) would ignore them, and a batch of
    completions prompts was tokenized for its first prompt only."""
    router = new_router(make_policy("kv"))
    prompt = PromptIds.of(range(40))
    chat = parse_request(
        ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    )
    batch = parse_request(CompletionRequest, b'{"model": "m", "prompt": ["a", "b"]}')
    kvroute_only = route(router, [replica("a", time.time()), replica("b", time.time())], prompt)
    assert _prompt_ids_to_forward(chat, kvroute_only) is prompt.ids
    assert _prompt_ids_to_forward(batch, kvroute_only) is None
    bridged = dataclasses.replace(replica("b", time.time()), tokenizer_url="http://bridge")
    mixed = route(router, [replica("a", time.time()), bridged], prompt)
    assert _prompt_ids_to_forward(chat, mixed) is None
