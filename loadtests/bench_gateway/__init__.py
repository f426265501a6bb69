"""Gateway overhead: the same chat sent straight to a replica and through the gateway, same run.

The replica answers instantly: by default the ``sim`` backend with its ``instant`` profile (the real
replica server, tokenizer, scheduler, radix cache and Redis reporter, with a forward pass that
costs nothing), as the gateway issue asks; ``--replica-engine torch`` serves a tiny random llama
test model instead (``replica.tools.tiny_models``, the smallest real engine response). Either serves the
tiny test model's tokenizer and config, with ``max_tokens=1``. Every request is
the *same* 2,000-character chat (a fixed system + user message) on both sides: after the warm-up
its prompt is in the replica's prefix cache for direct and gateway requests alike, so the cache
favours neither side, and the gateway still tokenizes the whole prompt and walks its whole block
chain in the index (every block matches: the longest lookup).

Measured, for non-streaming and streaming (``stream: true``, timed to the last byte) chats:

1. **Added latency** at concurrency 1: direct and gateway requests strictly alternated, so drift
   hits both; p50/p99 of each side, and gateway minus direct (sglang-router gets its own
   alternation with direct requests, never interleaved with the gateway's).
2. **Proxy CPU per request**: utime+stime of the gateway process (``/proc/PID/stat``) around a
   batch of gateway requests, divided by its size (sequential batch, and the concurrent one).
3. **Requests/s at concurrency 32** (32 workers sharing one client: ``gateway.upstream``, the
   cheapest of the clients in 5, since the load generator shares the cores), the sides' phases
   alternated over several rounds; with the CPU share (% of one core) of the side's proxy, the
   replica and this load generator during each phase, since all share the machine's cores and the
   replica (a real engine) or the client may be the bottleneck rather than the gateway.
   ``1e6 / CPU µs per request`` is a proxy's CPU-bound ceiling per process.

If ``sglang_router`` is importable it is measured the same way as a reference (a Rust router in
front of the same replica, its CPU too); otherwise its column says "not installed".

4. **Tokenizing a multi-turn chat**, in this process with the gateway's own tokenizer registry and
   the test model's tokenizer (SmolLM2's template and pre-tokenizer): µs to get the ids of turn 10
   of a ~4,000-token chat from scratch (render + encode, what a replica does), with turn 9 already
   cached (what the gateway does on a chat's next turn: only the new turn is tokenized), and for a
   verbatim repeat.
5. **The upstream HTTP client alone**: CPU µs per request of the client the gateway proxies with
   (``gateway.upstream``: a Protocol per connection around httptools' parser), of aiohttp (the client it
   replaced there) and of httpx (the one before), each POSTing the
   2,000-character chat to an instant HTTP server (canned answer, its own thread and event loop) on uvloop, at
   concurrency 1 and 32, non-streaming and streaming; CPU is this thread's alone.

Full run (a couple of minutes; run it on a quiet machine)::

    python -m loadtests.bench_gateway

``--quick`` shrinks every size for a smoke run.

The modules: ``settings`` (sizes, targets, the request), ``services`` (the replica, gateway and
sglang-router processes), ``load`` (the load generator: 1 to 3), ``tokenization`` (4), ``clients``
(5), ``tables`` (checks and tables), ``bench`` (options and the
:class:`loadtests.harness.ComponentBenchmark`).
"""

from loadtests.bench_gateway.bench import BENCHMARK, main
from loadtests.bench_gateway.settings import (
    CONCURRENCY,
    FULL,
    MODES,
    QUICK,
    TOKENIZE_TOKENS,
    TOKENIZE_TURNS,
    Settings,
)

__all__ = [
    "BENCHMARK",
    "CONCURRENCY",
    "FULL",
    "MODES",
    "QUICK",
    "TOKENIZE_TOKENS",
    "TOKENIZE_TURNS",
    "Settings",
    "main",
]
