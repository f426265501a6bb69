"""The proxy's client for the replicas: HTTP/1.1 keep-alive connections on asyncio, framed by httptools.

Proxying needs few things from a client: POST a body, get the status and headers, read the body
whole or as it arrives, reuse connections, time out, and drop a connection on purpose. General
clients pay for much more on every request (docs/BENCHMARKS.md, "upstream client"); this one is a
pool of :class:`gateway.proxy.connection.Connection`, an asyncio ``Protocol`` per connection.

* :meth:`UpstreamPool.post` sends a body and returns once the status and headers are in (with
  ``whole``: once all of the body is, or it failed); the body is then read whole
  (:meth:`UpstreamResponse.read`) or as it arrives (:meth:`UpstreamResponse.read_chunk`).
* A connection goes back to the pool as soon as its answer is complete and keep-alive; one whose
  answer is closed before its end (:meth:`UpstreamResponse.close`) is dropped.
* A *reused* connection the replica closes before any byte of an answer (it closed it while idle,
  just as the request went out) is retried once on a new connection; any other failure is an
  :class:`UpstreamError`. Idle connections are dropped after ``KEEPALIVE_S``, under uvicorn's
  default keep-alive, so the race is rare.
* Timeouts: ``connect_timeout`` to open a connection, ``read_timeout`` for each wait on the replica.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from gateway.proxy.connection import ClosedBeforeAnswer, Connection, UpstreamError, UpstreamResponse

KEEPALIVE_S = 4.0  # below uvicorn's default keep-alive (5 s): we close idle connections first


class _Origin(NamedTuple):
    """Where a replica URL's requests go, and the request-head bytes every one of them shares."""

    key: tuple[str, str, int]  # scheme, host, port: what a connection serves
    base_path: bytes
    head_fields: bytes  # Host and the pool's extra headers, each line ending in CRLF


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
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._max_in_use = max_in_use
        self._in_use = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._ssl: ssl.SSLContext | None = None

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        content_type: bytes,
        *,
        whole: bool = False,
        first_data_within: float | None = None,
        on_response: Callable[[UpstreamResponse], None] | None = None,
    ) -> UpstreamResponse:
        """POSTs ``body`` to ``url + path``; returns when the response's headers are in, with
        ``whole`` when all of it is, with ``first_data_within`` when its first body bytes are (a
        replica silent that long fails: the caller can still try another). A failure after that
        point is raised by the read. ``on_response`` sees each answer as soon as it is awaited
        (to give it up from elsewhere: ``UpstreamResponse.abandon``)."""
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
            if on_response is not None:
                on_response(response)
            connection.send(response, request)
            try:
                if first_data_within is None:
                    await response.arrival(body=whole)
                else:  # the deadline covers the status line and headers too
                    await response.first_data(first_data_within)
            except BaseException:
                response.close()
                raise
            failure = response.failure
            answered = response.has_data if first_data_within is not None else response.headers_done
            if failure is None or answered:
                return response
            if isinstance(failure, ClosedBeforeAnswer) and connection.requests > 1:
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

    def keep(self, connection: Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    def _reused(self, key: tuple[str, str, int]) -> Connection | None:
        """The most recently idle live connection to ``key``; the stale ones are closed."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.drop()
        return None

    async def _connect(self, key: tuple[str, str, int]) -> Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        secure = self._ssl_context() if scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: Connection(self, key), host, port, ssl=secure
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
