"""The fleet's background checks: probing ejected replicas back, and discovering static ones.

* **Ejection** (the request path reports each outcome to :class:`gateway.fleet.fleet.Fleet`): after
  ``eject_after`` failures in a row a replica is ejected, and routing skips it while any other
  replica of its model is left. Every ``probe_interval_s``, each ejected replica is probed
  (``GET {url}/health``) and brought back when it answers 200. A replica whose heartbeat expires is
  dropped by the index mirror already.
* **Static replicas**: URLs given on the command line (``--replica URL``). Each one's model,
  tokenizer fingerprint and block size are discovered from the replica itself (``GET /v1/models``,
  ``GET /kvroute/tokenizer``) at start and on every probe round; one that does not answer is not
  listed until it does. Its id is ``host:port`` of its URL (``kvroute.protocol.replica_id_for``),
  the id a replica registers in Redis by default, so a replica known both ways is one replica (for
  draining too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from gateway.fleet.fleet import Fleet
from gateway.fleet.replica import StaticReplica

log = logging.getLogger("kvroute.gateway.health")

DEFAULT_EJECT_AFTER = 3
DEFAULT_PROBE_INTERVAL_S = 1.0


class HealthChecks:
    """One round every ``probe_interval_s``: discover the static replicas, probe the ejected ones."""

    def __init__(
        self, http: httpx.AsyncClient, fleet: Fleet, *, probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    ) -> None:
        if probe_interval_s <= 0:
            raise ValueError("probe_interval_s must be > 0")
        self._http = http
        self.fleet = fleet
        self.probe_interval_s = probe_interval_s
        self._task: asyncio.Task[None] | None = None

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
                ejected = self.fleet.ejected().items()
                await asyncio.gather(self._discover_all(), *(self._probe(rid, url) for rid, url in ejected))
            except asyncio.CancelledError:
                raise
            except Exception:  # a background task: log, go on
                log.exception("replica health round failed")

    async def _probe(self, replica_id: str, url: str) -> None:
        try:
            response = await self._http.get(url + "/health", timeout=max(0.5, self.probe_interval_s))
        except httpx.HTTPError:
            return
        if response.status_code == 200:
            self.fleet.restored(replica_id)

    async def _discover_all(self) -> None:
        if self.fleet.static_urls:
            await asyncio.gather(*(self._discover(url) for url in self.fleet.static_urls))

    async def _discover(self, url: str) -> None:
        """Model (``/v1/models``), then fingerprint and block size (``/kvroute/tokenizer``, only when
        the model is new or the replica was away: the tokenizer files are large)."""
        known = self.fleet.static_answer(url)
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
            if self.fleet.discovered(url, None) is not None:
                log.warning("static replica %s unreachable (%s: %s)", url, type(error).__name__, error)
            return
        if known is None:
            log.info("static replica %s serves %s", url, model)
        self.fleet.discovered(url, StaticReplica(url, model, fingerprint, block_size))
