"""The order the served benchmark's servers take their turns in: no server may keep a place."""

from __future__ import annotations

from itertools import combinations

from loadtests.bench_served.bench import turn_order
from loadtests.bench_served.settings import PREFIX_PASSES

SERVERS = ["kvroute", "gateway", "vllm"]


def test_a_whole_case_puts_every_pair_of_servers_in_both_orders() -> None:
    """The gateway runs on the replica measured direct: always right after it, the two would not
    share what the host does over a pass alike."""
    for turn in range(len(SERVERS)):
        passes = [turn_order(SERVERS, turn, number, whole=True) for number in range(PREFIX_PASSES)]
        assert all(sorted(order) == sorted(SERVERS) for order in passes)
        for a, b in combinations(SERVERS, 2):
            firsts = {order.index(a) < order.index(b) for order in passes}
            assert firsts == {True, False}, (turn, a, b, passes)


def test_waves_rotate_who_goes_first() -> None:
    names = [*SERVERS, "in-process"]
    for turn in range(len(names)):
        waves = [turn_order(names, turn, number, whole=False) for number in range(len(names))]
        assert sorted(order[0] for order in waves) == sorted(names)
        assert all(sorted(order) == sorted(names) for order in waves)
