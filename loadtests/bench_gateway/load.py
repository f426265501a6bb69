"""The gateway benchmark's load generator (1 to 3 of :mod:`loadtests.bench_gateway`): direct and
proxied requests alternated at concurrency 1, phases of concurrency 32, the CPU of every process."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

import uvloop

from gateway.proxy.upstream import UpstreamPool
from loadtests.bench_gateway.settings import CHAT_PATH, CONCURRENCY, SIDES, Settings, chat_body, progress
from loadtests.services import Service


async def send_async(client: UpstreamPool, url: str, body: bytes) -> float:
    """Seconds until the last byte of the response."""
    start = time.perf_counter()
    response = await client.post(url, CHAT_PATH, body, b"application/json")
    content = await response.read()
    elapsed = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"{url} answered {response.status}: {content[:300]!r}")
    return elapsed


async def run_sequential(
    s: Settings, services: dict[str, Service], urls: dict[str, str], body: bytes
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Concurrency 1: for each proxy in turn, direct and proxy requests strictly alternated. Returns
    the latencies (the proxy's under its name, the direct ones alternated with it under
    ``direct:<name>``) and each proxy's CPU seconds over its own loop.

    A proxy is paired with direct requests only, not with the other proxy: sglang-router holds a
    stream ~40 ms, and requests sent right after such a pause find caches and cores gone cold.
    """
    latencies: dict[str, list[float]] = {}
    cpu: dict[str, float] = {}
    client = UpstreamPool(read_timeout=60)
    for proxy in (name for name in urls if name != "direct"):
        pair = ("direct", proxy)
        for _ in range(s.warmup):
            for name in pair:
                await send_async(client, urls[name], body)
        samples: dict[str, list[float]] = {"direct": [], proxy: []}
        before = services[proxy].cpu_seconds()
        for i in range(s.sequential):
            for name in pair if i % 2 == 0 else pair[::-1]:
                samples[name].append(await send_async(client, urls[name], body))
        cpu[proxy] = services[proxy].cpu_seconds() - before
        latencies[f"direct:{proxy}"], latencies[proxy] = samples["direct"], samples[proxy]
    await client.aclose()
    return latencies, cpu


async def run_concurrent(url: str, body: bytes, count: int) -> float:
    """Wall seconds for ``count`` requests from CONCURRENCY workers sharing one client: the
    gateway's own upstream client, the cheapest here (14 µs of CPU a request against aiohttp's
    55, httpx's ~2 ms; table 5), since the load generator shares the cores with what it measures."""
    client = UpstreamPool(read_timeout=60)
    await asyncio.gather(*(send_async(client, url, body) for _ in range(CONCURRENCY)))  # connect
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await send_async(client, url, body)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    elapsed = time.perf_counter() - start
    await client.aclose()
    return elapsed


def quantiles_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "p50": 1000 * statistics.median(ordered),
        "p99": 1000 * p99,
        "mean": 1000 * statistics.fmean(ordered),
    }


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


CpuSeconds = dict[str, dict[str, float]]  # side -> "proxy", "replica", "client" -> CPU seconds


def measure_mode(s: Settings, services: dict[str, Service], model: str, stream: bool) -> dict[str, Any]:
    """1 to 3 of :mod:`loadtests.bench_gateway` for one mode (streaming or not)."""
    body = chat_body(model, stream)
    sides = [name for name in SIDES if name in services]
    urls = {name: services[name].url for name in sides}
    mode = "streaming" if stream else "non-streaming"

    # 1. concurrency 1, each proxy alternated with direct requests
    progress(f"{mode}: {s.sequential} sequential requests per proxy and as many direct, alternated")
    latencies, cpu_sequential = uvloop.run(run_sequential(s, services, urls, body))
    latencies["direct"] = latencies["direct:gateway"]  # the direct column: those paired with the gateway

    # 2. concurrency 32, one phase per side per round, sides alternated across rounds.
    progress(f"{mode}: {s.rounds} round(s) of {s.concurrent} requests per side at concurrency {CONCURRENCY}")
    walls, cpu = run_rounds(s, services, sides, body)
    return summary(s, sides, latencies, cpu_sequential, walls, cpu)


def run_rounds(
    s: Settings, services: dict[str, Service], sides: list[str], body: bytes
) -> tuple[dict[str, float], CpuSeconds]:
    """Each side's wall seconds over its concurrent phases, and the CPU its processes and this one
    spent meanwhile (the replica serves every side; a side without a proxy of its own spends none)."""
    walls: dict[str, float] = dict.fromkeys(sides, 0.0)
    cpu: CpuSeconds = {name: {"proxy": 0.0, "replica": 0.0, "client": 0.0} for name in sides}

    def cpu_now(name: str) -> tuple[float, float, float]:
        proxy = services[name].cpu_seconds() if name != "direct" else 0.0
        return proxy, services["direct"].cpu_seconds(), self_cpu_seconds()

    for r in range(s.rounds):
        for name in sides if r % 2 == 0 else sides[::-1]:
            before = cpu_now(name)
            walls[name] += uvloop.run(run_concurrent(services[name].url, body, s.concurrent))
            for key, b, a in zip(("proxy", "replica", "client"), before, cpu_now(name), strict=True):
                cpu[name][key] += a - b
    return walls, cpu


def summary(
    s: Settings,
    sides: list[str],
    latencies: dict[str, list[float]],
    cpu_sequential: dict[str, float],
    walls: dict[str, float],
    cpu: CpuSeconds,
) -> dict[str, Any]:
    """One mode's results: quantiles, the proxies' added latency, rates, CPU shares and costs."""
    proxies = sides[1:]  # the gateway, and sglang-router when installed
    total = s.rounds * s.concurrent
    result: dict[str, Any] = {
        "latency_ms": {name: quantiles_ms(latencies[name]) for name in sides},
        "req_s": {name: total / walls[name] for name in sides},
        "cpu_share_pct": {
            name: {key: 100 * seconds / walls[name] for key, seconds in cpu[name].items()} for name in sides
        },
    }
    for name in proxies:
        paired = quantiles_ms(latencies[f"direct:{name}"])
        added = {q: result["latency_ms"][name][q] - paired[q] for q in ("p50", "p99")}
        result.setdefault("added_ms", {})[name] = added
    result["cpu_us_per_request"] = {
        name: {
            "sequential": 1e6 * cpu_sequential[name] / s.sequential,
            "concurrent": 1e6 * cpu[name]["proxy"] / total,
        }
        for name in proxies
    }
    result["cpu_bound_req_s"] = {
        name: 1e6 / max(result["cpu_us_per_request"][name]["concurrent"], 1e-9) for name in proxies
    }
    return result
