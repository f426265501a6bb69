"""The upstream HTTP clients alone (5 of :mod:`loadtests.bench_gateway`): this thread's CPU per
request of the gateway's client, aiohttp and httpx against an instant loopback server."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import httpx
import uvloop

from gateway.proxy.upstream import UpstreamPool
from launcher.local_redis import free_port
from loadtests.bench_gateway.settings import CHAT_PATH, CONCURRENCY, HEADERS, MODES, chat_body

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
