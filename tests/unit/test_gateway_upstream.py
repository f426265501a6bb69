"""The proxy's HTTP client (gateway.proxy.upstream) against a loopback server whose answers each test
scripts: body framings, keep-alive, the one retry of a connection closed while idle, timeouts,
malformed and truncated answers, and a body larger than the client buffers unread."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from gateway.proxy.connection import PAUSE_BYTES, UpstreamError
from gateway.proxy.relay import SSERelay, open_upstream
from gateway.proxy.upstream import UpstreamPool

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

JSON = b"application/json"

# A handler answers one request on one connection: it gets the request's head and body, the
# connection's writer, and the request's number on that connection; returning False closes it.
Handler = Callable[[bytes, bytes, asyncio.StreamWriter, int], Awaitable[bool]]


@dataclass
class Server:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server = Server("")

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        number = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.CancelledError):
                    return  # the client closed, or the test is over
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                server.requests.append(head + body)
                if not await handler(head, body, writer, number):
                    return
                number += 1
        finally:
            writer.close()

    listener = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    async with listener:
        yield server


def answer(body: bytes, *headers: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    return head + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body


def replying(*replies: bytes, keep_open: bool = True) -> Handler:
    """Answers the n-th request of every connection with ``replies[n]``; closes the connection
    after a ``connection: close`` answer, or after every answer unless ``keep_open``."""

    async def handler(head: bytes, body: bytes, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(replies[number])
        await writer.drain()
        return keep_open and b"connection: close" not in replies[number]

    return handler


async def test_bodies_by_length_chunks_and_close_and_keep_alive() -> None:
    close_delimited = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nuntil the end"

    replies = (answer(b'{"a":1}'), chunked(b"data: 1\n\n", b"data: 2\n\n"), close_delimited)
    async with serving(replying(*replies)) as server:
        pool = UpstreamPool(read_timeout=5)
        first = await pool.post(server.url, "/v1/x", b'{"q":1}', JSON, whole=True)
        assert first.status == 200 and (b"content-type", b"application/json") in first.headers
        assert await first.read() == b'{"a":1}'
        second = await pool.post(server.url + "/", "/v1/x", b"{}", JSON)
        assert [await second.read_chunk() for _ in range(3)][-1] == b""  # then the end
        third = await pool.post(server.url, "/v1/x", b"{}", JSON)
        assert await third.read() == b"until the end"
        assert server.connections == 1, "a fully read answer gives its connection back"
        fourth = await pool.post(server.url, "/v1/x", b"{}", JSON)  # the server closed: a new one
        assert await fourth.read() == b'{"a":1}' and server.connections == 2
        await pool.aclose()
    head = server.requests[0].split(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert head[0] == b"post /v1/x http/1.1" and b"content-length: 7" in head
    assert server.requests[0].endswith(b'{"q":1}')


async def test_extra_headers_and_a_base_path_are_sent() -> None:
    async with serving(replying(answer(b"{}"))) as server:
        pool = UpstreamPool(headers={"authorization": "Bearer k"})
        await (await pool.post(server.url + "/base/", "/v1/x", b"{}", JSON)).read()
        await pool.aclose()
    head = server.requests[0].lower().split(b"\r\n")
    assert head[0] == b"post /base/v1/x http/1.1" and b"authorization: bearer k" in head


async def test_a_connection_closed_while_idle_is_retried_once_on_a_new_one() -> None:
    async def closes_on_reuse(head: bytes, body: bytes, writer: asyncio.StreamWriter, number: int) -> bool:
        if number > 0:
            return False  # as if its keep-alive timer fired just as the request came
        writer.write(answer(b'{"n":1}'))
        return True

    async with serving(closes_on_reuse) as server:
        pool = UpstreamPool(read_timeout=5)
        for _ in range(3):
            assert await (await pool.post(server.url, "/", b"{}", JSON)).read() == b'{"n":1}'
        assert server.connections == 3 and len(server.requests) == 5
        await pool.aclose()


async def test_failures_are_upstream_errors() -> None:
    async def hangs(head: bytes, body: bytes, writer: asyncio.StreamWriter, number: int) -> bool:
        await asyncio.sleep(5)
        return False

    pool = UpstreamPool(read_timeout=0.2)
    async with serving(replying(b"NOT HTTP AT ALL\r\n\r\n")) as server:
        with pytest.raises(UpstreamError, match="malformed response"):
            await pool.post(server.url, "/", b"{}", JSON)
    async with serving(replying(b"", keep_open=False)) as server:
        with pytest.raises(UpstreamError, match="closed the connection before answering"):
            await pool.post(server.url, "/", b"{}", JSON)
        assert server.connections == 1, "a new connection is not retried: only a reused one is"
    async with serving(hangs) as server:
        with pytest.raises(UpstreamError, match=r"no answer from the replica within 0\.2 s"):
            await pool.post(server.url, "/", b"{}", JSON, whole=True)
    truncated = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b"
    async with serving(replying(truncated, keep_open=False)) as server:
        for whole in (False, True):
            response = await pool.post(server.url, "/", b"{}", JSON, whole=whole)
            assert response.status == 200
            with pytest.raises(UpstreamError, match="closed the connection"):
                await response.read()
    with pytest.raises(UpstreamError, match="cannot connect"):
        await pool.post(server.url, "/", b"{}", JSON)  # that server is gone
    with pytest.raises(UpstreamError, match="not an http"):
        await pool.post("ftp://127.0.0.1:1", "/", b"{}", JSON)


async def test_a_body_beyond_the_pause_threshold_arrives_whole() -> None:
    big = bytes(range(256)) * (3 * PAUSE_BYTES // 256)  # several times what the client buffers unread

    async with serving(replying(answer(big), answer(big))) as server:
        pool = UpstreamPool(read_timeout=5)
        response = await pool.post(server.url, "/", b"{}", JSON)
        received = []
        while chunk := await response.read_chunk():
            received.append(chunk)
            await asyncio.sleep(0.01)  # a slow client: reading pauses meanwhile
        again = await (await pool.post(server.url, "/", b"{}", JSON, whole=True)).read()
        assert again == big and server.connections == 1
        await pool.aclose()
    assert b"".join(received) == big


async def test_the_relay_batches_events_and_takes_out_the_unasked_usage() -> None:
    usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}
    events = [
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
        b'data: {"choices":[],"usage":' + json.dumps(usage, separators=(",", ":")).encode() + b"}\n\n",
        b"data: [DONE]\n\n",
    ]
    stream = chunked(events[0][:10], events[0][10:] + events[1], events[2])

    async def relay_through(forward_usage: bool) -> tuple[list[bytes], SSERelay]:
        async with serving(replying(stream)) as server:
            pool = UpstreamPool(read_timeout=5)
            upstream = await open_upstream(pool, [server.url], "/", b"{}")
            relay = SSERelay(upstream.response, forward_usage=forward_usage)
            reads = [read async for read in relay]
            await pool.aclose()
            return reads, relay

    reads, relay = await relay_through(False)
    assert b"".join(reads) == events[0] + events[2]
    assert relay.usage == usage and relay.finished and relay.first_event_at is not None
    reads, relay = await relay_through(True)
    assert b"".join(reads) == b"".join(events) and relay.usage == usage


async def test_requests_beyond_the_limit_wait_for_a_response_to_close() -> None:
    whole = chunked(b"data: x\n\n")
    unfinished = whole[: whole.index(b"0\r\n\r\n")]  # the stream goes on

    async def handler(head: bytes, body: bytes, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(unfinished if server.connections == 1 else whole)
        return True

    async with serving(handler) as server:
        pool = UpstreamPool(read_timeout=5, max_in_use=1)
        first = await pool.post(server.url, "/", b"{}", JSON)
        assert await first.read_chunk() == b"data: x\n\n"
        second = asyncio.create_task(pool.post(server.url, "/", b"{}", JSON, whole=True))
        await asyncio.sleep(0.1)
        assert not second.done() and len(server.requests) == 1
        given_up = asyncio.create_task(pool.post(server.url, "/", b"{}", JSON))
        await asyncio.sleep(0.05)
        given_up.cancel()  # a waiting request whose client left takes no place with it
        first.close()  # before its end: its connection is dropped, its place freed
        assert await (await second).read() == b"data: x\n\n"
        with pytest.raises(UpstreamError):
            await pool.post("http://127.0.0.1:1", "/", b"{}", JSON)  # a failure frees its place too
        assert await (await pool.post(server.url, "/", b"{}", JSON)).read() == b"data: x\n\n"
        assert server.connections == 2 and len(server.requests) == 3
        await pool.aclose()
