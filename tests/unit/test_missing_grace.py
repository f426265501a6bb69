"""When replicas missing from a poll stay: a real departure drops at once, a Redis fault does not."""

from __future__ import annotations

from gateway.index.grace import MissingGrace


def test_one_replica_expiring_alone_is_dropped_at_once() -> None:
    grace = MissingGrace(seconds=5, poll_interval=0.5)
    grace.polled(0.0, set(), 3)
    grace.polled(0.5, {"a"}, 3)
    assert not grace.keeps("a", frozenset({"a"}), 0.5)


def test_most_expiring_together_are_kept_for_the_grace() -> None:
    grace = MissingGrace(seconds=5, poll_interval=0.5)
    grace.polled(0.0, set(), 3)
    grace.polled(0.5, {"a", "b"}, 3)
    expired = frozenset({"a", "b"})
    assert grace.keeps("a", expired, 0.5) and grace.keeps("b", expired, 5.4)
    assert not grace.keeps("a", expired, 5.6)
    assert not grace.keeps("c", expired, 1.0), "one that deregistered (not expired) is not kept"


def test_expiries_after_a_stall_of_this_gateway_are_kept() -> None:
    grace = MissingGrace(seconds=5, poll_interval=0.5)
    grace.polled(0.0, set(), 2)
    grace.polled(4.0, {"a"}, 2)  # 4 s without a poll: Redis was stuck, not the replica
    assert grace.keeps("a", frozenset({"a"}), 4.0)


def test_a_late_fast_poll_is_not_a_stall() -> None:
    """A busy host delays a 0.1 s poll by 0.4 s: too short for a stall to expire a heartbeat."""
    grace = MissingGrace(seconds=5, poll_interval=0.1)
    grace.polled(0.0, set(), 2)
    grace.polled(0.5, {"a"}, 2)
    assert not grace.keeps("a", frozenset({"a"}), 0.5)


def test_a_redis_restart_keeps_every_missing_replica() -> None:
    grace = MissingGrace(seconds=5, poll_interval=0.5)
    grace.restarted(10.0)
    assert grace.keeps("gone-from-the-empty-redis", frozenset(), 14.0)
    assert not grace.keeps("gone-from-the-empty-redis", frozenset(), 15.5)


def test_replicas_kept_by_a_grace_leave_when_it_ends() -> None:
    """Their heartbeats never came back: the grace's end must not start another for them."""
    grace = MissingGrace(seconds=5, poll_interval=0.5)
    grace.polled(0.0, set(), 2)
    expired = frozenset({"a", "b"})
    for at in (0.5, 1.0, 5.0, 5.5, 6.0):
        grace.polled(at, set(expired), 2)
    assert not grace.keeps("a", expired, 6.0) and not grace.keeps("b", expired, 6.0)


def test_a_replica_that_refreshed_is_graced_again_after_a_later_fault() -> None:
    grace = MissingGrace(seconds=5, poll_interval=0.5)
    grace.polled(0.0, set(), 2)
    grace.polled(0.5, {"a", "b"}, 2)
    grace.polled(1.0, set(), 2)  # both heartbeats back
    grace.polled(20.0, set(), 2)
    grace.polled(20.5, {"a", "b"}, 2)
    assert grace.keeps("a", frozenset({"a", "b"}), 21.0)
