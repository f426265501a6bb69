"""The mirror's Prometheus metrics (``kvroute_index_*``): index size, replicas, events, lag, bootstraps."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.index.block_index import BlockIndex


class IndexMetrics:
    def __init__(self, registry: CollectorRegistry, index: BlockIndex) -> None:
        self.blocks = Gauge(
            "kvroute_index_blocks", "Distinct block hashes in the gateway's index", registry=registry
        )
        self.blocks.set_function(lambda: index.size)
        self.replicas = Gauge(
            "kvroute_index_replicas", "Live replicas in the index", ["model"], registry=registry
        )
        self.events = Counter(
            "kvroute_index_events_applied", "Stream entries applied to the index", registry=registry
        )
        self.hashes = Counter(
            "kvroute_index_hashes_applied",
            "Block hashes carried by the stream entries applied",
            registry=registry,
        )
        self.lag = Gauge(
            "kvroute_index_lag_seconds",
            "Now minus the publish time of the last stream entry applied",
            registry=registry,
        )
        self.bootstraps = Counter(
            "kvroute_index_bootstraps",
            "Bootstraps from Redis: start and resync (all models, after an outage or a Redis "
            "restart), new_model and gap (one model whose stream lost entries before they were read)",
            ["reason"],
            registry=registry,
        )
        self.stale = Gauge(
            "kvroute_index_stale",
            "1 while the mirror cannot reach Redis and serves its last state",
            registry=registry,
        )
        self.stale.set(1)
        self._gauged_models: set[str] = set()

    def applied(self, events: int, hashes: int, last_ts: float | None) -> None:
        """One read's entries are applied; ``last_ts``: the publish time of the last one."""
        self.events.inc(events)
        self.hashes.inc(hashes)
        if last_ts is not None:
            self.lag.set(max(0.0, time.time() - last_ts))

    def count_replicas(self, models: Iterable[str]) -> None:
        """Sets the per-model replica gauge from the live replicas' models (one entry each)."""
        counts: dict[str, int] = {}
        for model in models:
            counts[model] = counts.get(model, 0) + 1
        for model in self._gauged_models - counts.keys():
            self.replicas.remove(model)
        for model, count in counts.items():
            self.replicas.labels(model).set(count)
        self._gauged_models = set(counts)
