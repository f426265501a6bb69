"""The gateway's degraded modes, with real processes: Redis stopped and restarted, the gateway
with no Redis at all (``--replica`` URLs), and a replica SIGKILLed mid-stream and between requests.

The tests share one stack and run in file order: the kill comes last.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvroute.local_redis import RedisServer
from tests.replica_process import KvrouteProcess, ReplicaProcess


@dataclass
class Stack:
    model: str
    redis: RedisServer
    gateway: KvrouteProcess
    replicas: list[ReplicaProcess]
    workdir: Path

    def replica(self, replica_id: str) -> ReplicaProcess:
        return next(r for r in self.replicas if f"127.0.0.1:{r.port}" == replica_id)


def _start_replicas(llama_dir: Path, workdir: Path, redis_url: str, count: int) -> list[ReplicaProcess]:
    """Starts ``count`` replicas side by side (each waits for its own health)."""
    started: list[ReplicaProcess | BaseException] = [None] * count  # type: ignore[list-item]

    def start(i: int) -> None:
        try:
            started[i] = ReplicaProcess(
                llama_dir,
                workdir / f"replica{i}.log",
                "--dtype", "float32", "--kv-cache-tokens", "8192", "--redis", redis_url,
                "--heartbeat-interval", "0.2", "--heartbeat-ttl", "10",
            )  # fmt: skip
        except BaseException as error:  # pytest.fail raises an Exception subclass of BaseException
            started[i] = error

    threads = [threading.Thread(target=start, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    replicas = [r for r in started if isinstance(r, ReplicaProcess)]
    failed = [r for r in started if not isinstance(r, ReplicaProcess)]
    if failed:
        for replica in replicas:
            replica.kill()
        raise failed[0]
    return replicas


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


def _wait_for(what: str, check, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("gateway-resilience")
    redis = RedisServer(workdir)
    redis.start()
    replicas: list[ReplicaProcess] = []
    gateway = None
    try:
        replicas = _start_replicas(llama_dir, workdir, redis.url, 2)
        gateway = KvrouteProcess(
            "gateway",
            workdir / "gateway.log",
            "--redis",
            redis.url,
            "--eject-after",
            "2",
            "--probe-interval",
            "0.5",
        )
        _wait_for("both replicas in the gateway", lambda: _health(gateway.url)["replicas"] == 2)
        yield Stack(llama_dir.name, redis, gateway, replicas, workdir)
    finally:
        if gateway is not None:
            gateway.terminate()
        for replica in replicas:
            replica.kill()
        redis.stop()


def _chat(url: str, model: str, content: str, **fields: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **fields}, timeout=30)


def _cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


LONG = "A long shared preamble that fills several blocks of the cache. " * 6


def test_redis_outage_keeps_serving_and_resyncs(stack: Stack) -> None:
    stack.redis.stop()
    _wait_for("the mirror to notice", lambda: _health(stack.gateway.url)["redis"] == "stale")
    for i in range(4):
        response = _chat(stack.gateway.url, stack.model, f"{LONG} Outage question {i}.")
        assert response.status_code == 200, response.text
    assert _health(stack.gateway.url)["replicas"] == 2, "the last known replicas stay in rotation"

    stack.redis.start()
    _wait_for(
        "the index to re-sync",
        lambda: (h := _health(stack.gateway.url))["redis"] == "ok" and h["replicas"] == 2,
    )
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
        _wait_for("the static replicas", lambda: _health(gateway.url)["replicas"] == 2)
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
