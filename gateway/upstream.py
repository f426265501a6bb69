"""The proxy's client for the replicas: aiohttp's keep-alive pool behind the few calls proxying needs.

httpx, which the gateway uses for everything else (tokenizer fetches, discovery, health probes),
costs about 400 µs of CPU per proxied request at concurrency 1 and 2 ms at concurrency 32 (its pool
re-examines every connection several times per request); aiohttp's client costs 50–70 µs
(docs/BENCHMARKS.md, "upstream client"), so the request path uses it:

* :meth:`UpstreamPool.post` sends a body and returns once the status and headers are in (with
  ``whole``: once all of the body is); the body is then read whole (:meth:`UpstreamResponse.read`)
  or as it arrives (:meth:`UpstreamResponse.read_chunk`; aiohttp stops reading from the socket
  while too much waits unread, so a slow client slows the replica's stream instead of filling
  memory).
* A response read to its end gives its connection back to the pool; one closed early
  (:meth:`UpstreamResponse.close`) drops its connection, which tells the replica the client left,
  so it aborts the request and frees its pages.
* A connection the replica closes before any byte of an answer (typically a pooled one it closed
  while idle, just as the request went out) is retried once, on another connection; a second such
  failure is an :class:`UpstreamError`, as is every other failure. Idle connections are dropped
  after ``KEEPALIVE_S``, under uvicorn's 5 s keep-alive, so the race is rare. (aiohttp retries
  only idempotent methods itself, and telling a reused connection from a new one takes a
  ``TraceConfig``, which costs ~5% of the gateway's CPU on every request.)
* Timeouts: ``connect_timeout`` to open a connection, ``read_timeout`` for each wait on the replica.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

KEEPALIVE_S = 4.0  # below uvicorn's default keep-alive (5 s): we close idle connections first


class UpstreamError(Exception):
    """The replica could not be reached, or did not answer in full."""


class UpstreamResponse:
    """A replica's answer whose status and headers are in; read its body, or close it early."""

    def __init__(self, response: aiohttp.ClientResponse, read_timeout: float) -> None:
        self._response: aiohttp.ClientResponse | None = response
        self._read_timeout = read_timeout
        self.status = response.status
        self.headers = [(name.lower(), value) for name, value in response.raw_headers]
        self._body: bytes | None = None  # read ahead (``post(whole=True)``)
        self._failure: UpstreamError | None = None  # of that read, raised when the body is asked for

    async def read_ahead(self) -> None:
        """Reads the whole body now, so that later reads do not wait."""
        assert self._response is not None
        try:
            self._body = await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            self._failure = _upstream_error(error, self._read_timeout)

    async def read_chunk(self) -> bytes:
        """The next part of the body as it arrives; b"" at its end (the response is then closed)."""
        response = self._response
        if response is None:
            return b""
        if self._failure is not None:
            self.close()
            raise self._failure
        if self._body is not None:
            chunk, self._body = self._body, b""
            if not chunk:
                self.close()
            return chunk
        try:
            chunk = await response.content.readany()
        except BaseException as error:
            self.close()
            if isinstance(error, aiohttp.ClientError | TimeoutError):
                raise _upstream_error(error, self._read_timeout) from None
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
        response, self._response = self._response, None
        if response is None:
            return
        if response.content.at_eof():
            response.release()
        else:
            response.close()


class UpstreamPool:
    """Keep-alive connections to the replicas. ``headers`` are sent with every request (e.g. the
    replica key); at most ``max_in_use`` connections are in use at once (the next requests wait for
    a response to close). :meth:`aclose` closes the pool; open responses close their own."""

    def __init__(
        self,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 600.0,
        headers: Mapping[str, str] | None = None,
        max_in_use: int = 1024,
    ) -> None:
        self.read_timeout = read_timeout
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._headers = dict(headers or {})
        self._max_in_use = max_in_use
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        """The session, made on first use: aiohttp binds it to the running event loop."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_in_use, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
                ),
                timeout=self._timeout,
                headers=self._headers,
                auto_decompress=False,  # bytes go through to the client as the replica sent them
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def post(
        self, url: str, path: str, body: bytes, content_type: bytes, *, whole: bool = False
    ) -> UpstreamResponse:
        """POSTs ``body`` to ``url + path``; returns when the response's headers are in, or with
        ``whole`` when all of it is (its body is then read without waiting)."""
        if not url.startswith(("http://", "https://")):
            raise UpstreamError(f"not an http(s) URL: {url!r}")
        target = url.rstrip("/") + path
        headers = {"Content-Type": content_type.decode("latin-1")}
        for attempt in (1, 2):
            try:
                response = await self._client().post(target, data=body, headers=headers)
            except aiohttp.ServerDisconnectedError as error:
                if attempt == 1:
                    continue  # most likely closed by the replica while idle: a new connection will do
                raise _upstream_error(error, self.read_timeout) from None
            except (aiohttp.ClientError, TimeoutError) as error:
                raise _upstream_error(error, self.read_timeout) from None
            upstream = UpstreamResponse(response, self.read_timeout)
            if whole:
                await upstream.read_ahead()
            return upstream
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _upstream_error(error: BaseException, read_timeout: float) -> UpstreamError:
    """aiohttp's failures, in the words the gateway logs and counts."""
    if isinstance(error, aiohttp.ClientConnectorError):
        return UpstreamError(f"cannot connect to {error.host}:{error.port}: {error.os_error}")
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return UpstreamError("the replica closed the connection before answering")
    if isinstance(error, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamError(f"no answer from the replica within {read_timeout:g} s")
    if isinstance(error, aiohttp.ClientPayloadError):
        return UpstreamError(f"the replica closed the connection mid-answer ({error})")
    if isinstance(error, aiohttp.ClientResponseError):
        return UpstreamError(f"malformed response from the replica ({error.message})")
    return UpstreamError(f"{type(error).__name__}: {error}")
