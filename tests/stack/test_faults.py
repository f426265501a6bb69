"""Faults in the fleet, with real processes: a replica SIGKILLed mid-stream (and restarted), Redis
SIGKILLed and restarted and SIGSTOPped under load, a replica SIGSTOPped under load, and fake
replicas that answer discovery and then misbehave (reset, stall after their headers, never
answer) beside a real one.

The replicas are simulated (``--engine sim``: the real scheduler, cache, Redis reporting and
server, a cost model instead of the forward pass): these tests are about the fleet, not the model.
Each test prints its figures (``pytest -s``) and asserts its target; docs/RELIABILITY.md records the
latest run's.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.protocol import Keys
from tests.helpers.faults import (
    ADMIN_KEY,
    FakeReplica,
    Load,
    Outcome,
    chat_body,
    post_whole,
    replica_rows,
    respawn,
    route,
    send,
    sim_args,
    sim_profile,
    stream_chat,
)
from tests.helpers.metrics import sample_value
from tests.helpers.processes import (
    KvrouteProcess,
    ReplicaProcess,
    Service,
    StackProcesses,
    running_stack,
    stopped,
)
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

ADMIN_ARGS = ("--admin-key", ADMIN_KEY)


async def _health(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    reply = await client.get(f"{url}/health", timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def _metrics(client: httpx.AsyncClient, url: str) -> str:
    reply = await client.get(f"{url}/metrics", timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.text


# --- 1. a replica SIGKILLed mid-stream ---------------------------------------------------------------

STREAMS = 16
LONG_STREAM_TOKENS = 200  # 25 ms a step: about 5 s a stream


async def test_replica_sigkill_mid_stream(llama_dir: Path, tmp_path: Path) -> None:
    """16 streams over 3 replicas; the busiest replica is SIGKILLed with every stream mid-way.
    Only its streams fail, each with an OpenAI error event and [DONE] within 1 s of the kill; the
    gateway takes it out of rotation and its blocks out of the index; restarted on its port, it
    rejoins under a new epoch."""
    profile = sim_profile(tmp_path / "slow.json", decode_s=0.025)
    with running_stack(
        llama_dir, tmp_path, 3, replica_args=sim_args(profile), gateway_args=ADMIN_ARGS
    ) as stack:
        gateway = stack.gateway.url
        restarted: Service | None = None
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                outcomes = [Outcome() for _ in range(STREAMS)]
                bodies = [
                    chat_body(
                        stack.model,
                        f"Stream {i} of the kill test: a long story?",
                        LONG_STREAM_TOKENS,
                        stream=True,
                    )
                    for i in range(STREAMS)
                ]
                streams = [
                    asyncio.create_task(stream_chat(client, gateway, body, outcome))
                    for body, outcome in zip(bodies, outcomes, strict=True)
                ]
                await wait_until_async(
                    lambda: all(o.chunks >= 20 for o in outcomes), "every stream to be under way", timeout=30
                )
                served = collections.Counter(o.replica for o in outcomes)
                victim_id = served.most_common(1)[0][0]
                assert victim_id is not None
                victim = stack.replica(victim_id)
                old_epoch = (await replica_rows(client, gateway))[victim_id]["epoch"]

                victim.kill()  # SIGKILL
                killed = time.monotonic()
                ejected_after: float | None = None
                while True:  # out of rotation (ejected), then out of the index (heartbeat expired)
                    row = (await replica_rows(client, gateway)).get(victim_id)
                    now = time.monotonic() - killed
                    if row is None:
                        dropped_after = now
                        break
                    if row["ejected"] and ejected_after is None:
                        ejected_after = now
                    assert now < 15, f"the gateway still lists the killed replica: {row}"
                    await asyncio.sleep(0.02)
                async with asyncio.timeout(30):
                    await asyncio.gather(*streams)
                index_blocks, survivors_blocks, victim_own = await _blocks_after_the_drop(
                    client, stack, victim_id
                )
                metrics = await _metrics(client, gateway)
                victim_body = next(b for b, o in zip(bodies, outcomes, strict=True) if o.replica == victim_id)
                decision = await route(client, gateway, victim_body)

                respawned_at = time.monotonic()
                restarted = await asyncio.to_thread(respawn, victim, tmp_path / "replica-restarted.log")

                async def rejoined() -> dict[str, Any] | None:
                    row = (await replica_rows(client, gateway)).get(victim_id)
                    return row if row and row["epoch"] != old_epoch and row["healthy"] else None

                row = await wait_until_async(rejoined, "the restarted replica to rejoin", timeout=30)
                rejoined_after = time.monotonic() - respawned_at
        finally:
            if restarted is not None:
                restarted.terminate()

    failed = [o for o in outcomes if not o.ok]
    error_delays = [o.error_at - killed for o in failed if o.error_at is not None]
    out_of_rotation = min(t for t in (ejected_after, dropped_after) if t is not None)
    ejected = "never" if ejected_after is None else f"{ejected_after:.2f} s"
    print(
        f"\n[replica SIGKILL] failed {len(failed)}/{STREAMS} streams, all {served[victim_id]} of the killed"
        f" replica's; their error events came {min(error_delays, default=0):.3f}-"
        f"{max(error_delays, default=0):.3f} s after the kill (target < 1 s); out of rotation after"
        f" {out_of_rotation:.2f} s (ejected {ejected}, out of the index {dropped_after:.2f} s);"
        f" the index holds {index_blocks} blocks, the union of"
        f" the survivors' sets in Redis, none of the {victim_own} only the killed replica held (its set"
        f" is still in Redis); restarted on its port, it rejoined under"
        f" epoch {row['epoch']} (was {old_epoch}) {rejoined_after:.1f} s after the restart began"
    )
    assert {o.replica for o in failed} == {victim_id}, "only the killed replica's streams may fail"
    assert len(failed) == served[victim_id], "every stream of the killed replica was mid-way: all fail"
    for outcome in failed:
        assert outcome.status == 200 and outcome.done and outcome.failure is None, outcome
        assert outcome.error is not None and outcome.error["code"] == "upstream_failed", outcome.error
        assert victim_id in outcome.error["message"]
        assert outcome.error_at is not None and outcome.error_at - killed < 1.0
    for outcome in outcomes:
        if outcome.ok:
            assert outcome.usage is not None and outcome.usage["completion_tokens"] == LONG_STREAM_TOKENS
    assert out_of_rotation < 3.0, "the heartbeat TTL is 2 s and the gateway polls every 0.5 s"
    assert sample_value(metrics, "kvroute_index_replicas", model=stack.model) == 2
    assert index_blocks == survivors_blocks and victim_own > 0
    assert victim_id not in {c["replica_id"] for c in decision["candidates"]}
    assert row["healthy"] and not row["ejected"] and row["epoch"] != old_epoch


async def _blocks_after_the_drop(
    client: httpx.AsyncClient, stack: StackProcesses, victim_id: str
) -> tuple[int, int, int]:
    """Waits until the gateway's index holds exactly the survivors' blocks (the union of their
    sets in Redis); returns its size, that union's, and the blocks only the victim's set holds."""
    keys, redis = Keys(), stack.redis.client()
    survivors = [keys.blocks(r.replica_id) for r in stack.replicas if r.replica_id != victim_id]
    victim_own = len(redis.sdiff([keys.blocks(victim_id), *survivors]))
    sizes: list[int] = []

    async def settled() -> bool:
        index = int(sample_value(await _metrics(client, stack.gateway.url), "kvroute_index_blocks"))
        sizes[:] = [index, len(redis.sunion(survivors))]
        return sizes[0] == sizes[1]

    try:
        await wait_until_async(settled, "the index to hold the survivors' blocks alone", timeout=10)
    finally:
        redis.close()
    return sizes[0], sizes[1], victim_own


# --- 2. Redis SIGKILLed and restarted, then SIGSTOPped, under load ---------------------------------

REDIS_STALL_S = 4.0
LOAD_PROMPTS = [
    f"Conversation {k}: a steady client asks the same few questions again and again. " * 3 for k in range(6)
]


def _steady_body(model: str) -> Callable[[int, int], dict[str, Any]]:
    def body(client: int, i: int) -> dict[str, Any]:
        # a shared preamble, then a question of its own: new cache pages (events) all along, as
        # under real traffic (an idle replica is test_faults_heartbeats.py's)
        question = f" Client {client} asks question {i} once and never again, filling a page of its own."
        return chat_body(
            model, LOAD_PROMPTS[(client + i) % len(LOAD_PROMPTS)] + question, 6, stream=i % 2 == 0
        )

    return body


async def _through_redis_fault(
    client: httpx.AsyncClient, stack: StackProcesses, name: str, fault: Callable[[], Awaitable[None]]
) -> tuple[float, float, int]:
    """Runs ``fault`` with a probe prompt cached on one replica and indexed; returns the seconds
    from the fault's end until routing holds again (Redis polled, every heartbeat fresh, the probe's
    blocks matched on their replica), the seconds routing did not match them (while the index is
    stale routing is load-only, by design), and the fewest replicas the gateway listed meanwhile."""
    gateway = stack.gateway.url
    probe = chat_body(
        stack.model, f"{name}: a preamble only this probe sends, block after block. " * 5, 1, stream=False
    )
    warm = await post_whole(client, gateway, probe)
    assert warm.ok and warm.replica is not None, warm
    owner, warmed = warm.replica, time.monotonic()

    async def indexed() -> bool:
        """The probe's blocks are in the index on their replica (the 0.3 s predictions are gone)."""
        decision = await route(client, gateway, probe)
        matched = {c["replica_id"]: c["matched_tokens"] for c in decision["candidates"]}
        return matched.get(owner, 0) > 0 and time.monotonic() > warmed + 0.5

    await wait_until_async(indexed, f"{name}: the probe's blocks in the index", timeout=10)
    unmatched: list[float] = []
    fewest, watching = len(stack.replicas), True

    async def watch() -> None:
        nonlocal fewest
        while watching:
            if not await indexed():
                unmatched.append(time.monotonic())
            fewest = min(fewest, (await _health(client, gateway))["replicas"])
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    await fault()
    ended = time.monotonic()

    async def holds() -> bool:
        if (await _health(client, gateway))["redis"] != "ok":
            return False
        rows = await replica_rows(client, gateway)
        fresh = all(
            (row := rows.get(r.replica_id)) is not None and row["heartbeat_age_s"] < 1.0
            for r in stack.replicas
        )
        return fresh and await indexed()

    await wait_until_async(holds, f"{name}: routing to hold again", timeout=20)
    recovery = time.monotonic() - ended
    watching = False
    await watcher
    return recovery, unmatched[-1] - unmatched[0] if unmatched else 0.0, fewest


async def test_redis_sigkill_and_sigstop_under_load(llama_dir: Path, tmp_path: Path) -> None:
    """Four clients send chats back to back (streaming and not) while Redis is SIGKILLed and
    restarted empty on its port, then SIGSTOPped for 4 s three times: no request fails, none gets
    a 404, and cached-prefix routing holds again within seconds of each fault."""
    replica_args = (*sim_args("cpu-smollm2"), "--kv-cache-tokens", "65536")
    gateway_args = (*ADMIN_ARGS, "--prediction-ttl", "0.3")
    with running_stack(llama_dir, tmp_path, 2, replica_args=replica_args, gateway_args=gateway_args) as stack:
        redis = stack.redis
        gateway = stack.gateway.url

        async with httpx.AsyncClient(timeout=30) as client:

            async def kill_and_restart() -> None:
                redis.stop()  # SIGKILL
                await wait_until_async(
                    lambda: _stale(client, gateway), "the gateway to notice Redis is gone", timeout=10
                )
                await asyncio.to_thread(redis.start)  # empty, on the same port

            async def stall() -> None:
                assert redis.process is not None
                pid = redis.process.pid
                with stopped(pid):
                    await asyncio.sleep(REDIS_STALL_S)  # the fault's length, not a wait for something

            faults = [("Redis SIGKILL + restart", kill_and_restart)] + [
                (f"Redis SIGSTOP {REDIS_STALL_S:g} s #{n}", stall) for n in (1, 2, 3)
            ]
            figures = {}
            async with Load(client, gateway, _steady_body(stack.model), clients=4) as load:
                started = time.monotonic()
                for name, fault in faults:
                    figures[name] = await _through_redis_fault(client, stack, name, fault)
            elapsed = time.monotonic() - started

    outcomes = load.outcomes
    failed = [o for o in outcomes if not o.ok]
    not_found = [o for o in outcomes if o.status == 404]
    print(
        f"\n[Redis faults] {len(outcomes)} requests in {elapsed:.1f} s under load: {len(failed)} failed,"
        f" {len(not_found)} answered 404 (target 0 and 0)"
    )
    for name, (recovery, unmatched, fewest) in figures.items():
        print(
            f"  {name}: routing held again {recovery:.2f} s after the fault ended (target < 5 s);"
            f" load-only routing (index stale) for {unmatched:.2f} s; fewest replicas listed: {fewest} (of 2)"
        )
    assert len(outcomes) >= 100, "the load did not run"
    assert not not_found, not_found[:3]
    assert not failed, failed[:3]
    for name, (recovery, _, fewest) in figures.items():
        assert recovery < 5.0, name
        assert fewest == 2, f"{name}: the gateway dropped replicas that were only cut off from Redis"


async def _stale(client: httpx.AsyncClient, gateway: str) -> bool:
    return (await _health(client, gateway))["redis"] == "stale"


# --- 3. a replica SIGSTOPped under load -------------------------------------------------------------

REPLICA_STALL_S = 10.0
STALL_TTFB_S = 3.0


async def test_replica_sigstop_under_load(llama_dir: Path, tmp_path: Path) -> None:
    """Six clients stream back to back over two replicas (least-loaded routing) while one is
    SIGSTOPped for 10 s: nobody waits past the TTFB deadline, the requests move to the other
    replica, and the streams the stopped one was serving end with an error event within seconds."""
    profile = sim_profile(tmp_path / "steady.json", decode_s=0.02)
    gateway_args = (*ADMIN_ARGS, "--policy", "least-loaded", "--ttfb-timeout", f"{STALL_TTFB_S:g}")
    with running_stack(
        llama_dir, tmp_path, 2, replica_args=sim_args(profile), gateway_args=gateway_args
    ) as stack:
        victim, survivor = stack.replicas
        gateway = stack.gateway.url

        def body(client: int, i: int) -> dict[str, Any]:
            return chat_body(stack.model, f"Client {i} asks question {i}.", 30, stream=True)

        async with httpx.AsyncClient(timeout=30) as client, Load(client, gateway, body, clients=6) as load:

            def caught_mid_stream() -> list[Outcome]:
                return [
                    o
                    for o in load.outcomes
                    if o.in_flight and o.replica == victim.replica_id and 0 < o.chunks < 20
                ]

            await wait_until_async(
                lambda: len(caught_mid_stream()) >= 2, "streams under way on the victim", timeout=20
            )
            caught = caught_mid_stream()
            stopped_at = time.monotonic()
            with stopped(victim.process.pid):
                await asyncio.sleep(REPLICA_STALL_S)  # the fault's length, not a wait for something
            resumed = time.monotonic()

            async def back() -> bool:
                row = (await replica_rows(client, gateway)).get(victim.replica_id)
                return row is not None and row["healthy"]

            await wait_until_async(back, "the resumed replica back in rotation", timeout=15)
            back_after = time.monotonic() - resumed

    during = [o for o in load.outcomes if stopped_at <= o.started < resumed]
    failed = [o for o in during if not o.ok]
    worst = max(o.latency for o in during)
    served = collections.Counter(o.replica for o in during)
    ended_after = [o.ended - stopped_at for o in caught if o.ended is not None]
    print(
        f"\n[replica SIGSTOP {REPLICA_STALL_S:g} s] {len(during)} requests started during the stall:"
        f" {len(failed)} failed, longest {worst:.2f} s (target < TTFB {STALL_TTFB_S:g} s + 1 s), served by"
        f" {dict(served)}; the {len(caught)} streams caught mid-way on the stopped replica ended with an"
        f" error event {min(ended_after):.2f}-{max(ended_after):.2f} s after the stop (target < 5 s);"
        f" back in rotation {back_after:.2f} s after SIGCONT"
    )
    assert len(during) >= 10, "the load did not run through the stall"
    assert not failed, failed[:3]
    assert worst < STALL_TTFB_S + 1.0
    assert set(served) == {survivor.replica_id}
    for outcome in caught:
        assert outcome.error is not None and outcome.error["code"] == "upstream_failed", outcome
        assert outcome.done and outcome.ended is not None and outcome.ended - stopped_at < 5.0


# --- 4. fake replicas that answer discovery, then misbehave ---------------------------------------

FAKE_TTFB_S = 2.0
FAKE_UPSTREAM_TIMEOUT_S = 8.0  # bounds the test when a fake is not given up at the TTFB deadline
WAVES, WAVE = 3, 6


@pytest.fixture(scope="module")
def lone_replica(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A sim replica without Redis, for gateways that know their replicas by ``--replica URL``."""
    log = tmp_path_factory.mktemp("lone-replica") / "replica.log"
    with ReplicaProcess(llama_dir, log, *sim_args("instant"), "--kv-cache-tokens", "8192") as replica:
        yield replica


@pytest.mark.parametrize("mode", ["reset", "stall", "silent"])
async def test_misbehaving_replica_beside_a_real_one(
    mode: str, lone_replica: Service, tmp_path: Path
) -> None:
    """A fake replica that discovery lists like a real one, and that resets every generation
    request (``reset``), sends a stream's headers then nothing (``stall``), or accepts and never
    answers (``silent``), beside a real replica: three waves of six concurrent requests all
    succeed, each within the TTFB deadline (retried on the real replica), and the fake is ejected
    after two failures, so the last wave never meets it."""
    with FakeReplica(lone_replica.url, mode) as fake:
        gateway = KvrouteProcess(
            "gateway",
            tmp_path / "gateway.log",
            "--replica", fake.url, "--replica", lone_replica.url,
            "--ttfb-timeout", f"{FAKE_TTFB_S:g}", "--eject-after", "2",
            "--probe-interval", "30",  # an ejected fake answers /health: keep it out for the test
            "--upstream-timeout", f"{FAKE_UPSTREAM_TIMEOUT_S:g}",
        )  # fmt: skip
        with gateway:
            async with httpx.AsyncClient(timeout=FAKE_UPSTREAM_TIMEOUT_S + 10) as client:
                health = await _health(client, gateway.url)
                assert health["replicas"] == 2, health
                model = (await client.get(f"{gateway.url}/v1/models")).json()["data"][0]["id"]
                waves: list[list[Outcome]] = []
                tried_before_last = 0
                for w in range(WAVES):
                    tried_before_last = fake.posts
                    bodies = [
                        # whole answers too where the fake fails before any byte (a reset): a whole
                        # answer has no TTFB deadline, only --upstream-timeout
                        chat_body(model, f"Wave {w} request {i}.", 8, stream=mode != "reset" or i % 2 == 0)
                        for i in range(WAVE)
                    ]
                    waves.append(list(await asyncio.gather(*(send(client, gateway.url, b) for b in bodies))))
                health = await _health(client, gateway.url)
                metrics = await _metrics(client, gateway.url)

    outcomes = [o for wave in waves for o in wave]
    failed = [o for o in outcomes if not o.ok]
    worst = max(o.latency for o in outcomes)
    last_worst = max(o.latency for o in waves[-1])
    ejections = sample_value(metrics, "kvroute_gateway_ejections_total", default=0.0, replica=fake.replica_id)
    print(
        f"\n[fake replica: {mode}] {len(outcomes)} requests, {len(failed)} failed; longest {worst:.2f} s"
        f" (target < TTFB {FAKE_TTFB_S:g} s + 1.5 s); the fake got {fake.posts} generation requests"
        f" (held {max(fake.held, default=0):.2f} s at most), ejected {ejections:.0f} time(s); last wave:"
        f" longest {last_worst:.2f} s, {fake.posts - tried_before_last} request(s) to the fake"
    )
    assert not failed, failed[:3]
    assert fake.posts >= 2, "the fake was never tried: the test proves nothing"
    assert worst < FAKE_TTFB_S + 1.5
    assert fake.replica_id in health["ejected"] and ejections == 1
    assert fake.posts == tried_before_last, "an ejected replica got requests"
    assert last_worst < 1.0
