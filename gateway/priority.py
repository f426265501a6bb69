"""The gateway's CPU priority. Where it shares cores with replicas, every request waits for it twice
(on its way in, and with its first token on the way out), and at the replicas' priority each of
those wake-ups can queue behind an engine's OpenMP threads for a few milliseconds: on a 2-core host,
cache hits of ~85 ms took 3 ms longer through the gateway than direct at the same priority, and
none at nice -10. Its own CPU is ~2 ms a request: what it takes from the engines' threads it took
at nice 0 as well, only later (docs/BENCHMARKS.md)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_NICE = -10


def raise_priority(nice: int) -> None:
    """Lowers the calling thread's nice value to ``nice`` where the system lets it (root or
    CAP_SYS_NICE), before the server starts its threads, which inherit it; a value at or above the
    current one is left alone."""
    current = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux, the calling thread's
    if nice >= current:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        log.info("running at nice %d: nice %d needs root or CAP_SYS_NICE", current, nice)
    else:
        log.info("running at nice %d, ahead of the replicas' threads on shared cores", nice)
