"""Heartbeats after a fault, with real processes: an idle replica must register again once a Redis
stall is over, and a gateway must let go of replicas whose heartbeats all stopped once its grace
period is over.

Each test prints its figures (``pytest -s``) and asserts its target; docs/RELIABILITY.md records the
latest run's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from kvroute.protocol import Keys
from launcher.local_redis import RedisServer
from tests.helpers.faults import sim_args
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
