"""What the fault and soak tests share: streamed chats read event by event, the admin API, a
latency probe, a replica restarted on its own port, slow simulated replicas, and fake replicas
that answer discovery like a real one and then misbehave.

Everything here times with ``time.monotonic()``, so figures from different helpers compare.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

from launcher.children import spawn
from tests.helpers.processes import Service
from tests.helpers.waiting import wait_until

ADMIN_KEY = "faults-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


# --- simulated replicas ----------------------------------------------------------------------------


def sim_profile(path: Path, *, decode_s: float = 0.02, prefill_token_s: float = 2e-5) -> Path:
    """A sim cost profile whose decode steps take ``decode_s``: streams long enough to be caught
    mid-way, at almost no CPU (a step is a sleep)."""
    profile = {
        "name": path.stem,
        "prefill_base_s": 0.002,
        "prefill_token_s": prefill_token_s,
        "prefill_pair_s": 0.0,
        "prefill_seq_s": 0.0,
        "decode_base_s": decode_s,
        "decode_seq_s": 0.0002,
        "decode_context_s": 0.0,
    }
    path.write_text(json.dumps(profile))
    return path


def sim_args(profile: str | Path) -> tuple[str, ...]:
    return ("--engine", "sim", "--profile", str(profile))


def wide_model(model_dir: Path, dest: Path, window: int) -> Path:
    """A copy of ``model_dir``'s tokenizer and config (no weights: for sim replicas) whose context
    window is ``window`` tokens."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, dest / path.name)
    config = json.loads((dest / "config.json").read_text())
    config["max_position_embeddings"] = window
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def respawn(service: Service, log_path: Path) -> Service:
    """Runs ``service``'s command line again (same port, so a replica keeps its id) once the old
    process is gone, and waits until the new one answers /health."""
    assert service.process.poll() is not None, "the old process still runs"
    with log_path.open("wb") as log:
        process = spawn(list(service.process.args), stdout=log, stderr=subprocess.STDOUT)  # type: ignore[arg-type]
    fresh = Service(process, service.port, log_path)

    def healthy() -> bool:
        assert process.poll() is None, f"the restarted process exited:\n{fresh.log()}"
        try:
            return httpx.get(f"{fresh.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, "the restarted process to answer /health", timeout=60, interval=0.05)
    except BaseException:
        fresh.kill()
        raise
    return fresh


def rss_kib(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


# --- the gateway's admin API -------------------------------------------------------------------------


async def replica_rows(client: httpx.AsyncClient, gateway_url: str) -> dict[str, dict[str, Any]]:
    """``GET /admin/replicas``'s rows by replica id."""
    reply = await client.get(f"{gateway_url}/admin/replicas", headers=ADMIN, timeout=5)
    assert reply.status_code == 200, reply.text
    return {row["id"]: row for row in reply.json()["replicas"]}


async def route(client: httpx.AsyncClient, gateway_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /admin/route``: the decision a request would get, nothing sent (no prediction made)."""
    reply = await client.post(f"{gateway_url}/admin/route", json=body, headers=ADMIN, timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat_body(model: str, content: str, max_tokens: int, *, stream: bool, **extra: Any) -> dict[str, Any]:
    """A chat of one user message that generates exactly ``max_tokens`` (usage asked for in a stream)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body | extra


# --- requests, read as they arrive -----------------------------------------------------------------


@dataclass
class Outcome:
    """One request as a client saw it (``time.monotonic()`` times)."""

    started: float = field(default_factory=time.monotonic)
    status: int = 0
    replica: str | None = None  # x-kvroute-replica
    first_at: float | None = None  # the first content chunk
    ended: float | None = None
    chunks: int = 0  # events with choices
    done: bool = False  # data: [DONE]
    error: dict[str, Any] | None = None  # an error event, or the error body of a refusal
    error_at: float | None = None
    usage: dict[str, Any] | None = None
    failure: str | None = None  # what the client itself hit: a transport error or its timeout
    stream: bool = True

    @property
    def ok(self) -> bool:
        whole = self.status == 200 and self.error is None and self.failure is None
        return whole and (self.done or not self.stream)

    @property
    def latency(self) -> float:
        assert self.ended is not None
        return self.ended - self.started

    @property
    def in_flight(self) -> bool:
        return self.ended is None


async def stream_chat(
    client: httpx.AsyncClient,
    gateway_url: str,
    body: dict[str, Any],
    outcome: Outcome | None = None,
    *,
    path: str = "/v1/chat/completions",
) -> Outcome:
    """POSTs a streaming ``body`` and reads it event by event into ``outcome`` (updated as events
    arrive, so others can watch it), which it returns once the stream is over."""
    outcome = outcome or Outcome()
    outcome.started = time.monotonic()
    try:
        async with client.stream("POST", f"{gateway_url}{path}", json=body) as response:
            outcome.status = response.status_code
            outcome.replica = response.headers.get("x-kvroute-replica")
            if response.status_code != 200:
                outcome.error = _error_of(await response.aread())
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    outcome.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    outcome.error, outcome.error_at = event["error"], time.monotonic()
                elif event.get("choices"):
                    outcome.chunks += 1
                    if outcome.first_at is None:
                        outcome.first_at = time.monotonic()
                if event.get("usage"):
                    outcome.usage = event["usage"]
    except httpx.HTTPError as error:
        outcome.failure = f"{type(error).__name__}: {error}"
    finally:
        outcome.ended = time.monotonic()
    return outcome


async def post_whole(
    client: httpx.AsyncClient,
    gateway_url: str,
    body: dict[str, Any],
    outcome: Outcome | None = None,
    *,
    path: str = "/v1/chat/completions",
) -> Outcome:
    """POSTs a non-streaming ``body``; the reply's usage and error, if any, in the outcome."""
    outcome = outcome or Outcome()
    outcome.started, outcome.stream = time.monotonic(), False
    try:
        response = await client.post(f"{gateway_url}{path}", json=body)
        outcome.status = response.status_code
        outcome.replica = response.headers.get("x-kvroute-replica")
        if response.status_code == 200:
            outcome.usage = response.json().get("usage")
        else:
            outcome.error = _error_of(response.content)
    except httpx.HTTPError as error:
        outcome.failure = f"{type(error).__name__}: {error}"
    finally:
        outcome.ended = time.monotonic()
    return outcome


def _error_of(content: bytes) -> dict[str, Any]:
    try:
        return json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": content[:200].decode(errors="replace"), "code": None}


async def send(
    client: httpx.AsyncClient, gateway_url: str, body: dict[str, Any], outcome: Outcome | None = None
) -> Outcome:
    """``stream_chat`` or ``post_whole``, as ``body`` says."""
    request = stream_chat if body.get("stream") else post_whole
    return await request(client, gateway_url, body, outcome)


class Load:
    """``clients`` tasks, each sending ``body(client, i)`` for i = 0, 1, ... one after another
    until the load is stopped (leaving the block stops it and waits for the requests under way).
    ``outcomes`` holds every request from the moment it is sent."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        gateway_url: str,
        body: Callable[[int, int], dict[str, Any]],
        clients: int,
    ) -> None:
        self.client, self.url, self.body, self.clients = client, gateway_url, body, clients
        self.outcomes: list[Outcome] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        self._tasks = [asyncio.create_task(self._client(c)) for c in range(self.clients)]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stopping.set()
        async with asyncio.timeout(60):
            await asyncio.gather(*self._tasks)

    async def _client(self, client: int) -> None:
        i = 0
        while not self._stopping.is_set():
            outcome = Outcome()
            self.outcomes.append(outcome)
            await send(self.client, self.url, self.body(client, i), outcome)
            i += 1


# --- a latency probe -------------------------------------------------------------------------------


class LatencyProbe:
    """GETs ``url`` every ``interval`` seconds in a thread of its own (one keep-alive connection),
    recording when each call started, how long it took and its status (0: it failed). Entering
    returns once the client is built and connected, so the first samples time the server, not the
    probe's own set-up (building a client loads certificates and holds this process's GIL). While
    it runs, this process's cyclic garbage collector is paused: a full collection over the test
    process's heap (torch alone is ~400k objects) stalls every thread for 100-200 ms on these
    hosts, which the probe would report as the server's latency."""

    def __init__(self, url: str, interval: float = 0.01, timeout: float = 5.0) -> None:
        self.url = url
        self.interval = interval
        self.timeout = timeout
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._resume_gc = False
        self._thread = threading.Thread(target=self._run, name=f"probe {url}", daemon=True)

    def __enter__(self) -> Self:
        self._resume_gc = gc.isenabled()
        gc.disable()
        self._thread.start()
        self._ready.wait(self.timeout)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + 5)
        if self._resume_gc:
            gc.enable()

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            with contextlib.suppress(httpx.HTTPError):
                client.get(self.url)  # connects, off the record
            self._ready.set()
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    status = client.get(self.url).status_code
                except httpx.HTTPError:
                    status = 0
                self.samples.append((started, time.monotonic() - started, status))
                self._stop.wait(self.interval)

    def between(self, start: float, end: float) -> list[tuple[float, float, int]]:
        """The calls that overlapped ``[start, end]``."""
        return [s for s in list(self.samples) if s[0] <= end and s[0] + s[1] >= start]


# --- fake replicas ---------------------------------------------------------------------------------


class FakeReplica:
    """A server on a thread of this process that answers ``GET /v1/models``,
    ``/kvroute/tokenizer`` and ``/health`` exactly as the real replica at ``real_url`` does (so a
    gateway's static discovery lists it), and misbehaves on every POST, by ``mode``:

    * ``silent``: reads the request and never answers (a wedged process: the kernel accepted);
    * ``stall``: sends a stream's status line and headers, then nothing;
    * ``reset``: reads the request and resets the connection (TCP RST).

    ``posts`` counts the POSTs; ``held`` is how long each silent or stalled one was held before
    the gateway closed it.
    """

    def __init__(self, real_url: str, mode: str) -> None:
        assert mode in ("silent", "stall", "reset")
        self.mode = mode
        self.answers = {
            path: httpx.get(f"{real_url}{path}", timeout=10).raise_for_status().content
            for path in ("/v1/models", "/kvroute/tokenizer")
        }
        self.answers["/health"] = b""
        self.posts = 0
        self.held: list[float] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._serve, name=f"fake replica ({mode})", daemon=True)
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def replica_id(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10), "the fake replica did not start"
        return self

    def __exit__(self, *exc_info: object) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                request_line, *lines = head.split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = dict(
                    (name.strip().lower(), value.strip())
                    for name, value in (line.split(":", 1) for line in lines if ":" in line)
                )
                if length := int(headers.get("content-length", "0")):
                    await reader.readexactly(length)
                if method == "POST":
                    self.posts += 1
                    await self._misbehave(reader, writer)
                    return
                body = self.answers.get(path.split("?", 1)[0])
                status = b"200 OK" if body is not None else b"404 Not Found"
                body = body if body is not None else b'{"error": {"message": "not found"}}'
                writer.write(
                    b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (status, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _misbehave(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        if self.mode == "stall":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            await writer.drain()
        since = time.monotonic()
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):  # until the gateway closes its end
                pass
        self.held.append(time.monotonic() - since)
