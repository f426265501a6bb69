"""The proxy's client for the replicas: keep-alive HTTP/1.1, lean enough for the request path.

httpx, which the gateway uses for everything else (tokenizer fetches, discovery, health probes),
costs about 450 µs of CPU per proxied request at concurrency 1 and 1.7 ms at concurrency 32 (its
pool re-examines every connection several times per request; see docs/BENCHMARKS.md), more than
the gateway's whole budget. This client does only what proxying needs, at a few tens of µs:

* ``post`` sends a body and returns once the status and headers are in (or, for an answer that
  will be read whole, once all of it is); the body is then read whole
  (:meth:`UpstreamResponse.read`) or as it arrives (:meth:`UpstreamResponse.read_chunk`), unframed
  (Content-Length, chunked, or up to the close) by httptools' llhttp parser.
* Idle connections wait in one LIFO stack per origin, taken and returned in O(1). A response read
  to its end gives its connection back (unless the replica asked to close it); one closed early
  (:meth:`UpstreamResponse.close`) drops its connection, which tells the replica the client left,
  so it aborts the request and frees its pages.
* A reused connection that fails before any byte of the answer (the replica closed it while it was
  idle) is retried once on a new connection; every other failure is an :class:`UpstreamError`.
* Timeouts: ``connect_timeout`` to open a connection, ``read_timeout`` for each wait on the replica
  (headers, then every piece of the body). While a body is read as it arrives, reading pauses when
  more than ``_HIGH_WATER`` bytes wait unread, so a slow client slows the replica's stream rather
  than filling memory.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # unread body bytes at which reading pauses
_MAX_IDLE_PER_ORIGIN = 256


class UpstreamError(Exception):
    """The replica could not be reached, or did not answer in full."""


class _Origin(NamedTuple):
    host: str
    port: int
    tls: bool
    path_prefix: str  # a base URL's own path (e.g. behind an ingress), without the trailing slash
    host_header: bytes


class _TimedOut(UpstreamError):
    """The replica did not answer in time (never worth retrying on a new connection)."""


def _parse_origin(url: str) -> _Origin:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    return _Origin(
        host=parts.hostname,
        port=parts.port or (443 if tls else 80),
        tls=tls,
        path_prefix=parts.path.rstrip("/"),
        host_header=parts.netloc.rpartition("@")[2].encode("idna"),
    )


class _Connection(asyncio.Protocol):
    """One TCP connection and the response being read on it (httptools calls the ``on_*`` methods)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.busy = False  # a request was sent and its response not closed yet
        self._start()

    def _start(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of this response
        self.error: UpstreamError | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._wake_on_data = True  # False while waiting for the whole response

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:  # nothing was asked: the connection is unusable
            self.abort()
            return
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(f"malformed response: {error}")
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy and not self.complete and self.error is None:
            if self.headers_done and self._ends_at_close():
                self.complete = True
            else:
                why = f"{type(exc).__name__}: {exc}" if exc else "the replica closed the connection"
                self._fail(why if self.received else f"{why} before answering")
        self._wake()

    def _ends_at_close(self) -> bool:
        """Whether the body has no length of its own and ends with the connection (RFC 9112 §6.3)."""
        names = {name for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    # -- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status >= 200:  # 1xx: an interim answer, the real one follows
            self.headers_done = True
            if self._wake_on_data:
                self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        if not self._wake_on_data:
            return  # read whole: nobody takes the body before it is complete
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            self.headers = []
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- used by the pool and the response ------------------------------------------------------

    def send(self, request: bytes) -> None:
        self._start()
        self.busy = True
        assert self._transport is not None
        self._transport.write(request)

    async def wait_for_headers(self, timeout: float, whole: bool) -> None:
        """Until the status and headers are in, or with ``whole`` the entire response (one wake-up
        instead of several, for a body that is read whole anyway)."""
        self._wake_on_data = not whole
        try:
            while not (self.complete if whole else self.headers_done):
                if self.error is not None:
                    if self.headers_done:
                        return  # the body broke off: reading it says so
                    raise self.error
                await self._wait(timeout)
        finally:
            self._wake_on_data = True

    async def next_chunk(self, timeout: float) -> bytes:
        """Body bytes received so far and not yet taken; b"" once the body is complete."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait(timeout)
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def abort(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, timeout: float) -> None:
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = self._loop.call_later(timeout, self._time_out, waiter, timeout)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _time_out(self, waiter: asyncio.Future[None], timeout: float) -> None:
        if not waiter.done():
            self.error = _TimedOut(f"no answer from the replica within {timeout:g} s")
            self.abort()
            waiter.set_exception(self.error)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = UpstreamError(why)


class UpstreamResponse:
    """A replica's answer whose status and headers are in; read its body, or close it early."""

    def __init__(self, pool: UpstreamPool, origin: _Origin, connection: _Connection) -> None:
        self._pool = pool
        self._origin = origin
        self._connection: _Connection | None = connection
        self.status = connection.status
        self.headers = connection.headers

    async def read_chunk(self) -> bytes:
        """The next part of the body as it arrives; b"" at its end (the response is then closed)."""
        connection = self._connection
        if connection is None:
            return b""
        try:
            chunk = await connection.next_chunk(self._pool.read_timeout)
        except BaseException:
            self.close()
            raise
        if not chunk:
            self.close()
        return chunk

    async def read(self) -> bytes:
        """The whole body."""
        chunks = []
        while chunk := await self.read_chunk():
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Gives a fully read response's connection back to the pool; drops any other's (idempotent)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.busy = False
        if connection.complete and connection.keep_alive and not connection.closed:
            self._pool._release(self._origin, connection)
        else:
            connection.abort()
        self._pool._in_use.release()


class UpstreamPool:
    """Keep-alive connections to the replicas. ``headers`` are sent with every request (e.g. the
    replica key); at most ``max_in_use`` requests are under way at once (the next ones wait for a
    response to close). :meth:`aclose` closes the idle connections; open responses close their own."""

    def __init__(
        self,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 600.0,
        headers: Mapping[str, str] | None = None,
        max_in_use: int = 1024,
    ) -> None:
        self._in_use = asyncio.Semaphore(max_in_use)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._extra_headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(
        self, url: str, path: str, body: bytes, content_type: bytes, *, whole: bool = False
    ) -> UpstreamResponse:
        """POSTs ``body`` to ``url + path``; returns when the response's headers are in, or with
        ``whole`` when all of it is (its body is then read without waiting)."""
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _parse_origin(url.rstrip("/"))
        request = b"".join(
            (
                b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
                % ((origin.path_prefix + path).encode(), origin.host_header, content_type, len(body)),
                self._extra_headers,
                b"\r\n",
                body,
            )
        )
        await self._in_use.acquire()  # released when the response closes
        try:
            connection = self._take(origin)
            if connection is not None:
                try:
                    return await self._exchange(origin, connection, request, whole)
                except _TimedOut:
                    raise
                except UpstreamError:
                    if connection.received:
                        raise
                    # closed by the replica while it was idle: a new connection will do
            return await self._exchange(origin, await self._connect(origin), request, whole)
        except BaseException:
            self._in_use.release()
            raise

    async def aclose(self) -> None:
        for stack in self._idle.values():
            for connection in stack:
                connection.abort()
        self._idle.clear()

    async def _exchange(
        self, origin: _Origin, connection: _Connection, request: bytes, whole: bool
    ) -> UpstreamResponse:
        try:
            connection.send(request)
            await connection.wait_for_headers(self.read_timeout, whole)
        except BaseException:
            connection.busy = False
            connection.abort()
            raise
        return UpstreamResponse(self, origin, connection)

    def _take(self, origin: _Origin) -> _Connection | None:
        stack = self._idle.get(origin)
        while stack:
            connection = stack.pop()
            if not connection.closed:
                return connection
        return None

    def _release(self, origin: _Origin, connection: _Connection) -> None:
        stack = self._idle.setdefault(origin, [])
        if len(stack) < _MAX_IDLE_PER_ORIGIN:
            stack.append(connection)
        else:
            connection.abort()

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), origin.host, origin.port, ssl=tls
                )
        except (OSError, TimeoutError) as error:
            why = str(error) or f"no connection within {self.connect_timeout:g} s"
            raise UpstreamError(f"cannot connect to {origin.host}:{origin.port}: {why}") from None
        return connection
