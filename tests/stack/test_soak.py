"""A soak, with real processes: 10,000 requests on simulated replicas (``instant``) and 1,000 on
the tiny torch model through one gateway, mixing streaming and not, clients that leave mid-stream,
cancellations, n > 1 and stop strings. Afterwards nothing may be held: no KV page on any replica,
no request in flight at the gateway, and no process's memory growing over the second half.

``python -m pytest -s -m slow tests/stack/test_soak.py`` (the default run excludes slow tests);
docs/RELIABILITY.md records the latest run's figures.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.faults import ADMIN_KEY, chat_body, replica_rows, rss_kib, sim_args
from tests.helpers.metrics import sample_value, scrape
from tests.helpers.processes import REPLICA_DEFAULTS, ReplicaProcess, Service, running_stack
from tests.helpers.waiting import wait_until_async

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SIM_REQUESTS, TORCH_REQUESTS = 10_000, 1_000
CONCURRENCY = 16
TORCH_MODEL = "tiny-llama-torch"
RSS_EVERY = 250  # requests between memory samples
RSS_TOLERANCE = 0.05
PROMPTS = [
    f"Chat {c}: you are a patient assistant for a routing gateway, answering turn after turn. "
    f"Turn {t}: what happens to request {c * 7 + t}?"
    for c in range(60)
    for t in range(5)
]  # 300 prompts in 60 shared prefixes: the caches fill early, then stay at their size


@dataclass(frozen=True)
class Job:
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    n: int
    stop: tuple[str, ...]
    leave_after: int | None  # stream: chunks read before the client hangs up
    cancel_after: float | None  # seconds before the client cancels the request


def _jobs(sim_model: str, rng: random.Random) -> list[Job]:
    jobs = []
    for i in range(SIM_REQUESTS + TORCH_REQUESTS):
        torch = i < TORCH_REQUESTS
        stream = rng.random() < 0.5
        chance = rng.random()
        jobs.append(
            Job(
                model=TORCH_MODEL if torch else sim_model,
                prompt=rng.choice(PROMPTS),
                max_tokens=rng.randint(2, 10) if torch else rng.randint(4, 32),
                stream=stream,
                n=rng.choice((1, 1, 1, 2, 3)),
                stop=(("replica",) if rng.random() < 0.5 else ("the", "\n")) if rng.random() < 0.2 else (),
                leave_after=rng.randint(1, 3) if stream and chance < 0.1 else None,
                cancel_after=rng.uniform(0.001, 0.03) if 0.1 <= chance < 0.15 else None,
            )
        )
    rng.shuffle(jobs)
    return jobs


async def _run(client: httpx.AsyncClient, gateway: str, job: Job) -> str:
    """One job; what became of it: ok, left, cancelled, or what failed."""
    extra: dict[str, Any] = {"n": job.n, "temperature": 0.8}
    if job.stop:
        extra["stop"] = list(job.stop)
    body = chat_body(job.model, job.prompt, job.max_tokens, stream=job.stream, **extra)
    body["ignore_eos"] = job.stop == ()  # a stop string may end it; EOS too then
    try:
        async with asyncio.timeout(job.cancel_after):
            return await (_stream if job.stream else _whole)(client, gateway, body, job)
    except TimeoutError:
        return "cancelled" if job.cancel_after is not None else "client timeout"
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"


async def _whole(client: httpx.AsyncClient, gateway: str, body: dict[str, Any], job: Job) -> str:
    reply = await client.post(f"{gateway}/v1/chat/completions", json=body)
    if reply.status_code != 200:
        return f"HTTP {reply.status_code}: {reply.text[:200]}"
    payload = reply.json()
    if len(payload["choices"]) != job.n:
        return f"{len(payload['choices'])} choices for n={job.n}"
    return "ok"


async def _stream(client: httpx.AsyncClient, gateway: str, body: dict[str, Any], job: Job) -> str:
    async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            return f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
        chunks, done, usage = 0, False, None
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return f"error event: {event['error']}"
            usage = event.get("usage") or usage
            chunks += bool(event.get("choices"))
            if job.leave_after is not None and chunks >= job.leave_after:
                return "left"  # leaving the block hangs up mid-stream
        if not done or usage is None:
            return f"stream ended without [DONE] or usage ({chunks} chunks)"
        return "ok"


async def test_soak(llama_dir: Path, tmp_path: Path) -> None:
    replica_args = (*sim_args("instant"), "--kv-cache-tokens", "16384")
    with running_stack(
        llama_dir, tmp_path, 2, replica_args=replica_args, gateway_args=("--admin-key", ADMIN_KEY)
    ) as stack:
        torch_args = ("--redis", stack.redis.url, "--served-model-name", TORCH_MODEL, *REPLICA_DEFAULTS)
        with ReplicaProcess(llama_dir, tmp_path / "replica-torch.log", *torch_args) as torch_replica:
            replicas: list[Service] = [*stack.replicas, torch_replica]
            gateway = stack.gateway.url
            limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                await wait_until_async(
                    lambda: _listed(client, gateway, len(replicas)),
                    "the gateway to list 3 replicas",
                    timeout=30,
                )
                jobs = _jobs(stack.model, random.Random(20261201))
                outcomes: collections.Counter[str] = collections.Counter()
                failures: list[tuple[Job, str]] = []
                processes = {"gateway": stack.gateway, **{f"replica {r.replica_id}": r for r in replicas}}
                memory: list[tuple[int, dict[str, int]]] = []
                queue: asyncio.Queue[Job] = asyncio.Queue()
                for job in jobs:
                    queue.put_nowait(job)
                done = 0
                started = time.monotonic()

                async def worker() -> None:
                    nonlocal done
                    while not queue.empty():
                        job = queue.get_nowait()
                        result = await _run(client, gateway, job)
                        kind = result if result in ("ok", "left", "cancelled") else "failed"
                        outcomes[f"{'torch' if job.model == TORCH_MODEL else 'sim'} {kind}"] += 1
                        if kind == "failed":
                            failures.append((job, result))
                        done += 1
                        if done % RSS_EVERY == 0:
                            memory.append(
                                (done, {name: rss_kib(p.process.pid) for name, p in processes.items()})
                            )

                async with asyncio.timeout(1200):
                    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
                elapsed = time.monotonic() - started

                async def drained() -> bool:
                    pages = [sample_value(scrape(r.url), "vllm:kv_cache_usage_perc") for r in replicas]
                    engines = [
                        sample_value(text := scrape(r.url), "vllm:num_requests_running")
                        + sample_value(text, "vllm:num_requests_waiting")
                        for r in replicas
                    ]
                    rows = await replica_rows(client, gateway)
                    inflight = [row["load"]["gateway_inflight"] for row in rows.values()]
                    held.update(pages=pages, engines=engines, inflight=inflight)
                    # the heartbeat's pages not free: with none held by a request, the cached ones
                    kv.update(
                        {
                            rid: (row["kv"]["used_pages"], row["kv"]["total_pages"])
                            for rid, row in rows.items()
                        }
                    )
                    return not any(pages) and not any(engines) and not any(inflight)

                held: dict[str, list[float]] = {}
                kv: dict[str, tuple[int, int]] = {}
                await wait_until_async(drained, "every replica and the gateway to hold nothing", timeout=30)

    half = (SIM_REQUESTS + TORCH_REQUESTS) // 2
    second_half = [sample for at, sample in memory if at >= half]
    drift = {
        name: (
            min(s[name] for s in second_half) / second_half[0][name] - 1,
            max(s[name] for s in second_half) / second_half[0][name] - 1,
        )
        for name in processes
    }
    print(
        f"\n[soak] {done} requests in {elapsed:.0f} s ({done / elapsed:.0f}/s):"
        f" {dict(sorted(outcomes.items()))};"
        f" afterwards KV pages held by requests {held['pages']}, engine requests {held['engines']},"
        f" gateway in flight {held['inflight']}; KV pages cached / total (the rest free): {kv}"
    )
    for name, (low, high) in drift.items():
        first, last = second_half[0][name], second_half[-1][name]
        print(
            f"  RSS {name}: {first / 1024:.1f} -> {last / 1024:.1f} MiB over the second half"
            f" ({low:+.1%} .. {high:+.1%}): {' '.join(f'{s[name] / 1024:.1f}' for s in second_half)}"
        )
    assert not failures, failures[:5]
    assert sum(outcomes.values()) == SIM_REQUESTS + TORCH_REQUESTS
    assert outcomes["sim left"] and outcomes["sim cancelled"] and outcomes["torch ok"] >= 0.7 * TORCH_REQUESTS
    # vllm:kv_cache_usage_perc is (pages held by requests + cached pages they use) / total: 0 means
    # free + cached == total and no cached page in use
    assert held["pages"] == [0.0] * len(replicas) and not any(held["engines"]) and not any(held["inflight"])
    for name, (low, high) in drift.items():
        assert low >= -RSS_TOLERANCE and high <= RSS_TOLERANCE, f"{name}: RSS moved {low:+.1%} .. {high:+.1%}"


async def _listed(client: httpx.AsyncClient, gateway: str, count: int) -> bool:
    return (await client.get(f"{gateway}/health")).json()["replicas"] == count
