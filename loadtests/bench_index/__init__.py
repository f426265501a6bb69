"""The Redis cache index, end to end: publish and apply throughput, lookup latency, bootstrap, memory.

Everything runs against a private redis-server on a free loopback port (``launcher.local_redis``):

1. **Publish throughput**: one ``KVPublisher`` is handed N stored hashes (outbox appends of
   ``APPEND_HASHES``); timed from the first append until Redis's blocks set holds all N.
   Meanwhile the heartbeat's TTL is sampled: a long burst must not starve heartbeats, or every
   mirror would drop the replica when one expires.
2. **Mirror apply rate**: an ``IndexMirror`` in a process of its own (as on a gateway), bootstrapped
   and tailing before the first append; timed from the first stored entry's publish time to its
   index holding all N, with its lag gauge at that moment. That rate cannot beat the publisher's,
   so a second mirror, paused meanwhile, then catches up from the stream alone.
3. **Memory per indexed block** and 4. **bootstrap time** of fresh mirrors over N blocks that
   ``write_corpus`` puts straight into Redis with the schema, spread over R replicas as chains of
   shared prefixes (``build_corpus``).
5. **Lookup latency** on the index the last bootstrap built: the order Redis hands the sets over
   in is the order a gateway's dicts are filled in. The prompt is fully held by a few replicas, so
   the walk covers all its blocks (the worst case); a prompt missing at block 0 is the best case.

Full run (half a minute; run it on a quiet machine)::

    python -m loadtests.bench_index

``--quick`` shrinks every size for a smoke run.

The modules: ``settings`` (sizes, targets, names), ``stream`` (1 and 2), ``corpus`` (the index
3 to 5 measure), ``lookups`` (3 to 5), ``tables`` (checks and the table), ``bench`` (options and
the :class:`loadtests.harness.ComponentBenchmark`).
"""

from loadtests.bench_index.bench import BENCHMARK, main
from loadtests.bench_index.settings import BOOTSTRAP_REPEATS, FULL, QUICK, Settings
from loadtests.bench_index.tables import TARGET_TEXT

__all__ = ["BENCHMARK", "BOOTSTRAP_REPEATS", "FULL", "QUICK", "TARGET_TEXT", "Settings", "main"]
