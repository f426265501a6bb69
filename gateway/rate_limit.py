"""Per-key rate limits on ``/v1``: a token bucket for each data key.

Each key may send ``rate`` requests a second on average and ``burst`` at once; a request with
no token left gets 429 ``rate_limit_exceeded`` with ``retry-after`` (whole seconds until the
next token), before it costs anything. Buckets are kept per gateway process (several gateways
each give a key its rate) and keyed by the key's digest, so no key is held twice in memory.
"""

from __future__ import annotations

import hashlib
import math
import time

from kvroute.openai_api.errors import APIError


class KeyRateLimits:
    """``rate`` requests a second per key on average, ``burst`` at once (at least 1)."""

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a rate limit needs a positive rate and a burst of at least 1")
        self.rate = rate
        self.burst = burst
        self._buckets: dict[bytes, tuple[float, float]] = {}  # key digest -> (tokens, at)

    def refusal(self, key: bytes, now: float | None = None) -> APIError | None:
        """Takes one token from ``key``'s bucket; the 429 to answer when there is none."""
        now = time.monotonic() if now is None else now
        digest = hashlib.blake2b(key, digest_size=16).digest()
        tokens, at = self._buckets.get(digest, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens >= 1:
            self._buckets[digest] = (tokens - 1, now)
            return None
        self._buckets[digest] = (tokens, now)
        wait = math.ceil((1 - tokens) / self.rate)
        return APIError(
            f"Rate limit reached for this key: {self.rate:g} requests a second, {self.burst} at once."
            f" Retry in {wait} s.",
            429,
            code="rate_limit_exceeded",
            headers={"retry-after": str(wait)},
        )
