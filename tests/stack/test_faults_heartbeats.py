"""Heartbeats after a fault, with real processes: an idle replica must register again once a Redis
stall is over, a gateway must let go of replicas whose heartbeats all stopped once its grace
period is over, and a stream from a replica that leaves the index while it still streams (a
graceful stop) must run to its end.

Each test prints its figures (``pytest -s``) and asserts its target; docs/RELIABILITY.md records the
latest run's.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvroute.protocol import Keys
from launcher.local_redis import RedisServer
from tests.helpers.faults import chat_body, sim_args, sim_profile
from tests.helpers.processes import ReplicaProcess, running_stack, stopped
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

REDIS_STALL_S = 4.0
REREGISTER_TARGET_S = 3.0  # a publisher retries every 0.5 s; its heartbeat interval here is 0.2 s


async def test_an_idle_replica_registers_again_after_a_redis_stall(
    llama_dir: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis SIGSTOPped for 4 s while a replica serves nothing: within 3 s of SIGCONT its heartbeat
    is back in Redis, under a new epoch."""
    args = (*sim_args("instant"), "--redis", redis_server.url, "--heartbeat-interval", "0.2")
    with ReplicaProcess(llama_dir, tmp_path / "replica.log", *args) as replica:
        redis = redis_server.client()
        key = Keys().heartbeat(replica.replica_id)
        epoch = redis.hget(key, "epoch")
        assert epoch is not None
        assert redis_server.process is not None
        pid = redis_server.process.pid
        with stopped(pid):
            await asyncio.sleep(REDIS_STALL_S)  # the fault's length, not a wait for something
        resumed = time.monotonic()
        try:
            await wait_until_async(
                lambda: redis.hget(key, "epoch") not in (None, epoch),
                "the replica's heartbeat back under a new epoch",
                timeout=REREGISTER_TARGET_S,
            )
            back: float | None = time.monotonic() - resumed
        except AssertionError:
            back = None
        log = replica.log()
        redis.close()
    print(
        f"\n[idle replica, Redis SIGSTOP {REDIS_STALL_S:g} s] heartbeat back"
        f" {'never' if back is None else f'{back:.2f} s'} after SIGCONT (target < {REREGISTER_TARGET_S:g} s);"
        f" the replica logged a failed publish: {'publishing to Redis failed' in log}"
    )
    assert back is not None, "the idle replica's heartbeat did not come back"


GRACE_S = 5.0  # the mirror's restart_grace, gateway/index/mirror.py


async def test_replicas_whose_heartbeats_all_stop_leave_after_the_grace(
    llama_dir: Path, tmp_path: Path
) -> None:
    """Both replicas SIGSTOPped (their heartbeats expire together, Redis is fine): the gateway keeps
    them for its 5 s grace, then lists none (and a request gets a 503 with retry-after, not a 404)
    by the heartbeat TTL + the grace + 2 s."""
    with running_stack(llama_dir, tmp_path, 2, replica_args=sim_args("instant")) as stack:
        gateway = stack.gateway.url
        pids = [replica.process.pid for replica in stack.replicas]
        async with httpx.AsyncClient(timeout=10) as client:

            async def listed() -> int:
                return (await client.get(f"{gateway}/health")).json()["replicas"]

            async def none_listed() -> bool:
                return await listed() == 0

            stopped_at = time.monotonic()
            with stopped(*pids):
                try:
                    await wait_until_async(
                        none_listed, "the gateway to list no replica", timeout=2.0 + GRACE_S + 2.0
                    )
                    gone: float | None = time.monotonic() - stopped_at
                except AssertionError:
                    gone = None
                still = await listed()
                body = {
                    "model": stack.model,
                    "messages": [{"role": "user", "content": "Anyone?"}],
                    "max_tokens": 1,
                }
                started = time.monotonic()
                try:
                    reply: httpx.Response | None = await client.post(
                        f"{gateway}/v1/chat/completions", json=body, timeout=5
                    )
                except httpx.TimeoutException:
                    reply = None
                answered_in = time.monotonic() - started
    status = "no answer within 5 s" if reply is None else reply.status_code
    print(
        f"\n[both replicas SIGSTOPped] the gateway listed none"
        f" {'never' if gone is None else f'after {gone:.2f} s'} (target < {2.0 + GRACE_S + 2.0:g} s),"
        f" still {still} listed; a request then: {status} in {answered_in:.2f} s"
    )
    assert gone is not None, f"the gateway still lists {still} replicas whose heartbeats stopped"
    assert reply is not None and reply.status_code == 503 and reply.headers.get("retry-after")


STREAM_TOKENS = 200  # 4 s at the sim's 20 ms a step: the stop comes early in it


async def test_a_stream_from_a_replica_stopping_gracefully_runs_to_its_end(
    llama_dir: Path, tmp_path: Path
) -> None:
    """A replica SIGTERMed while it streams through the gateway leaves the index at once (so no new
    request goes there) and finishes what it serves: the stream reaches all its tokens and its
    usage, with no error event, though the gateway saw its heartbeat end seconds before."""
    profile = sim_profile(tmp_path / "steady.json", decode_s=0.02)
    with running_stack(llama_dir, tmp_path, 2, replica_args=sim_args(profile)) as stack:
        gateway, by_id = stack.gateway.url, {replica.replica_id: replica for replica in stack.replicas}
        body = chat_body(stack.model, "Tell me a long story.", STREAM_TOKENS, stream=True)
        events: list[dict[str, object]] = []
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                victim = by_id[reply.headers["x-kvroute-replica"]]
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line.removeprefix("data: ")))
                    if len(events) == 10:
                        victim.process.send_signal(signal.SIGTERM)
                        stopped_at = time.monotonic()
                ended_in = time.monotonic() - stopped_at
            after = await client.post(f"{gateway}/v1/chat/completions", json={**body, "max_tokens": 1})
        exit_code = victim.process.wait(timeout=30)
    errors = [event for event in events if "error" in event]
    usage = next((event["usage"] for event in events if event.get("usage")), {})
    assert isinstance(usage, dict)
    print(
        f"\n[replica SIGTERMed mid-stream] the stream went on {ended_in:.2f} s after the signal:"
        f" {usage.get('completion_tokens')} tokens of {STREAM_TOKENS}, {len(errors)} errors; the next"
        f" request went to {after.headers.get('x-kvroute-replica')}; the replica exited {exit_code}"
    )
    assert not errors, errors
    assert usage.get("completion_tokens") == STREAM_TOKENS, usage
    assert ended_in > 1.5, "the stream ended before the gateway could see the replica leave"
    assert after.status_code == 200 and after.headers["x-kvroute-replica"] != victim.replica_id
