"""The gateway's degraded modes, with real processes: Redis stopped and restarted, the gateway
with no Redis at all (``--replica`` URLs), and a replica SIGKILLed mid-stream and between requests.

The tests share one stack and run in file order: the kill comes last.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvroute.protocol import Keys
from launcher.local_redis import free_port
from tests.helpers.processes import KvrouteProcess, running_stack
from tests.helpers.processes import StackProcesses as Stack
from tests.helpers.waiting import wait_until


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("gateway-resilience")
    gateway_args = ("--eject-after", "2", "--probe-interval", "0.5")
    with running_stack(
        llama_dir, workdir, 2, replica_args=("--heartbeat-ttl", "10"), gateway_args=gateway_args
    ) as processes:
        yield processes


def _chat(url: str, model: str, content: str, **fields: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **fields}, timeout=30)


def _cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


LONG = "A long shared preamble that fills several blocks of the cache. " * 6


def test_redis_outage_keeps_serving_and_resyncs(stack: Stack) -> None:
    stack.redis.stop()
    wait_until(lambda: _health(stack.gateway.url)["redis"] == "stale", "the mirror to notice", timeout=20)
    for i in range(4):
        response = _chat(stack.gateway.url, stack.model, f"{LONG} Outage question {i}.")
        assert response.status_code == 200, response.text
    assert _health(stack.gateway.url)["replicas"] == 2, "the last known replicas stay in rotation"

    stack.redis.start()  # empty: the replicas must register again
    seen: list[int] = []

    def resynced() -> bool:
        health = _health(stack.gateway.url)
        seen.append(health["replicas"])
        return health["redis"] == "ok" and health["replicas"] == 2

    wait_until(resynced, "the index to re-sync", timeout=20)
    assert min(seen) == 2, f"replicas known while Redis came back empty: {seen}"
    prompt = f"{LONG} After the outage."
    first = _chat(stack.gateway.url, stack.model, prompt)
    assert first.status_code == 200, first.text
    time.sleep(0.5)  # the replica's cache events reach the re-synced index
    again = _chat(stack.gateway.url, stack.model, prompt)
    assert again.headers["x-kvroute-replica"] == first.headers["x-kvroute-replica"]
    assert int(again.headers["x-kvroute-predicted-cached-tokens"]) > 0
    assert _cached(again) > 0


def test_gateway_without_redis_from_replica_urls(stack: Stack) -> None:
    urls = [arg for r in stack.replicas for arg in ("--replica", r.url)]
    gateway = KvrouteProcess("gateway", stack.workdir / "gateway-static.log", *urls)  # policy kv: falls back
    try:
        wait_until(lambda: _health(gateway.url)["replicas"] == 2, "the static replicas", timeout=20)
        assert _health(gateway.url)["redis"] == "none"
        models = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == [stack.model]
        served = set()
        for i in range(4):
            response = _chat(gateway.url, stack.model, f"Static question {i}.")
            assert response.status_code == 200, response.text
            served.add(response.headers["x-kvroute-replica"])
        assert served <= {f"127.0.0.1:{r.port}" for r in stack.replicas}
        assert "routing least-loaded instead" in gateway.log_path.read_text()
    finally:
        gateway.terminate()


ADMIN = {"authorization": "Bearer drain-admin"}


def _drained_on(url: str, replica_id: str) -> bool:
    rows = httpx.get(f"{url}/admin/replicas", headers=ADMIN, timeout=5).json()["replicas"]
    return next(row["drained"] for row in rows if row["id"] == replica_id)


def test_a_drain_through_one_gateway_reaches_every_gateway(stack: Stack) -> None:
    """Gateways behind a balancer share one Redis: an admin's drain lands on one of them, and
    must take the replica out of every gateway's rotation (and a put-back, likewise)."""
    args = ("--redis", stack.redis.url, "--admin-key", "drain-admin")
    first, second = (KvrouteProcess("gateway", stack.workdir / f"gateway-{n}.log", *args) for n in "12")
    drained, kept = (f"127.0.0.1:{r.port}" for r in stack.replicas)
    try:
        for gateway in (first, second):
            wait_until(
                lambda g=gateway: _health(g.url)["replicas"] == 2, "the gateway's replicas", timeout=20
            )
        reply = httpx.post(f"{first.url}/admin/replicas/{drained}/drain", headers=ADMIN, timeout=10)
        assert reply.json() == {"id": drained, "drained": True, "shared": True}
        wait_until(
            lambda: _drained_on(second.url, drained), "the drain to reach the second gateway", timeout=5
        )
        for i in range(4):
            response = _chat(second.url, stack.model, f"Drained question {i}.")
            assert response.status_code == 200 and response.headers["x-kvroute-replica"] == kept
        put_back = httpx.delete(f"{second.url}/admin/replicas/{drained}/drain", headers=ADMIN, timeout=10)
        assert put_back.json() == {"id": drained, "drained": False, "shared": True}
        wait_until(
            lambda: not _drained_on(first.url, drained), "the put-back to reach the first gateway", timeout=5
        )
    finally:
        stack.redis.client().delete(Keys().drained)
        first.terminate()
        second.terminate()


def test_admin_lists_and_drains_static_replicas(stack: Stack) -> None:
    """Replicas given by ``--replica URL`` (no Redis): listed with what the gateway knows of them,
    one that does not answer included, and drained by their id, ``host:port``."""
    dead = f"http://127.0.0.1:{free_port()}"
    urls = [arg for url in [*(r.url for r in stack.replicas), dead] for arg in ("--replica", url)]
    admin = {"authorization": "Bearer root"}
    gateway = KvrouteProcess("gateway", stack.workdir / "gateway-admin.log", *urls, "--admin-key", "root")
    ids = [f"127.0.0.1:{r.port}" for r in stack.replicas]
    dead_id = dead.removeprefix("http://")

    def rows() -> dict[str, dict]:
        reply = httpx.get(f"{gateway.url}/admin/replicas", headers=admin, timeout=5)
        assert reply.status_code == 200, reply.text
        assert reply.json()["redis"] == "none"
        return {row["id"]: row for row in reply.json()["replicas"]}

    def served_by(prefix: str, requests: int) -> set[str]:
        replies = [_chat(gateway.url, stack.model, f"{prefix} {i}.") for i in range(requests)]
        return {reply.headers["x-kvroute-replica"] for reply in replies}

    def drain(replica_id: str, method: str = "POST") -> httpx.Response:
        url = f"{gateway.url}/admin/replicas/{replica_id}/drain"
        return httpx.request(method, url, headers=admin, timeout=5)

    try:
        wait_until(lambda: _health(gateway.url)["replicas"] == 2, "the static replicas", timeout=20)
        for i in range(4):
            assert _chat(gateway.url, stack.model, f"Admin question {i % 2}.").status_code == 200
        listed = rows()
        assert set(listed) == {*ids, dead_id}
        for replica_id, replica in zip(ids, stack.replicas, strict=True):
            row = listed[replica_id]
            assert row["source"] == "static" and row["epoch"] == "static" and row["url"] == replica.url
            assert row["model"] == stack.model and row["listed"] and row["healthy"]
            assert row["kv"] is None and row["heartbeat_age_s"] is None and row["load"]["running"] is None
            assert row["indexed_blocks"] == 0 and row["load"]["gateway_inflight"] == 0
            assert row["usage"]["reports"] == row["requests_routed"]
            assert row["usage"]["predicted_cached_tokens"] == 0  # load-only routing predicts nothing
        assert sum(listed[i]["requests_routed"] for i in ids) == 4
        assert sum(listed[i]["usage"]["cached_tokens"] for i in ids) > 0  # the repeats hit a cache
        silent = listed[dead_id]
        assert silent["source"] == "static" and silent["url"] == dead and not silent["drained"]
        assert not (silent["listed"] or silent["answering"] or silent["healthy"])
        assert silent["requests_routed"] == 0 and "model" not in silent

        assert drain(ids[0]).json() == {"id": ids[0], "drained": True, "shared": False}
        assert drain(dead_id).json() == {"id": dead_id, "drained": True, "shared": False}  # no Redis
        assert drain("127.0.0.1:1").status_code == 404
        served = {
            _chat(gateway.url, stack.model, f"Drained {i}.").headers["x-kvroute-replica"] for i in range(4)
        }
        assert served == {ids[1]}
        after = rows()
        assert after[ids[0]]["drained"] and not after[ids[0]]["healthy"] and after[dead_id]["drained"]
        assert drain(ids[0], "DELETE").json() == {"id": ids[0], "drained": False, "shared": False}
        served = {
            _chat(gateway.url, stack.model, f"Back {i}.").headers["x-kvroute-replica"] for i in range(12)
        }
        assert ids[0] in served  # ties go at random: 12 requests all elsewhere has odds of 1 in 2,048
    finally:
        gateway.terminate()


def test_a_killed_replica_mid_stream_and_after(stack: Stack) -> None:
    # a prefix only this test uses, long enough that its holder wins despite its stale load
    prompt = "Only the victim holds this preamble in its cache, block after block. " * 12 + "A story?"
    warm = _chat(stack.gateway.url, stack.model, prompt)
    assert warm.status_code == 200, warm.text
    time.sleep(0.5)  # its blocks reach the index: the same prompt goes back there
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[bytes] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{stack.gateway.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        victim_id = response.headers["x-kvroute-replica"]
        victim = stack.replica(victim_id)
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(line.encode())
            if len(events) == 3:
                victim.kill()  # SIGKILL
                break
        rest = [line for line in lines if line]
    assert time.monotonic() - started < 20, "the stream hung"
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))
    assert error["error"]["code"] == "upstream_failed" and victim_id in error["error"]["message"]

    # the next request prefers the victim (its cache) while its heartbeat lives: it is retried on
    # the survivor before any byte, and with the broken stream that makes two failures: ejected
    survivor = next(f"127.0.0.1:{r.port}" for r in stack.replicas if r is not victim)
    for i in range(5):
        response = _chat(stack.gateway.url, stack.model, f"{prompt} Follow-up {i}.")
        assert response.status_code == 200, response.text
        assert response.headers["x-kvroute-replica"] == survivor
    health = _health(stack.gateway.url)
    assert victim_id in health["ejected"] or health["replicas"] == 1, health
    metrics = httpx.get(f"{stack.gateway.url}/metrics", timeout=5).text
    assert f'kvroute_gateway_ejections_total{{replica="{victim_id}"}} 1.0' in metrics
    assert f'kvroute_gateway_retries_total{{model="{stack.model}"}} 0.0' not in metrics

    nonstream = _chat(stack.gateway.url, stack.model, "One more.", stream=False)
    assert nonstream.status_code == 200 and nonstream.headers["x-kvroute-replica"] == survivor
