"""Gateway overhead: the same chat sent straight to a replica and through the gateway, same run.

The replica serves a tiny random llama test model (``replica.test_models``) with ``max_tokens=1``:
the fastest real engine response, i.e. the smallest possible engine response. Every request is
the *same* 2,000-character chat (a fixed system + user message) on both sides: after the warm-up
its prompt is in the replica's prefix cache for direct and gateway requests alike, so the cache
favours neither side, and the gateway still tokenizes the whole prompt and walks its whole block
chain in the index (every block matches: the longest lookup).

Measured, for non-streaming and streaming (``stream: true``, timed to the last byte) chats:

1. **Added latency** at concurrency 1: direct and gateway requests strictly alternated, so drift
   hits both; p50/p99 of each side, and gateway minus direct.
2. **Gateway CPU per request**: utime+stime of the gateway process (``/proc/PID/stat``) around a
   batch of gateway requests, divided by its size (sequential batch, and the concurrent one).
3. **Requests/s at concurrency 32** (one ``httpx.AsyncClient``, 32 workers), direct and gateway
   phases alternated over several rounds; with the CPU share (% of one core) of the gateway, the
   replica and this load generator during the gateway phases, since all share the machine's cores
   and the replica (a real engine) or the client may be the bottleneck rather than the gateway.
   ``1e6 / CPU µs per request`` is the gateway's CPU-bound ceiling per process.

If ``sglang_router`` is importable it is measured the same way as a reference (a Rust router in
front of the same replica); otherwise its column says "not installed".

Full run (a couple of minutes; run it on a quiet machine)::

    python -m loadtests.bench_gateway

``--quick`` shrinks every size for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from kvroute.local_redis import RedisServer, free_port
from loadtests.report import add_size_options, chosen_sizes, cpu_model, package_version, publish, warn_if_busy
from loadtests.report import progress as log_progress

BENCH = "bench_gateway"

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {"sequential": 400, "concurrent": 600, "rounds": 3, "warmup": 50}
QUICK = {"sequential": 20, "concurrent": 64, "rounds": 1, "warmup": 5}

CONCURRENCY = 32
CHAT_CHARS = 2000
SYSTEM_CHARS = 400
MODES = ("non_streaming", "streaming")
SIDES = ("direct", "gateway", "sglang_router")
CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT = 60.0

# Targets.
ADDED_P50_MS_TARGET = 0.5
CPU_US_TARGET = 300.0
REQ_S_TARGET = 2500.0

WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "judges",
    "watch",
)


@dataclass
class Settings:
    sequential: int  # requests per side per mode at concurrency 1
    concurrent: int  # requests per side per mode per round at concurrency 32
    rounds: int
    warmup: int
    out: str


def progress(message: str) -> None:
    log_progress(BENCH, message)


def filler(chars: int, seed: int) -> str:
    words, n = [], seed
    while sum(len(w) + 1 for w in words) < chars:
        words.append(WORDS[n % len(WORDS)])
        n = n * 7 + 3
    return " ".join(words)[:chars]


def chat_body(model: str, stream: bool) -> bytes:
    system = filler(SYSTEM_CHARS, 1)
    user = filler(CHAT_CHARS - SYSTEM_CHARS, 2)
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


# -- processes -----------------------------------------------------------------------------------


class Service:
    """A subprocess listening on a loopback port; ``ready`` decides when its /health is good."""

    def __init__(self, name: str, command: list[str], port: int, log: Path) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait(self, ready: Callable[[str], bool], timeout: float = START_TIMEOUT) -> None:
        """Polls until ``ready(self.url)``; any HTTP error counts as not ready yet."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if ready(self.url):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def cpu_seconds(self) -> float:
        """utime + stime of the process, from /proc/PID/stat (fields 14 and 15)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; fields[0] is field 3
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def kvroute_command(subcommand: str, port: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "kvroute.cli", subcommand,
        "--host", "127.0.0.1", "--port", str(port), *args, "--log-level", "warning",
    ]  # fmt: skip


def health_ok(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=1).status_code == 200


def gateway_sees_replica(url: str) -> bool:
    """Its /health counts at least one replica; should /health itself fail, a model in /v1/models."""
    response = httpx.get(f"{url}/health", timeout=1)
    if response.status_code == 200:
        return response.json()["replicas"] >= 1
    return bool(httpx.get(f"{url}/v1/models", timeout=1).json()["data"])


def start_services(model_dir: Path, redis_url: str, workdir: Path, services: dict[str, Service]) -> None:
    """Fills ``services`` as it goes, so the caller's ``finally`` kills whatever did start."""
    port = free_port()
    services["direct"] = Service(
        "replica",
        kvroute_command(
            "replica",
            port,
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--kv-cache-tokens",
            "65536",
            "--redis",
            redis_url,
        ),
        port,
        workdir / "replica.log",
    )
    services["direct"].wait(health_ok)
    port = free_port()
    services["gateway"] = Service(
        "gateway", kvroute_command("gateway", port, "--redis", redis_url), port, workdir / "gateway.log"
    )
    services["gateway"].wait(gateway_sees_replica)
    if importlib.util.find_spec("sglang_router") is not None:
        port, metrics_port = free_port(), free_port()
        command = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", services["direct"].url, "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--tokenizer-path", str(model_dir),
        ]  # fmt: skip
        services["sglang_router"] = Service("sglang_router", command, port, workdir / "sglang_router.log")
        services["sglang_router"].wait(health_ok)


# -- requests ------------------------------------------------------------------------------------

HEADERS = {"content-type": "application/json"}


def send_sync(client: httpx.Client, url: str, body: bytes, stream: bool) -> float:
    """Seconds until the last byte of the response."""
    start = time.perf_counter()
    with client.stream("POST", url, content=body, headers=HEADERS) as response:
        for _ in response.iter_raw():
            pass
        elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.read()[:300]!r}")
    return elapsed


async def send_async(client: httpx.AsyncClient, url: str, body: bytes) -> None:
    async with client.stream("POST", url, content=body, headers=HEADERS) as response:
        async for _ in response.aiter_raw():
            pass
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}")


async def run_concurrent(url: str, body: bytes, count: int) -> float:
    """Wall seconds for ``count`` requests from CONCURRENCY workers sharing one client."""
    limits = httpx.Limits(max_connections=4 * CONCURRENCY, max_keepalive_connections=4 * CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        await asyncio.gather(*(send_async(client, url, body) for _ in range(CONCURRENCY)))  # connect
        remaining = count

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await send_async(client, url, body)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return time.perf_counter() - start


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


# -- measurement ---------------------------------------------------------------------------------


def measure_mode(s: Settings, services: dict[str, Service], model: str, stream: bool) -> dict[str, Any]:
    body = chat_body(model, stream)
    sides = [name for name in SIDES if name in services]
    urls = {name: f"{services[name].url}/v1/chat/completions" for name in sides}
    gateway = services["gateway"]
    mode = "streaming" if stream else "non-streaming"

    # 1. concurrency 1, sides strictly alternated; the gateway's CPU is read around the whole loop
    # (direct requests leave it idle but for its background tasks, counted against it).
    progress(f"{mode}: {s.sequential} sequential requests per side, alternated")
    latencies: dict[str, list[float]] = {name: [] for name in sides}
    with httpx.Client(timeout=60) as client:
        for _ in range(s.warmup):
            for name in sides:
                send_sync(client, urls[name], body, stream)
        cpu_before = gateway.cpu_seconds()
        for i in range(s.sequential):
            order = sides if i % 2 == 0 else sides[::-1]
            for name in order:
                latencies[name].append(send_sync(client, urls[name], body, stream))
        gateway_cpu_sequential = gateway.cpu_seconds() - cpu_before

    # 2. concurrency 32, one phase per side per round, sides alternated across rounds.
    progress(f"{mode}: {s.rounds} round(s) of {s.concurrent} requests per side at concurrency {CONCURRENCY}")
    walls: dict[str, float] = dict.fromkeys(sides, 0.0)
    cpu: dict[str, dict[str, float]] = {
        name: {"gateway": 0.0, "replica": 0.0, "client": 0.0} for name in sides
    }
    for r in range(s.rounds):
        for name in sides if r % 2 == 0 else sides[::-1]:
            before = (gateway.cpu_seconds(), services["direct"].cpu_seconds(), self_cpu_seconds())
            walls[name] += asyncio.run(run_concurrent(urls[name], body, s.concurrent))
            after = (gateway.cpu_seconds(), services["direct"].cpu_seconds(), self_cpu_seconds())
            for key, b, a in zip(("gateway", "replica", "client"), before, after, strict=True):
                cpu[name][key] += a - b
    total = s.rounds * s.concurrent

    result: dict[str, Any] = {
        "latency_ms": {name: quantiles_ms(latencies[name]) for name in sides},
        "req_s": {name: total / walls[name] for name in sides},
        "cpu_share_pct": {
            name: {key: 100 * seconds / walls[name] for key, seconds in cpu[name].items()} for name in sides
        },
    }
    for name in sides[1:]:
        added = {q: result["latency_ms"][name][q] - result["latency_ms"]["direct"][q] for q in ("p50", "p99")}
        result.setdefault("added_ms", {})[name] = added
    result["gateway_cpu_us_per_request"] = {
        "sequential": 1e6 * gateway_cpu_sequential / s.sequential,
        "concurrent": 1e6 * cpu["gateway"]["gateway"] / total,
    }
    result["gateway_cpu_bound_req_s"] = 1e6 / max(result["gateway_cpu_us_per_request"]["concurrent"], 1e-9)
    return result


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        r = results[mode]
        for name, value, limit, at_least in (
            ("added_p50_ms", r["added_ms"]["gateway"]["p50"], ADDED_P50_MS_TARGET, False),
            ("cpu_us_per_request", r["gateway_cpu_us_per_request"]["concurrent"], CPU_US_TARGET, False),
            ("req_s", r["req_s"]["gateway"], REQ_S_TARGET, True),
        ):
            passed = value >= limit if at_least else value <= limit
            out.append({"check": f"{mode}.{name}", "value": value, "limit": limit, "passed": passed})
    return out


# -- report --------------------------------------------------------------------------------------


def markdown_table(results: dict[str, Any], outcome: dict[str, bool], router: bool) -> str:
    def cell(mode: str, getter: Callable[[dict[str, Any]], float], spec: str, side: str) -> str:
        if side == "sglang_router" and not router:
            return "not installed"
        return format(getter(results[mode]), spec)

    lines = [
        "| metric | mode | direct | gateway | sglang-router | target | pass |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(label: str, mode: str, getters: dict[str, Callable[[dict[str, Any]], float] | None], spec: str,
            target: str = "", check: str = "") -> None:  # fmt: skip
        cells = [cell(mode, g, spec, side) if g else "" for side, g in getters.items()]
        passed = ("pass" if outcome[f"{mode}.{check}"] else "FAIL") if check else ""
        lines.append(f"| {label} | {mode.replace('_', '-')} | {' | '.join(cells)} | {target} | {passed} |")

    for mode in MODES:
        for q in ("p50", "p99"):
            row(
                f"latency {q}, concurrency 1 (ms)",
                mode,
                {side: (lambda r, side=side, q=q: r["latency_ms"][side][q]) for side in SIDES},
                ".3f",
            )
        for q in ("p50", "p99"):
            target = f"≤ {ADDED_P50_MS_TARGET} ms" if q == "p50" else ""
            row(
                f"added latency {q} vs direct (ms)",
                mode,
                {"direct": None}
                | {side: (lambda r, side=side, q=q: r["added_ms"][side][q]) for side in SIDES[1:]},
                ".3f",
                target,
                "added_p50_ms" if q == "p50" else "",
            )
        row(
            f"gateway CPU per request, concurrency {CONCURRENCY} (µs)",
            mode,
            {
                "direct": None,
                "gateway": lambda r: r["gateway_cpu_us_per_request"]["concurrent"],
                "sglang_router": None,
            },
            ".0f",
            f"≤ {CPU_US_TARGET:.0f} µs",
            "cpu_us_per_request",
        )
        row(
            "gateway CPU per request, concurrency 1 (µs)",
            mode,
            {
                "direct": None,
                "gateway": lambda r: r["gateway_cpu_us_per_request"]["sequential"],
                "sglang_router": None,
            },
            ".0f",
        )
        row(
            f"requests/s, concurrency {CONCURRENCY}, one process",
            mode,
            {side: (lambda r, side=side: r["req_s"][side]) for side in SIDES},
            ",.0f",
            f"≥ {REQ_S_TARGET:,.0f}",
            "req_s",
        )
        row(
            "gateway CPU-bound ceiling, 1e6 / CPU µs (req/s)",
            mode,
            {"direct": None, "gateway": lambda r: r["gateway_cpu_bound_req_s"], "sglang_router": None},
            ",.0f",
        )
        for who in ("gateway", "replica", "client"):
            row(
                f"{who} CPU share during the concurrency-{CONCURRENCY} phase (% of one core)",
                mode,
                {side: (lambda r, side=side, who=who: r["cpu_share_pct"][side][who]) for side in SIDES},
                ".0f",
            )
    return "\n".join(lines)


def machine_info(load: float) -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "httpx": package_version("httpx"),
        "uvicorn": package_version("uvicorn"),
        "sglang_router": package_version("sglang-router"),
        "load_average_at_start": load,
    }


def preamble(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    return "\n".join(
        [
            f"Machine: {m['cpu']}, {m['cores']} cores, shared by the load generator, the gateway, the "
            f"replica and redis-server; Python {m['python']}, httpx {m['httpx']}, uvicorn {m['uvicorn']}; "
            f"sglang-router {m['sglang_router']}.",
            "Replica: tiny random llama test model, float32, `max_tokens=1`: the smallest possible "
            f"engine response. Request: the same {CHAT_CHARS:,}-character chat (system + user) every "
            "time on every side, so after the warm-up its prefix is cached for direct and gateway "
            "requests alike.",
            f"Concurrency 1: {s['sequential']} requests per side per mode, sides alternated "
            f"request by request after {s['warmup']} warm-up requests each. Concurrency {CONCURRENCY}: "
            f"{s['rounds']} round(s) of {s['concurrent']} requests per side, sides alternated; one "
            "httpx.AsyncClient. Streaming is timed to the last byte. CPU from /proc/PID/stat "
            "utime+stime. A replica or client CPU share near 100% means they, not the gateway, "
            "capped requests/s; the CPU-bound ceiling is what one gateway process could carry.",
            f"Command: `{report['command']}`",
        ]
    )


# -- entry point ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_gateway",
        description="Gateway overhead, direct vs through the gateway (needs redis-server).",
    )
    add_size_options(parser, FULL, QUICK, "results/bench_gateway.json")
    return parser.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> Settings:
    sizes = chosen_sizes(args, FULL, QUICK)
    if min(sizes.values()) < 1:
        raise SystemExit("every size must be positive")
    return Settings(out=args.out, **sizes)


def main(argv: list[str] | None = None) -> int:
    from replica.test_models import make_test_model

    argv = sys.argv[1:] if argv is None else argv
    s = resolve_settings(parse_args(argv))
    load = warn_if_busy(BENCH)
    services: dict[str, Service] = {}
    with tempfile.TemporaryDirectory(prefix="bench_gateway.") as tmp:
        workdir = Path(tmp)
        model_dir = make_test_model("llama", workdir / "bench-llama")
        redis = RedisServer(workdir)
        try:
            redis.start()
            progress("starting the replica and the gateway")
            start_services(model_dir, redis.url, workdir, services)
            results = {
                mode: measure_mode(s, services, model_dir.name, stream=mode == "streaming") for mode in MODES
            }
        finally:
            for service in reversed(services.values()):
                service.kill()
            redis.stop()
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "loadtests.bench_gateway", *argv]),
        "machine": machine_info(load),
        "settings": asdict(s) | {"concurrency": CONCURRENCY, "chat_chars": CHAT_CHARS},
        "sglang_router": "sglang_router" in services,
        "results": results,
        "checks": checks(results),
    }
    outcome = {c["check"]: c["passed"] for c in report["checks"]}
    report["table"] = preamble(report) + "\n\n" + markdown_table(results, outcome, report["sglang_router"])
    publish("bench_gateway", report, s.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
