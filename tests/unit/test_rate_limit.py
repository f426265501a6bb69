"""The per-key token bucket: a burst at once, then the rate, each key on its own."""

from __future__ import annotations

import pytest

from gateway.rate_limit import KeyRateLimits


def test_a_key_gets_its_burst_then_its_rate_and_a_retry_after() -> None:
    limits = KeyRateLimits(rate=2.0, burst=3)
    assert [limits.refusal(b"k", now=10.0) for _ in range(3)] == [None, None, None]
    refused = limits.refusal(b"k", now=10.0)
    assert refused is not None and refused.status == 429 and refused.code == "rate_limit_exceeded"
    assert refused.headers == {"retry-after": "1"}  # half a second to the next token, rounded up
    assert limits.refusal(b"other", now=10.0) is None  # every key has its own bucket
    assert limits.refusal(b"k", now=10.5) is None  # a token came back
    assert limits.refusal(b"k", now=10.5) is not None
    assert [limits.refusal(b"k", now=100.0) for _ in range(4)].count(None) == 3  # refilled to the burst only


def test_slow_rates_wait_whole_seconds() -> None:
    limits = KeyRateLimits(rate=0.1, burst=1)
    assert limits.refusal(b"k", now=0.0) is None
    refused = limits.refusal(b"k", now=1.0)
    assert refused is not None and refused.headers == {"retry-after": "9"}


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (1, 0)])
def test_nonsense_limits_are_refused(rate: float, burst: int) -> None:
    with pytest.raises(ValueError):
        KeyRateLimits(rate, burst)
