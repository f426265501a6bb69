"""The gateway's Prometheus metrics: what it routed where, and how well its predictions held.

The request path records each request twice, through :meth:`GatewayMetrics.routed` (a replica
answered: where, by which policy, with what prediction) and :meth:`GatewayMetrics.answered` (its
usage came back: the real cached tokens); both keep the replica's :class:`ReplicaStats` too. They
take labelled children built once per label values: ``labels()`` itself validates and locks on
every call, a cost paid several times per request otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.fleet.replica import Replica
from gateway.proxy.relay import cached_tokens

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ModelMetrics:
    """One model's labelled children."""

    __slots__ = ("cached_tokens", "e2e", "predicted_cached_tokens", "prompt_tokens", "retries", "ttft")

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.predicted_cached_tokens = metrics.predicted_cached_tokens.labels(model)
        self.cached_tokens = metrics.cached_tokens.labels(model)
        self.retries = metrics.retries.labels(model)
        self.ttft = metrics.ttft.labels(model)
        self.e2e = metrics.e2e.labels(model)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._models: dict[str, ModelMetrics] = {}
        self._requests: dict[tuple[str, str, str, int], Counter] = {}
        self.requests = Counter(
            "kvroute_gateway_requests",
            "Requests by model, replica, policy and HTTP status",
            ["model", "replica", "policy", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "kvroute_gateway_time_to_first_token_seconds",
            "Gateway-side time to the first streamed event",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "kvroute_gateway_e2e_request_latency_seconds",
            "Gateway-side request latency",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.routing = Histogram(
            "kvroute_gateway_routing_seconds",
            "Time to tokenize, look up and choose a replica",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvroute_gateway_prompt_tokens", "Prompt tokens routed", ["model"], registry=registry
        )
        self.predicted_cached_tokens = Counter(
            "kvroute_gateway_predicted_cached_tokens",
            "Prompt tokens the gateway expected the chosen replica to serve from cache",
            ["model"],
            registry=registry,
        )
        self.cached_tokens = Counter(
            "kvroute_gateway_cached_tokens",
            "Prompt tokens replicas reported as served from cache (usage.cached_tokens)",
            ["model"],
            registry=registry,
        )
        self.fingerprint_mismatches = Counter(
            "kvroute_gateway_fingerprint_mismatches",
            "Routing decisions that scored a replica without cache credit: its tokenizer differs",
            ["model", "replica"],
            registry=registry,
        )
        self.retries = Counter(
            "kvroute_gateway_retries",
            "Requests re-sent to another replica before any byte reached the client",
            ["model"],
            registry=registry,
        )
        self.ejections = Counter(
            "kvroute_gateway_ejections",
            "Replicas taken out of rotation after consecutive failures",
            ["replica"],
            registry=registry,
        )

    def model(self, model: str) -> ModelMetrics:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(self, model)
        return found

    def fingerprint_mismatch(self, model: str, replica_ids: Iterable[str]) -> None:
        """A decision scored these replicas of ``model`` without cache credit (another tokenizer)."""
        for replica_id in replica_ids:
            self.fingerprint_mismatches.labels(model, replica_id).inc()

    def routed(
        self,
        model: str,
        replica: Replica,
        policy: str,
        status: int,
        *,
        prompt_tokens: int,
        predicted: int,
        retries: int,
    ) -> ModelMetrics:
        """``replica`` answers a request with ``status``, ``predicted`` of its ``prompt_tokens``
        expected cached there, after ``retries`` other candidates failed. Returns the model's
        children, for the rest of the request."""
        metrics = self.model(model)
        self.requests_for(model, replica.replica_id, policy, status).inc()
        if retries:
            metrics.retries.inc(retries)
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.predicted_cached_tokens.inc(predicted)
        replica.stats.requests += 1
        return metrics

    def answered(
        self, metrics: ModelMetrics, replica: Replica, predicted: int, usage: dict[str, Any] | None
    ) -> None:
        """Records the real outcome of a routing decision, when the replica's usage says it."""
        tokens = cached_tokens(usage)
        if tokens is None or usage is None:
            return
        metrics.cached_tokens.inc(tokens)
        stats = replica.stats
        stats.usage_reports += 1
        prompt_tokens = usage.get("prompt_tokens")
        stats.prompt_tokens += prompt_tokens if isinstance(prompt_tokens, int) else 0
        stats.predicted_cached_tokens += predicted
        stats.cached_tokens += tokens

    def requests_for(self, model: str, replica: str, policy: str, status: int) -> Counter:
        """The ``kvroute_gateway_requests`` child for these labels."""
        key = (model, replica, policy, status)
        found = self._requests.get(key)
        if found is None:
            found = self._requests[key] = self.requests.labels(model, replica, policy, str(status))
        return found
