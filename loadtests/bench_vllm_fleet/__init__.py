"""kvroute's routing over vLLM servers: two vLLM CPU servers, each with a ``kvroute bridge``, behind
one gateway per policy, on the shared-prefix workload with KV pools too small to hold every prefix
on every server. ``kv`` keeps each prefix on one server; ``round-robin`` makes both servers hold
all of them, so they evict and compute prefixes again.

Full run (minutes: the two vLLM servers' start-up is most of it)::

    python -m loadtests.bench_vllm_fleet

The modules: ``settings`` (sizes, targets), ``fleet`` (Redis, the servers, their bridges, a gateway
per policy), ``tables`` (the table and checks), ``bench`` (orchestration).
"""

from loadtests.bench_vllm_fleet.bench import BENCHMARK, main

__all__ = ["BENCHMARK", "main"]
