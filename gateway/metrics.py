"""The gateway's Prometheus metrics: what it routed where, and how well its predictions held."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
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
