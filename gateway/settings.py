"""Everything a gateway can be told, with its default: the one place each default is written.

The fields with a flag are ``kvroute gateway``'s options (``kvroute.settings``: flag, help and
environment fallback beside the default); the others are set only from code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.health import DEFAULT_EJECT_AFTER, DEFAULT_PROBE_INTERVAL_S
from gateway.rate_limit import KeyRateLimits
from kvroute.http import RequestLimits
from kvroute.protocol import DEFAULT_PREFIX
from kvroute.settings import option

POLICIES = ("kv", "round-robin", "least-loaded", "random", "session")  # gateway.policies
KEYS = "access keys"  # the help's group of the key options


@dataclass
class GatewaySettings:
    # None: no index, replicas from ``replicas`` alone (load-only routing)
    redis_url: str | None = option(
        None,
        "--redis",
        "redis://HOST:PORT/DB the replicas publish to (default: none, then --replica is needed)",
    )
    replicas: tuple[str, ...] = option(
        (),
        "--replica",
        "a replica known without Redis (repeatable; default: none): a fallback with --redis, the"
        " only source without",
        metavar="URL",
    )
    # consecutive failures that take a replica out of rotation; between health probes of ejected ones
    eject_after: int = option(
        DEFAULT_EJECT_AFTER, "--eject-after", "consecutive failures that eject a replica"
    )
    probe_interval_s: float = option(
        DEFAULT_PROBE_INTERVAL_S, "--probe-interval", "seconds between probes of ejected replicas"
    )
    redis_prefix: str = option(DEFAULT_PREFIX, "--redis-prefix", "key prefix in Redis")
    poll_interval_s: float = option(
        0.5, "--poll-interval", "seconds between reads of the replicas' heartbeats"
    )
    policy: str = option(
        "kv",
        "--policy",
        "kv: cached prefix against load; session: sticky on x-session-id, else kv",
        choices=POLICIES,
    )
    lam: float = option(1.0, "--lam", "kv policy: weight of load against uncached tokens")
    max_queue: int | None = option(
        None, "--max-queue", "per-replica cap on waiting + in-flight requests (default: no cap)"
    )
    # how long routed blocks count as held before the replica's events confirm them
    prediction_ttl_s: float = option(2.0, "--prediction-ttl", "seconds routed blocks count as cached")
    # how long a replica's answer counts as load to other requests: its conversation's next turn
    # may be on its way (gateway.fleet.replica.Flights.awaited)
    expect_return_s: float = option(
        2.0, "--expect-return", "seconds an answered request counts as one sequence on its replica"
    )
    # --max-body-bytes, --body-timeout, --max-prompt-chars (the replica's flags too)
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    api_keys: tuple[str, ...] = option(  # see gateway.auth
        (),
        "--api-key",
        "Bearer key clients must send on /v1 (repeatable; default: env KVROUTE_API_KEYS,"
        " comma-separated; none: /v1 is open)",
        metavar="KEY",
        env="KVROUTE_API_KEYS",
        group=KEYS,
    )
    admin_key: str | None = option(
        None,
        "--admin-key",
        "Bearer key for /admin (default: env KVROUTE_ADMIN_KEY; none: the admin API is off)",
        metavar="KEY",
        env="KVROUTE_ADMIN_KEY",
        group=KEYS,
    )
    rate_limit: float | None = option(
        None,
        "--rate-limit",
        "requests a second each data key may send on average; 429 with retry-after above it"
        " (default: no limit)",
        group=KEYS,
    )
    rate_burst: int = option(
        20, "--rate-burst", "requests a data key may send at once under --rate-limit", group=KEYS
    )
    metrics_key_required: bool = option(
        False, "--metrics-key-required", "/metrics needs a data or admin key", group=KEYS
    )
    replica_key: str | None = option(  # sent on every call to a replica
        None,
        "--replica-key",
        "Bearer key sent to the replicas (their --api-key; default: env KVROUTE_REPLICA_KEY)",
        metavar="KEY",
        env="KVROUTE_REPLICA_KEY",
        group=KEYS,
    )
    upstream_timeout_s: float = option(
        600.0,
        "--upstream-timeout",
        "seconds the gateway waits for any one read from a replica (a whole answer's, or a stream's"
        " next bytes) before it gives the request up",
    )
    ttfb_timeout_s: float = option(
        60.0,
        "--ttfb-timeout",
        "seconds a stream may wait for its first bytes from a replica; then the next replica gets it",
    )
    tokenizer_cache_bytes: int = 256 * 1024 * 1024  # token ids cached for repeated and multi-turn chats

    @property
    def rate_limits(self) -> KeyRateLimits | None:
        return None if self.rate_limit is None else KeyRateLimits(self.rate_limit, self.rate_burst)
