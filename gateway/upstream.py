"""The proxy's client for the replicas: HTTP/1.1 keep-alive connections on asyncio, framed by httptools.

Proxying needs few things from a client: POST a body, get the status and headers, read the body
whole or as it arrives, reuse connections, time out, and drop a connection on purpose. General
clients pay for much more on every request: httpx ~400 µs of CPU at concurrency 1 and ~2 ms at 32,
aiohttp 50-90 µs (docs/BENCHMARKS.md, "upstream client"). This one is an asyncio ``Protocol`` per
connection around httptools' response parser (the C parser uvicorn serves with), which handles
every framing: content-length, chunked, and until-close.

* :meth:`UpstreamPool.post` sends a body and returns once the status and headers are in (with
  ``whole``: once all of the body is, or it failed); the body is then read whole
  (:meth:`UpstreamResponse.read`) or as it arrives (:meth:`UpstreamResponse.read_chunk`). While
  more than ``PAUSE_BYTES`` wait unread the connection stops reading from its socket, so a slow
  client slows the replica's stream instead of filling memory.
* A connection goes back to the pool as soon as its answer is complete and keep-alive; one whose
  answer is closed before its end (:meth:`UpstreamResponse.close`) is dropped, which tells the
  replica the client left, so it aborts the request and frees its pages.
* A *reused* connection the replica closes before any byte of an answer (it closed it while idle,
  just as the request went out) is retried once on a new connection; any other failure is an
  :class:`UpstreamError`. Idle connections are dropped after ``KEEPALIVE_S``, under uvicorn's 5 s
  keep-alive, so the race is rare.
* Timeouts: ``connect_timeout`` to open a connection, ``read_timeout`` for each wait on the replica.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

KEEPALIVE_S = 4.0  # below uvicorn's default keep-alive (5 s): we close idle connections first
PAUSE_BYTES = 1 << 20  # unread body bytes at which a connection stops reading its socket


class UpstreamError(Exception):
    """The replica could not be reached, or did not answer in full."""


class _Closed(UpstreamError):
    """The connection closed before any byte of the answer: retried once if it was a reused one."""


class _Origin(NamedTuple):
    """Where a replica URL's requests go, and the request-head bytes every one of them shares."""

    key: tuple[str, str, int]  # scheme, host, port: what a connection serves
    base_path: bytes
    head_fields: bytes  # Host and the pool's extra headers, each line ending in CRLF


class UpstreamResponse:
    """A replica's answer whose status and headers are in; read its body, or close it early."""

    def __init__(self, connection: _Connection, read_timeout: float) -> None:
        self._connection: _Connection | None = connection  # until the answer is complete or closed
        self._read_timeout = read_timeout
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.received = False  # any byte of the answer
        self.complete = False
        self.failure: UpstreamError | None = None
        self._chunks: list[bytes] = []
        self._unread = 0
        self._whole = False  # the reader wants all of the body: never pause the connection
        self._waiter: asyncio.Future[None] | None = None

    # -- the connection's side ---------------------------------------------------------------------

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._unread += len(data)
        if self._unread > PAUSE_BYTES and not self._whole and self._connection is not None:
            self._connection.pause()
        self._wake()

    def _finish(self, failure: UpstreamError | None) -> None:
        """The answer is complete (``failure`` None) or broke off; the connection is done with it."""
        self._connection = None
        if failure is None:
            self.complete = True
        elif self.failure is None:
            self.failure = failure
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side -------------------------------------------------------------------------

    async def _wait(self) -> None:
        """Until the connection says something new, or the read timeout drops it."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(self._read_timeout, self._time_out)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _time_out(self) -> None:
        connection = self._connection
        self._finish(UpstreamError(f"no answer from the replica within {self._read_timeout:g} s"))
        if connection is not None:
            connection.drop()

    async def _until(self, *, body: bool) -> None:
        """Waits for the headers, or with ``body`` for all of the body, unless it fails first."""
        if body and not self._whole:
            self._whole = True
            if self._connection is not None:
                self._connection.resume()
        while not (self.complete if body else self.headers_done) and self.failure is None:
            await self._wait()

    async def read_chunk(self) -> bytes:
        """The body bytes arrived since the last read (waiting for some); b"" at its end."""
        while not self._chunks and not self.complete:
            if self.failure is not None:
                self.close()
                raise self.failure
            await self._wait()
        chunk = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0] if self._chunks else b""
        self._chunks.clear()
        self._unread = 0
        if self._connection is not None:
            self._connection.resume()
        return chunk

    async def read(self) -> bytes:
        """The whole body."""
        try:
            await self._until(body=True)
        except BaseException:
            self.close()
            raise
        if not self.complete:
            self.close()
            assert self.failure is not None
            raise self.failure
        return await self.read_chunk()

    def close(self) -> None:
        """Drops the connection unless the answer is complete (then it is back in the pool already)."""
        connection = self._connection
        if connection is not None:
            self._finish(UpstreamError("closed by the gateway"))
            connection.drop()


class _Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one request at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, str, int]) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self._framed = False  # the answer has a length or is chunked (else it ends when the socket does)
        self.idle_since = 0.0
        self.requests = 0  # sent on this connection
        self.closed = False
        self._paused = False

    # -- asyncio -------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.drop()  # nothing was asked
            return
        response.received = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as error:
            self._fail(UpstreamError(f"malformed response from the replica ({error})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is None:
            return
        if response.headers_done and not self._framed:
            self.response = None
            self._pool.release()
            response._finish(None)  # the body ran until the socket closed
        elif response.received:
            self._fail(UpstreamError("the replica closed the connection mid-answer"))
        else:
            self._fail(_Closed("the replica closed the connection before answering"))

    # -- httptools -----------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True
        assert self.response is not None
        self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self._parser.get_status_code()
        response.headers_done = True
        response._wake()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._body(body)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        assert response is not None
        self._pool.release()
        if self._parser.should_keep_alive() and not self.closed:
            self._pool.keep(self)
        else:
            self.drop()
        response._finish(None)

    # -- the pool's side -----------------------------------------------------------------------------

    def send(self, response: UpstreamResponse, request: bytes) -> None:
        assert self.transport is not None
        self.response = response
        self.requests += 1
        self._framed = False
        self.transport.write(request)

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def drop(self) -> None:
        """Closes the connection at once; an answer under way fails (idempotent)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        if self.response is not None:
            self._fail(UpstreamError("the connection was dropped"))

    def _fail(self, failure: UpstreamError) -> None:
        response, self.response = self.response, None
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        if response is not None:
            self._pool.release()
            response._finish(failure)


class UpstreamPool:
    """Keep-alive connections to the replicas. ``headers`` are sent with every request (e.g. the
    replica key); at most ``max_in_use`` requests are under way at once (the next ones wait for an
    answer to complete or close). :meth:`aclose` closes the pool; open responses close their own."""

    def __init__(
        self,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 600.0,
        headers: Mapping[str, str] | None = None,
        max_in_use: int = 1024,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._extra_fields = b"".join(
            f"{name}: {value}\r\n".encode("latin-1") for name, value in (headers or {}).items()
        )
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._max_in_use = max_in_use
        self._in_use = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._ssl: ssl.SSLContext | None = None

    async def post(
        self, url: str, path: str, body: bytes, content_type: bytes, *, whole: bool = False
    ) -> UpstreamResponse:
        """POSTs ``body`` to ``url + path``; returns when the response's headers are in, or with
        ``whole`` when all of it is (a failure after the headers is then raised by the read)."""
        origin = self._origins.get(url) or self._origin(url)
        request = b"".join(
            (
                b"POST %s%s HTTP/1.1\r\n" % (origin.base_path, path.encode("latin-1")),
                origin.head_fields,
                b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n" % (content_type, len(body)),
                body,
            )
        )
        await self._acquire()
        reuse = True
        while True:
            try:
                connection = (reuse and self._reused(origin.key)) or await self._connect(origin.key)
            except BaseException:
                self.release()
                raise
            response = UpstreamResponse(connection, self.read_timeout)
            connection.send(response, request)
            try:
                await response._until(body=whole)
            except BaseException:
                response.close()
                raise
            failure = response.failure
            if failure is None or response.headers_done:
                return response
            if isinstance(failure, _Closed) and connection.requests > 1:
                reuse = False  # most likely closed by the replica while idle: a new connection will do
                await self._acquire()
                continue
            raise failure

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.drop()
        self._idle.clear()

    # -- connections -------------------------------------------------------------------------------

    def keep(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    def _reused(self, key: tuple[str, str, int]) -> _Connection | None:
        """The most recently idle live connection to ``key``; the stale ones are closed."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.drop()
        return None

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        secure = self._ssl_context() if scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=secure
                )
        except TimeoutError:
            raise UpstreamError(
                f"cannot connect to {host}:{port}: no connection within {self.connect_timeout:g} s"
            ) from None
        except OSError as error:
            raise UpstreamError(f"cannot connect to {host}:{port}: {error}") from None
        return connection

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _origin(self, url: str) -> _Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        host_field = f"[{host}]" if ":" in host else host
        head = f"Host: {host_field}:{port}\r\n".encode("latin-1") + self._extra_fields
        origin = _Origin((parts.scheme, host, port), parts.path.rstrip("/").encode("latin-1"), head)
        if len(self._origins) >= 1024:
            self._origins.clear()  # replica URLs come and go; never an unbounded map
        self._origins[url] = origin
        return origin

    # -- the in-use limit --------------------------------------------------------------------------

    async def _acquire(self) -> None:
        if self._in_use < self._max_in_use and not self._waiting:
            self._in_use += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter  # release() handed its place over
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over just as this was cancelled: pass it on
            else:
                self._waiting.remove(waiter)
            raise

    def release(self) -> None:
        """A request is over: its place goes to the first waiting one, else back to the pool."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._in_use -= 1
