"""One keep-alive connection to a replica (an asyncio ``Protocol`` around httptools' response
parser, which handles every framing: content-length, chunked, and until-close) and the answer it
carries (:class:`UpstreamResponse`), read whole or as it arrives.

While more than ``PAUSE_BYTES`` wait unread the connection stops reading from its socket, so a
slow client slows the replica's stream instead of filling memory. Closing an answer before its
end drops the connection, which tells the replica the client left, so it aborts the request and
frees its pages.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, cast

import httptools

PAUSE_BYTES = 1 << 20  # unread body bytes at which a connection stops reading its socket


class UpstreamError(Exception):
    """The replica could not be reached, or did not answer in full."""


class ClosedBeforeAnswer(UpstreamError):
    """The connection closed before any byte of the answer: retried once if it was a reused one."""


class _Pool(Protocol):
    """What a connection tells its pool (:class:`gateway.proxy.upstream.UpstreamPool`)."""

    def keep(self, connection: Connection) -> None:
        """The answer is complete and the connection may carry another request."""

    def release(self) -> None:
        """A request is over (its answer complete or failed)."""


class UpstreamResponse:
    """A replica's answer whose status and headers are in; read its body, or close it early."""

    def __init__(self, connection: Connection, read_timeout: float) -> None:
        self._connection: Connection | None = connection  # until the answer is complete or closed
        self._read_timeout = read_timeout
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.received = False  # any byte of the answer
        self.complete = False
        self.failure: UpstreamError | None = None
        self._chunks: list[bytes] = []
        self._unread = 0
        self._last_data: float | None = None  # time.monotonic() of the last body bytes
        self._whole = False  # the reader wants all of the body: never pause the connection
        self._waiter: asyncio.Future[None] | None = None

    # -- the connection's side ---------------------------------------------------------------------

    def _body(self, data: bytes) -> None:
        self._last_data = time.monotonic()
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
        self.abandon(f"no answer from the replica within {self._read_timeout:g} s")

    def abandon(self, why: str) -> None:
        """Gives up the answer (``why`` is the failure its reader sees) and drops the connection,
        so the replica aborts the request."""
        connection = self._connection
        self._finish(UpstreamError(why))
        if connection is not None:
            connection.drop()

    def flowing(self, within_s: float) -> bool:
        """Whether body bytes are still arriving: some came in the last ``within_s`` seconds and
        the answer is not over. A replica that streams is alive, whatever its heartbeat says."""
        last = self._last_data
        return self._connection is not None and last is not None and time.monotonic() - last < within_s

    @property
    def has_data(self) -> bool:
        """Any body byte arrived (or the body is complete)."""
        return bool(self._chunks) or self.complete

    async def first_data(self, within_s: float) -> None:
        """Waits for the headers and the first body bytes (or the end, or a failure); a replica
        silent for ``within_s`` seconds is given up."""
        try:
            async with asyncio.timeout(within_s):
                while not self.has_data and self.failure is None:
                    await self._wait()
        except TimeoutError:
            self.abandon(f"no first byte from the replica within {within_s:g} s")

    async def arrival(self, *, body: bool) -> None:
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
            await self.arrival(body=True)
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


class Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one request at a time."""

    def __init__(self, pool: _Pool, key: tuple[str, str, int]) -> None:
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
            self._fail(ClosedBeforeAnswer("the replica closed the connection before answering"))

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
