"""Serving metrics from recorded requests, with ``vllm bench serve``'s definitions.

- TTFT: request sent → first text-bearing chunk.
- TPOT: (E2EL − TTFT) / (output tokens − 1), per request with more than one output token.
- ITL: the gaps between consecutive text-bearing chunks, pooled over all requests.
- E2EL: request sent → stream ended.
Throughputs divide by the benchmark's wall time. Output tokens come from the server's usage,
falling back to the number of text chunks when a server sends no usage.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtests.serving.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Distribution:
    """Milliseconds: mean, median, std and the chosen percentiles."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Iterable[float]) -> Distribution:
        if not values_s:
            return cls(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
        ms = np.asarray(values_s, dtype=float) * 1000
        return cls(
            float(ms.mean()),
            float(np.median(ms)),
            float(ms.std()),
            {p: float(np.percentile(ms, p)) for p in percentiles},
        )

    def as_json(self, name: str) -> dict[str, float]:
        out = {f"mean_{name}_ms": self.mean, f"median_{name}_ms": self.median, f"std_{name}_ms": self.std}
        out.update({f"p{percentile_label(p)}_{name}_ms": value for p, value in self.percentiles.items()})
        return out


def percentile_label(percentile: float) -> str:
    return str(int(percentile)) if float(percentile).is_integer() else str(percentile)


@dataclass
class ServingMetrics:
    completed: int
    failed: int
    skipped: int  # later turns never sent because an earlier turn of their conversation failed
    duration_s: float
    total_input: int
    total_output: int
    cached_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float  # most output tokens in any one-second window, per second
    peak_concurrency: int
    latencies: dict[str, Distribution]
    requests_per_replica: dict[str, int] = field(default_factory=dict)
    predicted_cached_tokens: int | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def cached_ratio(self) -> float:
        """Prompt tokens the server reported served from cache / all prompt tokens."""
        return self.cached_tokens / self.total_input if self.total_input else 0.0

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "skipped": self.skipped,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "cached_tokens": self.cached_tokens,
            "cached_token_ratio": self.cached_ratio,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.peak_output_throughput,
            "max_concurrent_requests": self.peak_concurrency,
            "requests_per_replica": self.requests_per_replica,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "errors": self.errors[:20],
        }
        for name, distribution in self.latencies.items():
            out.update(distribution.as_json(name))
        return out


def output_tokens(record: RequestRecord) -> int:
    return record.completion_tokens if record.completion_tokens is not None else len(record.chunk_times)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Iterable[float],
    expected_requests: int | None = None,
) -> ServingMetrics:
    percentiles = list(percentiles)
    done = [r for r in records if r.ok]
    ttfts, tpots, itls, e2els = [], [], [], []
    for record in done:
        e2el = record.end - record.start
        e2els.append(e2el)
        if record.first_token is None:
            continue  # a request that legitimately produced no text (e.g. EOS first) has no TTFT
        ttft = record.first_token - record.start
        ttfts.append(ttft)
        tokens = output_tokens(record)
        if tokens > 1:
            tpots.append((e2el - ttft) / (tokens - 1))
        itls.extend(b - a for a, b in zip(record.chunk_times, record.chunk_times[1:], strict=False))
    total_input = sum(r.prompt_tokens or 0 for r in done)
    total_output = sum(output_tokens(r) for r in done)
    predicted = [r.predicted_cached_tokens for r in done if r.predicted_cached_tokens is not None]
    duration = max(duration_s, 1e-9)
    return ServingMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        skipped=max(0, (expected_requests or len(records)) - len(records)),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        cached_tokens=sum(r.cached_tokens or 0 for r in done),
        request_throughput=len(done) / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        peak_output_throughput=_peak_output_per_second(done),
        peak_concurrency=peak_concurrency(records),
        latencies={
            "ttft": Distribution.of(ttfts, percentiles),
            "tpot": Distribution.of(tpots, percentiles),
            "itl": Distribution.of(itls, percentiles),
            "e2el": Distribution.of(e2els, percentiles),
        },
        requests_per_replica=dict(Counter(r.replica for r in done if r.replica is not None)),
        predicted_cached_tokens=sum(predicted) if predicted else None,
        errors=[r.error for r in records if r.error is not None],
    )


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at any instant (sweep over start/end events)."""
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def _peak_output_per_second(records: Sequence[RequestRecord]) -> float:
    """Output tokens in the busiest whole second. A chunk may carry several tokens: a request's
    tokens are spread evenly over its chunks."""
    if not records:
        return 0.0
    origin = min(r.start for r in records)
    per_second: Counter[int] = Counter()
    for record in records:
        if not record.chunk_times:
            continue
        share = output_tokens(record) / len(record.chunk_times)
        for when in record.chunk_times:
            per_second[math.floor(when - origin)] += share
    return max(per_second.values(), default=0.0)
