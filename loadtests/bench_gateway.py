"""Gateway overhead: the same chat sent straight to a replica and through the gateway, same run.

The replica answers instantly: by default the ``sim`` backend with its ``instant`` profile (the real
replica server, tokenizer, scheduler, radix cache and Redis reporter, with a forward pass that
costs nothing), as the gateway issue asks; ``--replica-engine torch`` serves a tiny random llama
test model instead (``replica.tools.tiny_models``, the smallest real engine response). Either serves the
tiny test model's tokenizer and config, with ``max_tokens=1``. Every request is
the *same* 2,000-character chat (a fixed system + user message) on both sides: after the warm-up
its prompt is in the replica's prefix cache for direct and gateway requests alike, so the cache
favours neither side, and the gateway still tokenizes the whole prompt and walks its whole block
chain in the index (every block matches: the longest lookup).

Measured, for non-streaming and streaming (``stream: true``, timed to the last byte) chats:

1. **Added latency** at concurrency 1: direct and gateway requests strictly alternated, so drift
   hits both; p50/p99 of each side, and gateway minus direct (sglang-router gets its own
   alternation with direct requests, never interleaved with the gateway's).
2. **Proxy CPU per request**: utime+stime of the gateway process (``/proc/PID/stat``) around a
   batch of gateway requests, divided by its size (sequential batch, and the concurrent one).
3. **Requests/s at concurrency 32** (32 workers sharing one client: ``gateway.upstream``, the
   cheapest of the clients in 5, since the load generator shares the cores), the sides' phases
   alternated over several rounds; with the CPU share (% of one core) of the side's proxy, the
   replica and this load generator during each phase, since all share the machine's cores and the
   replica (a real engine) or the client may be the bottleneck rather than the gateway.
   ``1e6 / CPU µs per request`` is a proxy's CPU-bound ceiling per process.

If ``sglang_router`` is importable it is measured the same way as a reference (a Rust router in
front of the same replica, its CPU too); otherwise its column says "not installed".

4. **Tokenizing a multi-turn chat**, in this process with the gateway's own tokenizer registry and
   the test model's tokenizer (SmolLM2's template and pre-tokenizer): µs to get the ids of turn 10
   of a ~4,000-token chat from scratch (render + encode, what a replica does), with turn 9 already
   cached (what the gateway does on a chat's next turn: only the new turn is tokenized), and for a
   verbatim repeat.
5. **The upstream HTTP client alone**: CPU µs per request of the client the gateway proxies with
   (``gateway.upstream``: a Protocol per connection around httptools' parser), of aiohttp (the client it
   replaced there) and of httpx (the one before), each POSTing the
   2,000-character chat to an instant HTTP server (canned answer, its own thread and event loop) on uvloop, at
   concurrency 1 and 32, non-streaming and streaming; CPU is this thread's alone.

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
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvloop

from gateway.tokenizer_registry import TokenizerRegistry
from gateway.upstream import UpstreamPool
from kvroute.text.tokenizer import TextTokenizer
from launcher.local_redis import RedisServer, free_port
from loadtests.report import add_size_options, chosen_sizes, cpu_model, package_version, publish, warn_if_busy
from loadtests.report import progress as log_progress

BENCH = "bench_gateway"

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {"sequential": 400, "concurrent": 600, "rounds": 3, "warmup": 50, "tokenize": 200, "client": 3000}
QUICK = {"sequential": 20, "concurrent": 64, "rounds": 1, "warmup": 5, "tokenize": 10, "client": 100}

CONCURRENCY = 32
CHAT_CHARS = 2000
SYSTEM_CHARS = 400
TOKENIZE_TOKENS = 4000  # the multi-turn chat of the tokenization measurement
TOKENIZE_TURNS = 10
MODES = ("non_streaming", "streaming")
SIDES = ("direct", "gateway", "sglang_router")
CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT = 60.0

REPLICA_ENGINES = {
    "sim": "the sim backend, `instant` profile (a simulation: the real replica server, tokenizer, "
    "scheduler and radix cache, a forward pass that costs nothing), tiny test model's tokenizer",
    "torch": "tiny random llama test model on the torch engine, float32 (the smallest real engine response)",
}

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
    tokenize: int  # turn-10 variants timed per tokenization mode
    client: int  # requests per upstream client, concurrency and mode
    out: str
    replica_engine: str  # a key of REPLICA_ENGINES


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
        sys.executable, "-m", "launcher.cli", subcommand,
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


def start_services(
    model_dir: Path, engine: str, redis_url: str, workdir: Path, services: dict[str, Service]
) -> None:
    """Fills ``services`` as it goes, so the caller's ``finally`` kills whatever did start."""
    port = free_port()
    backend = ["--engine", "sim", "--profile", "instant"] if engine == "sim" else ["--dtype", "float32"]
    services["direct"] = Service(
        "replica",
        kvroute_command(
            "replica",
            port,
            "--model",
            str(model_dir),
            *backend,
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
CHAT_PATH = "/v1/chat/completions"


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


# -- measurement ---------------------------------------------------------------------------------


def measure_mode(s: Settings, services: dict[str, Service], model: str, stream: bool) -> dict[str, Any]:
    body = chat_body(model, stream)
    sides = [name for name in SIDES if name in services]
    urls = {name: services[name].url for name in sides}
    proxies = sides[1:]  # the gateway, and sglang-router when installed
    mode = "streaming" if stream else "non-streaming"

    # 1. concurrency 1, each proxy alternated with direct requests
    progress(f"{mode}: {s.sequential} sequential requests per proxy and as many direct, alternated")
    latencies, cpu_sequential = uvloop.run(run_sequential(s, services, urls, body))
    latencies["direct"] = latencies["direct:gateway"]  # the direct column: those paired with the gateway

    # 2. concurrency 32, one phase per side per round, sides alternated across rounds.
    progress(f"{mode}: {s.rounds} round(s) of {s.concurrent} requests per side at concurrency {CONCURRENCY}")
    walls: dict[str, float] = dict.fromkeys(sides, 0.0)
    cpu: dict[str, dict[str, float]] = {name: {"proxy": 0.0, "replica": 0.0, "client": 0.0} for name in sides}

    def cpu_now(name: str) -> tuple[float, float, float]:
        proxy = services[name].cpu_seconds() if name in proxies else 0.0
        return proxy, services["direct"].cpu_seconds(), self_cpu_seconds()

    for r in range(s.rounds):
        for name in sides if r % 2 == 0 else sides[::-1]:
            before = cpu_now(name)
            walls[name] += uvloop.run(run_concurrent(urls[name], body, s.concurrent))
            for key, b, a in zip(("proxy", "replica", "client"), before, cpu_now(name), strict=True):
                cpu[name][key] += a - b
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


def multi_turn_chat(tokenizer: TextTokenizer, tokens: int, turns: int) -> list[dict[str, str]]:
    """A chat of ``turns`` user turns (assistant answers between them) of about ``tokens`` tokens."""
    chars = 40
    while True:
        messages = [{"role": "system", "content": filler(chars, 0)}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"{filler(chars, 2 * turn + 1)} ({turn * 1234})?"})
            messages.append({"role": "assistant", "content": filler(chars, 2 * turn + 2)})
        messages.pop()
        if len(tokenizer.encode_chat(messages)) >= tokens:
            return messages
        chars = chars * 5 // 4


def measure_tokenization(model_dir: Path, repeats: int) -> dict[str, Any]:
    """µs per request to get the ids of turn 10 of a ~4,000-token chat three ways (module docstring).

    Each timed request asks for another last user message, so none is a verbatim repeat of a
    cached one but in the third mode."""
    tokenizer = TextTokenizer.from_dir(model_dir)
    messages = multi_turn_chat(tokenizer, TOKENIZE_TOKENS, TOKENIZE_TURNS)
    last = messages[-1]["content"]
    variants = [[*messages[:-1], {"role": "user", "content": f"{last} #{i}"}] for i in range(repeats)]

    async def registry_us(warm: list[dict[str, str]], timed: list[list[dict[str, str]]]) -> float:
        async with httpx.AsyncClient() as http:
            registry = TokenizerRegistry(http)
            await registry.encode_chat(tokenizer, warm, None, {})
            start = time.perf_counter()
            for chat in timed:
                await registry.encode_chat(tokenizer, chat, None, {})
            return 1e6 * (time.perf_counter() - start) / len(timed)

    start = time.perf_counter()
    for chat in variants:
        tokenizer.encode_chat(chat)
    scratch = 1e6 * (time.perf_counter() - start) / repeats
    return {
        "prompt_tokens": len(tokenizer.encode_chat(variants[0])),
        "turns": TOKENIZE_TURNS,
        "from_scratch_us": scratch,
        "previous_turn_cached_us": asyncio.run(registry_us(messages[:-2], variants)),
        "verbatim_repeat_us": asyncio.run(registry_us(variants[0], [variants[0]] * repeats)),
    }


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        r = results[mode]
        for name, value, limit, at_least in (
            ("added_p50_ms", r["added_ms"]["gateway"]["p50"], ADDED_P50_MS_TARGET, False),
            ("cpu_us_per_request", r["cpu_us_per_request"]["gateway"]["concurrent"], CPU_US_TARGET, False),
            ("req_s", r["req_s"]["gateway"], REQ_S_TARGET, True),
        ):
            passed = value >= limit if at_least else value <= limit
            out.append({"check": f"{mode}.{name}", "value": value, "limit": limit, "passed": passed})
    return out


# -- report --------------------------------------------------------------------------------------


_INSTANT_JSON = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}],"usage":{}}'
_INSTANT_ANSWERS = {
    False: b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_INSTANT_JSON), _INSTANT_JSON),
    True: b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b"data: {}\n\n",) * 3 + (b"data: [DONE]\n\n",))
    + b"0\r\n\r\n",
}


class InstantServer:
    """A loopback HTTP server answering every POST at once with a canned answer (streamed when the
    body says ``"stream": true``), on its own thread and event loop."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                writer.write(_INSTANT_ANSWERS[b'"stream": true' in body])
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


async def client_cpu_us(kind: str, url: str, body: bytes, concurrency: int, requests: int) -> float:
    """This thread's CPU µs per request for ``requests`` POSTs by ``concurrency`` workers."""
    if kind == "httpx":
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        client = httpx.AsyncClient(limits=limits)

        async def one() -> None:
            request = client.build_request("POST", url, content=body, headers=HEADERS)
            response = await client.send(request, stream=True)
            await response.aread()
            await response.aclose()

    elif kind == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))

        async def one() -> None:
            async with session.post(url, data=body, headers=HEADERS) as response:
                await response.read()

    else:
        pool = UpstreamPool()

        async def one() -> None:
            response = await pool.post(url, CHAT_PATH, body, b"application/json")
            await response.read()

    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one()

    await asyncio.gather(*(one() for _ in range(concurrency)))  # connections open
    start = time.thread_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    used = time.thread_time() - start
    await (client.aclose() if kind == "httpx" else session.close() if kind == "aiohttp" else pool.aclose())
    return 1e6 * used / requests


def measure_upstream_clients(requests: int) -> dict[str, dict[str, float]]:
    server = InstantServer()
    url = f"http://127.0.0.1:{server.port}"
    out: dict[str, dict[str, float]] = {}
    try:
        for kind in ("httpx", "aiohttp", "gateway.upstream"):
            for mode in MODES:
                body = chat_body("m", stream=mode == "streaming")
                for concurrency in (1, CONCURRENCY):
                    target = url if kind == "gateway.upstream" else url + CHAT_PATH
                    cpu = uvloop.run(client_cpu_us(kind, target, body, concurrency, requests))
                    out.setdefault(kind, {})[f"{mode}.c{concurrency}"] = cpu
    finally:
        server.stop()
    return out


def clients_table(clients: dict[str, dict[str, float]]) -> str:
    columns = [f"{mode}.c{c}" for mode in MODES for c in (1, CONCURRENCY)]
    lines = [
        "| upstream client, CPU µs per request | "
        + " | ".join(f"{m.replace('_', '-')}, concurrency {c}" for m in MODES for c in (1, CONCURRENCY))
        + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for kind, row in clients.items():
        lines.append(f"| {kind} | " + " | ".join(f"{row[column]:,.0f}" for column in columns) + " |")
    return "\n".join(lines)


def tokenization_table(t: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"| tokenizing turn {t['turns']} of a {t['turns']}-turn chat, {t['prompt_tokens']:,} tokens "
            "| µs per request |",
            "|---|---|",
            f"| from scratch (render + encode, no cache) | {t['from_scratch_us']:,.0f} |",
            f"| gateway, turn {t['turns'] - 1} cached (only the new turn encoded) "
            f"| {t['previous_turn_cached_us']:,.0f} |",
            f"| gateway, verbatim repeat | {t['verbatim_repeat_us']:,.0f} |",
        ]
    )


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
        for phase, label in (("concurrent", f"concurrency {CONCURRENCY}"), ("sequential", "concurrency 1")):
            row(
                f"proxy CPU per request, {label} (µs)",
                mode,
                {"direct": None}
                | {
                    side: (lambda r, side=side, phase=phase: r["cpu_us_per_request"][side][phase])
                    for side in SIDES[1:]
                },
                ".0f",
                f"≤ {CPU_US_TARGET:.0f} µs" if phase == "concurrent" else "",
                "cpu_us_per_request" if phase == "concurrent" else "",
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
            "proxy CPU-bound ceiling, 1e6 / CPU µs (req/s)",
            mode,
            {"direct": None}
            | {side: (lambda r, side=side: r["cpu_bound_req_s"][side]) for side in SIDES[1:]},
            ",.0f",
        )
        for who in ("proxy", "replica", "client"):
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
        "uvloop": package_version("uvloop"),
        "httptools": package_version("httptools"),
        "sglang_router": package_version("sglang-router"),
        "load_average_at_start": load,
    }


def preamble(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    return "\n".join(
        [
            f"Machine: {m['cpu']}, {m['cores']} cores, shared by the load generator, the gateway, the "
            f"replica and redis-server; Python {m['python']}, httpx {m['httpx']}, uvicorn {m['uvicorn']} "
            f"(uvloop {m['uvloop']}, httptools {m['httptools']}); "
            f"sglang-router {m['sglang_router']}.",
            f"Replica: {REPLICA_ENGINES[s['replica_engine']]}, `max_tokens=1`. "
            f"Request: the same {CHAT_CHARS:,}-character chat (system + user) every "
            "time on every side, so after the warm-up its prefix is cached for direct and gateway "
            "requests alike.",
            f"Concurrency 1: {s['sequential']} requests per proxy, alternated request by request with "
            f"as many direct ones (each proxy paired with direct only) after {s['warmup']} warm-up "
            f"pairs. Concurrency {CONCURRENCY}: "
            f"{s['rounds']} round(s) of {s['concurrent']} requests per side, sides alternated; the "
            "load generator is the gateway's own upstream client (concurrency 1 too). "
            "Streaming is timed to the last byte. "
            "CPU from /proc/PID/stat utime+stime. A replica or client CPU share near 100% means "
            "they, not the gateway, capped requests/s; the CPU-bound ceiling is what one proxy "
            "process could carry.",
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
    parser.add_argument(
        "--replica-engine",
        choices=sorted(REPLICA_ENGINES),
        default="sim",
        help="sim: the instant simulated replica (default); torch: the tiny test model on the real engine",
    )
    return parser.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> Settings:
    sizes = chosen_sizes(args, FULL, QUICK)
    if min(sizes.values()) < 1:
        raise SystemExit("every size must be positive")
    return Settings(out=args.out, replica_engine=args.replica_engine, **sizes)


def main(argv: list[str] | None = None) -> int:
    from replica.tools.tiny_models import make_test_model

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
            start_services(model_dir, s.replica_engine, redis.url, workdir, services)
            results = {
                mode: measure_mode(s, services, model_dir.name, stream=mode == "streaming") for mode in MODES
            }
        finally:
            for service in reversed(services.values()):
                service.kill()
            redis.stop()
        progress(f"tokenizing a {TOKENIZE_TURNS}-turn chat, {s.tokenize} requests per mode")
        tokenization = measure_tokenization(model_dir, s.tokenize)
    progress(f"upstream clients against an instant server, {s.client} requests per case")
    clients = measure_upstream_clients(s.client)
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "loadtests.bench_gateway", *argv]),
        "machine": machine_info(load),
        "settings": asdict(s) | {"concurrency": CONCURRENCY, "chat_chars": CHAT_CHARS},
        "sglang_router": "sglang_router" in services,
        "results": results,
        "tokenization": tokenization,
        "upstream_clients": clients,
        "checks": checks(results),
    }
    outcome = {c["check"]: c["passed"] for c in report["checks"]}
    tables = [
        markdown_table(results, outcome, report["sglang_router"]),
        tokenization_table(tokenization),
        clients_table(clients),
    ]
    report["table"] = preamble(report) + "\n\n" + "\n\n".join(tables)
    publish("bench_gateway", report, s.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
