"""Replica health as the gateway sees it: ejection after consecutive failures, probing back, and
replicas known without Redis (``--replica URL``).

* **Ejection**: the request path reports each replica's outcome (:meth:`ReplicaHealth.failed` for a
  connect error, a 503 or a stream that broke; :meth:`ReplicaHealth.succeeded` otherwise). After
  ``threshold`` failures in a row the replica is ejected: routing skips it while any other replica
  of its model is left. A background task probes each ejected replica (``GET {url}/health``) every
  ``probe_interval_s`` and brings it back when it answers 200. A replica whose heartbeat expires is
  dropped by the index mirror already.
* **Static replicas**: URLs given on the command line. Each one's model, tokenizer fingerprint and
  block size are discovered from the replica itself (``GET /v1/models``, ``GET /kvroute/tokenizer``)
  at start and on every probe round; one that does not answer is not listed until it does. Its id
  is ``host:port`` of its URL (:func:`replica_id_for`), the id a replica registers in Redis by
  default, so a replica known both ways is one replica (for draining too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import httpx
from prometheus_client import Counter

from gateway.index_mirror import ReplicaInfo
from kvroute.protocol import replica_id_for

log = logging.getLogger("kvroute.gateway.health")

DEFAULT_EJECT_AFTER = 3
DEFAULT_PROBE_INTERVAL_S = 1.0
STATIC_EPOCH = "static"  # the epoch of a static replica's ReplicaInfo (it has no heartbeat)


class ReplicaHealth:
    """Consecutive-failure counts, the ejected set, and the probe that brings replicas back."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        eject_after: int = DEFAULT_EJECT_AFTER,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        ejections: Counter | None = None,
        static_urls: Sequence[str] = (),
    ) -> None:
        if eject_after < 1 or probe_interval_s <= 0:
            raise ValueError("eject_after must be >= 1 and probe_interval_s > 0")
        self._http = http
        self.eject_after = eject_after
        self.probe_interval_s = probe_interval_s
        self._ejections = ejections
        self._failures: dict[str, int] = {}
        self._ejected: dict[str, str] = {}  # replica id -> url to probe
        self.static_urls = [url.rstrip("/") for url in static_urls]
        self._static: dict[str, ReplicaInfo] = {}  # url -> what it answered last
        self._task: asyncio.Task[None] | None = None

    # -- the request path's reports ----------------------------------------------------------------

    def succeeded(self, replica_id: str) -> None:
        self._failures.pop(replica_id, None)

    def failed(self, replica_id: str, url: str, why: str) -> None:
        count = self._failures.get(replica_id, 0) + 1
        self._failures[replica_id] = count
        if count >= self.eject_after and replica_id not in self._ejected:
            self._ejected[replica_id] = url
            if self._ejections is not None:
                self._ejections.labels(replica_id).inc()
            log.warning("replica %s ejected after %d failures in a row (last: %s)", replica_id, count, why)

    def is_ejected(self, replica_id: str) -> bool:
        return replica_id in self._ejected

    @property
    def ejected(self) -> set[str]:
        return set(self._ejected)

    def static_ids(self) -> dict[str, str]:
        """Replica id (``host:port``) -> URL of every static replica, answering or not."""
        return {replica_id_for(url): url for url in self.static_urls}

    def static_replicas(self, model: str | None = None) -> list[ReplicaInfo]:
        """The static replicas that answered their last discovery (of ``model``), sorted by id."""
        infos = sorted(self._static.values(), key=lambda info: info.replica_id)
        return [info for info in infos if model is None or info.model == model]

    # -- background ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Discovers the static replicas once (so the gateway starts warm) and starts probing."""
        await self._discover_all()
        self._task = asyncio.create_task(self._run(), name="kvroute-replica-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await asyncio.gather(
                    self._discover_all(), *(self._probe(rid, url) for rid, url in list(self._ejected.items()))
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # a background task: log, go on
                log.exception("replica health round failed")

    async def _probe(self, replica_id: str, url: str) -> None:
        try:
            response = await self._http.get(url + "/health", timeout=max(0.5, self.probe_interval_s))
        except httpx.HTTPError:
            return
        if response.status_code == 200 and self._ejected.pop(replica_id, None) is not None:
            self._failures.pop(replica_id, None)
            log.warning("replica %s answers its health probe again; routing to it", replica_id)

    async def _discover_all(self) -> None:
        if self.static_urls:
            await asyncio.gather(*(self._discover(url) for url in self.static_urls))

    async def _discover(self, url: str) -> None:
        """Model (``/v1/models``), then fingerprint and block size (``/kvroute/tokenizer``, only when
        the model is new or the replica was away: the tokenizer files are large)."""
        known = self._static.get(url)
        timeout = max(1.0, self.probe_interval_s)
        try:
            models = (await self._http.get(url + "/v1/models", timeout=timeout)).raise_for_status().json()
            model = models["data"][0]["id"]
            if known is not None and known.model == model:
                return
            response = await self._http.get(url + "/kvroute/tokenizer", timeout=max(5.0, timeout))
            tokenizer = response.raise_for_status().json()
            fingerprint, block_size = str(tokenizer["fingerprint"]), int(tokenizer["block_size"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
            if self._static.pop(url, None) is not None:
                log.warning("static replica %s unreachable (%s: %s)", url, type(error).__name__, error)
            return
        if known is None:
            log.info("static replica %s serves %s", url, model)
        self._static[url] = ReplicaInfo(
            replica_id=replica_id_for(url),
            url=url,
            model=model,
            fingerprint=fingerprint,
            block_size=block_size,
            epoch=STATIC_EPOCH,
            kv_total_pages=0,
            kv_used_pages=0,
            running=0,
            waiting=0,
            waiting_prefill_tokens=0,
            ts=0.0,
        )
