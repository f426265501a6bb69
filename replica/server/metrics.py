"""Prometheus metrics under vLLM's names and labels, so vLLM dashboards and autoscalers work as is.

Engine state (queue gauges, KV usage, prefix-cache and preemption counters) is read from
``engine.stats()`` at scrape time by a custom collector: nothing to keep in sync, and a scrape
always sees the engine's own totals. Per-request latencies and token counts are observed by the
serving layer through :class:`RequestTracker`. Every app gets its own ``CollectorRegistry``, so
several apps can live in one process (tests) without clashing on the global registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replica.engine.llm_engine import EngineStats
from replica.engine.outputs import RequestOutput

LABELS = ("model_name", "engine")  # vLLM's labels; a replica is always engine "0"
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's buckets, so histogram_quantile over mixed fleets stays comparable.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _EngineStatsCollector(Collector):
    """Mirrors ``EngineStats`` as vLLM's gauges and counters on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], label_values: list[str]) -> None:
        self._stats = stats
        self._label_values = label_values

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                stats.num_running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
        )
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_cache_hits,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                stats.num_preemptions,
            ),
        )
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(self._label_values, value)
            yield family
        # vLLM's info gauge (always 1): the pool size in its labels, e.g. for ``kvroute bridge``
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "engine"],
        )
        info.add_metric([str(stats.block_size), str(stats.kv_total_pages), self._label_values[1]], 1)
        yield info
        for name, documentation, value in counters:
            family = CounterMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(self._label_values, value)
            yield family


class ReplicaMetrics:
    """One app's registry: the engine mirror plus the request-level series serving observes."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = [model_name, "0"]
        self.registry.register(_EngineStatsCollector(stats, labels))

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, LABELS, registry=self.registry).labels(*labels)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, LABELS, registry=self.registry, buckets=buckets).labels(
                *labels
            )

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        # Every reason exists from the first scrape, as in vLLM, so rate() never misses a start.
        self._request_success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E_BUCKETS
        )

    def count_finished(self, reason: str) -> None:
        """One finished choice; a reason outside vLLM's set counts as abort."""
        self._request_success.get(reason, self._request_success["abort"]).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def track(self) -> RequestTracker:
        """A tracker for one engine request arriving now."""
        return RequestTracker(self)


class RequestTracker:
    """Times one engine request from arrival and counts its tokens and outcome once it ends."""

    def __init__(self, metrics: ReplicaMetrics) -> None:
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._last_token_at: float | None = None
        self._last: RequestOutput | None = None
        self._finish_reasons: dict[int, str] = {}

    def observe(self, output: RequestOutput) -> None:
        """One engine step's output: the first with tokens sets TTFT, later ones are inter-token gaps."""
        self._last = output
        if any(delta.token_ids for delta in output.deltas):
            now = time.perf_counter()
            if self._last_token_at is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
            else:
                self._metrics.inter_token_latency.observe(now - self._last_token_at)
            self._last_token_at = now
        for delta in output.deltas:
            if delta.finish_reason is not None:
                self._finish_reasons[delta.index] = delta.finish_reason

    def close(self, num_choices: int) -> None:
        """The request is over (finished, failed or abandoned); choices that never finished count
        as aborted, like vLLM's aborted requests."""
        metrics = self._metrics
        metrics.e2e_request_latency.observe(time.perf_counter() - self._arrival)
        if self._last is not None:
            metrics.prompt_tokens.inc(self._last.prompt_tokens)
            metrics.generation_tokens.inc(self._last.completion_tokens)
        for index in range(num_choices):
            metrics.count_finished(self._finish_reasons.get(index, "abort"))
