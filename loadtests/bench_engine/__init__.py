"""Our replica engine against transformers ``generate`` on the same model, dtype and cores.

Measures, per dtype: aggregate decode tok/s at several concurrency levels, time to first token
for a long prompt cold and with its prefix cached, batch-1 ms/step against the memory-bandwidth
floor, and memory (peak RSS, and RSS across many short requests, to catch leaks).

Each (engine, dtype) group runs in its own subprocess (:mod:`loadtests.bench_engine.worker`), one
at a time: the groups never compete for the cores, and each peak RSS belongs to one engine only.
The parent only measures memory bandwidth, then collects, checks and prints.

Full run (minutes; run it on a quiet machine)::

    python -m loadtests.bench_engine

``--quick`` shrinks every size for a smoke run (the test uses it on a tiny model).

The modules: ``settings`` (sizes, targets), ``groups`` (the measurements, run in the worker),
``tables`` (ratios, checks, the table), ``bench`` (options, orchestration: the
:class:`loadtests.harness.ComponentBenchmark`).
"""

from loadtests.bench_engine.bench import BENCHMARK, main
from loadtests.bench_engine.settings import FULL, QUICK, Settings
from loadtests.bench_engine.tables import TARGET_TEXT

__all__ = ["BENCHMARK", "FULL", "QUICK", "TARGET_TEXT", "Settings", "main"]
