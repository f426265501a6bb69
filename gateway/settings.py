"""Everything a gateway can be told, with its default: the one place each default is written."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.health import DEFAULT_EJECT_AFTER, DEFAULT_PROBE_INTERVAL_S
from kvroute.protocol import DEFAULT_PREFIX


@dataclass
class GatewaySettings:
    redis_url: str | None  # None: no index, replicas from ``replicas`` alone (load-only routing)
    redis_prefix: str = DEFAULT_PREFIX
    policy: str = "kv"
    lam: float = 1.0
    max_queue: int | None = None  # per-replica cap on waiting + in-flight requests
    prediction_ttl_s: float = 2.0  # how long routed blocks count as held before events confirm them
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    poll_interval_s: float = 0.5
    replicas: tuple[str, ...] = ()  # static replica URLs: fallback with Redis, the only source without
    eject_after: int = DEFAULT_EJECT_AFTER  # consecutive failures that take a replica out of rotation
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S  # between health probes of ejected replicas
    api_keys: tuple[str, ...] = ()  # Bearer keys for /v1 (none: open); see gateway.auth
    admin_key: str | None = None  # Bearer key for /admin (none: the admin API is disabled)
    metrics_key_required: bool = False  # /metrics needs a data or admin key
    replica_key: str | None = None  # Bearer key sent on every call to a replica
    tokenizer_cache_bytes: int = 256 * 1024 * 1024  # token ids cached for repeated and multi-turn chats
