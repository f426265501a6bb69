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
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import redis
from redis.asyncio import Redis

from gateway.block_index import BlockIndex
from gateway.index_mirror import IndexMirror
from kvroute.protocol import DEFAULT_BLOCK_SIZE, PROTOCOL_VERSION, EventKind, Keys, decode_event
from launcher.local_redis import RedisServer
from loadtests.report import add_size_options, chosen_sizes, cpu_model, package_version, publish, warn_if_busy
from loadtests.report import progress as log_progress
from replica.kvcache.events import KVEventOutbox
from replica.publisher import KVPublisher, PublisherConfig

if TYPE_CHECKING:
    from replica.engine.llm_engine import EngineStats

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {"blocks": 1_000_000, "replicas": 64, "prompt_blocks": 512, "lookups": 20_000}
QUICK = {"blocks": 20_000, "replicas": 16, "prompt_blocks": 64, "lookups": 2_000}

MODEL = "bench-model"
FINGERPRINT = "bench"
KEYS = Keys()
PUBLISHER_ID = "bench-publisher:8000"

APPEND_HASHES = 1_000  # hashes per outbox append
CHAIN_BLOCKS = 1_000  # mean chain length: 1,000 chains for 1,000,000 blocks
FULL_MATCH_REPLICAS = 4  # replicas holding the whole measured prompt
PARTIAL_MATCH_REPLICAS = 8  # replicas holding a shorter prefix of it
PREDICTED_REPLICAS = 2  # of the partial ones, predicted to hold it all
MAX_SHARERS = 3  # replicas besides its owner holding a prefix of any other chain
PREDICTION_TTL_S = 3600.0  # outlives the run: no prediction expires mid-measurement
SADD_MEMBERS = 10_000  # members per SADD when writing the corpus
BOOTSTRAP_REPEATS = 3
WARMUP_LOOKUPS = 200
POLL_S = 0.002  # how often completion is polled
FRESH_HEARTBEAT_MS = 1000  # TTL left on a heartbeat refreshed within the last second (defaults: 2 s, 0.5 s)
SECONDS_PER_HASH = 20e-6  # generous deadline slack for the publish and apply phases

LOOKUP_P99_TARGET_US = 100.0
BOOTSTRAP_TARGET_S = 2.0


@dataclass(frozen=True)
class Settings:
    blocks: int
    replicas: int
    prompt_blocks: int
    lookups: int
    out: str


def progress(message: str) -> None:
    log_progress("bench_index", message)


def random_hashes(rng: np.random.Generator, count: int) -> np.ndarray:
    """Uniform 64-bit values: as good as chained xxh3 hashes for dicts, and a million in milliseconds."""
    return np.frombuffer(rng.bytes(8 * count), dtype="<u8")


async def poll_until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_S)


def phase_timeout(blocks: int) -> float:
    return 30 + blocks * SECONDS_PER_HASH


# -- 1 and 2: publish throughput, mirror apply rate -----------------------------------------------


@dataclass(frozen=True)
class _IdleEngine:
    """The EngineStats fields a heartbeat reads; replica.engine.llm_engine itself would import torch."""

    num_running: int = 0
    num_waiting: int = 0
    waiting_prefill_tokens: int = 0
    kv_total_pages: int = 65_536
    kv_used_pages: int = 0
    by_source: ClassVar[dict[str, Any]] = {}


def idle_stats() -> EngineStats:
    return cast("EngineStats", _IdleEngine())


def mirror_process(conn: Connection, redis_url: str, expected: int) -> None:
    """Child process entry: says "ready" once its mirrors are bootstrapped, then sends the results
    of ``_mirror_until_full``."""
    conn.send(asyncio.run(_mirror_until_full(conn, redis_url, expected)))


async def _mirror_until_full(conn: Connection, redis_url: str, expected: int) -> dict[str, float]:
    """Two mirrors, as on a gateway. The live one tails as the hashes are published, so its rate
    is capped by the publisher's; the other is paused until the live one holds them all, then
    catches up from the stream alone, which measures what a mirror can apply.

    The catch-up waits for a fresh publisher heartbeat: the burst can starve heartbeats past their
    TTL, and a mirror polling then drops the replica and reloads its set, which is no apply rate.
    """
    live, backlog = IndexMirror(redis_url), IndexMirror(redis_url)
    client = Redis.from_url(redis_url)
    await live.start()
    await backlog.start()
    try:
        for mirror in (live, backlog):
            if mirror.stale or not mirror.index.has_replica(PUBLISHER_ID):
                raise RuntimeError("a mirror did not bootstrap with the publisher registered")
        await backlog.pause()
        conn.send("ready")
        await poll_until(holds(live, expected), phase_timeout(expected), "the live mirror to hold every hash")
        done_at = time.time()
        metric = live.registry.get_sample_value
        lag = metric("kvroute_index_lag_seconds") or 0.0

        async def fresh_heartbeat() -> bool:
            return await client.pttl(KEYS.heartbeat(PUBLISHER_ID)) >= FRESH_HEARTBEAT_MS

        await poll_until(fresh_heartbeat, 10, "a fresh publisher heartbeat")
        started = time.perf_counter()
        backlog.resume()
        await poll_until(holds(backlog, expected), phase_timeout(expected), "the paused mirror to catch up")
        catch_up = time.perf_counter() - started
        return {
            "done_at": done_at,
            "lag_s": lag,
            "hashes_applied": metric("kvroute_index_hashes_applied_total") or 0.0,
            "catch_up_s": catch_up,
        }
    finally:
        await live.stop()
        await backlog.stop()
        await client.aclose()


async def lowest_ttl_ms(client: Redis, key: str, until: asyncio.Event) -> int:
    """The least TTL ``key`` had, sampled until ``until`` is set; -2 means it expired meanwhile."""
    lowest = sys.maxsize
    while not until.is_set():
        lowest = min(lowest, await client.pttl(key))
        await asyncio.sleep(POLL_S)
    return lowest


def holds(mirror: IndexMirror, expected: int) -> Callable[[], Awaitable[bool]]:
    async def condition() -> bool:
        return mirror.index.size >= expected

    return condition


async def receive(conn: Connection, timeout: float) -> Any:
    """The child's next message, waited for off the event loop so the publisher's loops keep running."""

    def wait() -> Any:
        if not conn.poll(timeout):
            raise TimeoutError(f"no word from the mirror process in {timeout:.0f} s")
        return conn.recv()  # EOFError if the child died (its traceback is on stderr)

    return await asyncio.to_thread(wait)


async def first_stored_ts(client: Redis) -> float:
    """Publish time of the first stored entry (the stream opens with the registration's CLEARED)."""
    for _, fields in await client.xrange(KEYS.events(MODEL), count=10):
        event = decode_event(fields)
        if event.kind is EventKind.STORED:
            return event.ts
    raise RuntimeError("no stored entry at the head of the stream")


def new_publisher(redis_url: str, outbox: KVEventOutbox) -> KVPublisher:
    """One replica's publisher with the shipped defaults, fed by hand through ``outbox``."""
    config = PublisherConfig(redis_url=redis_url, replica_id=PUBLISHER_ID, advertise_url="http://bench")
    return KVPublisher(
        config,
        model=MODEL,
        fingerprint=FINGERPRINT,
        block_size=DEFAULT_BLOCK_SIZE,
        outbox=outbox,
        stats=idle_stats,
    )


def spawn_mirror_process(redis_url: str, expected: int) -> tuple[BaseProcess, Connection]:
    context = multiprocessing.get_context("spawn")  # no fork of a running event loop
    conn, child_conn = context.Pipe()
    child = context.Process(target=mirror_process, args=(child_conn, redis_url, expected), daemon=True)
    child.start()
    child_conn.close()  # the child's end: with it closed here, a dead child means EOF, not a wait
    return child, conn


def set_holds(client: Redis, expected: int) -> Callable[[], Awaitable[bool]]:
    async def condition() -> bool:
        return await client.scard(KEYS.blocks(PUBLISHER_ID)) >= expected

    return condition


async def publish_and_apply(redis_url: str, blocks: int, rng: np.random.Generator) -> dict[str, float]:
    """Phases 1 and 2 (see module doc) over one burst of ``blocks`` fresh hashes."""
    hashes = random_hashes(rng, blocks)
    appends = [hashes[i : i + APPEND_HASHES].tolist() for i in range(0, blocks, APPEND_HASHES)]
    outbox = KVEventOutbox()
    publisher = new_publisher(redis_url, outbox)
    client = Redis.from_url(redis_url)
    child: BaseProcess | None = None
    await publisher.start()
    try:
        child, conn = spawn_mirror_process(redis_url, blocks)
        if await receive(conn, 60) != "ready":
            raise RuntimeError("unexpected message from the mirror process")
        progress(f"publishing {blocks:,} hashes; the mirror process tails them")
        finished = asyncio.Event()
        watch = asyncio.create_task(lowest_ttl_ms(client, KEYS.heartbeat(PUBLISHER_ID), finished))
        started = time.time()
        for chunk in appends:
            outbox.append(EventKind.STORED, chunk, time.time())
        await poll_until(set_holds(client, blocks), phase_timeout(blocks), "Redis to hold every hash")
        published = time.time()
        mirrored = await receive(conn, phase_timeout(blocks))
        finished.set()
        lowest_ttl = await watch
        first_ts = await first_stored_ts(client)
    finally:
        if child is not None:
            child.join(timeout=10)
            child.kill()  # a no-op once it has exited
        await publisher.stop()
        await client.aclose()
    return {
        "publish_hashes_per_s": blocks / (published - started),
        "publish_s": published - started,
        "publisher_heartbeat_lowest_ttl_ms": lowest_ttl,
        "mirror_apply_hashes_per_s": blocks / (mirrored["done_at"] - first_ts),
        "mirror_apply_s": mirrored["done_at"] - first_ts,
        "mirror_lag_s": mirrored["lag_s"],
        "mirror_hashes_applied": mirrored["hashes_applied"],
        "mirror_catch_up_hashes_per_s": blocks / mirrored["catch_up_s"],
        "mirror_catch_up_s": mirrored["catch_up_s"],
    }


# -- the corpus: chains of shared prefixes over many replicas ------------------------------------


@dataclass
class Corpus:
    """``blocks`` distinct hashes cut into chains (one chain = one long shared prefix, such as a
    system prompt plus a document), and per replica which prefix of which chain it holds.

    Every chain has an owner holding all of it (so every block is indexed) and up to
    ``MAX_SHARERS`` replicas holding a random prefix of it. Chain 0 is the measured prompt's:
    ``full_match`` replicas hold all of it, ``partial_match`` ones a prefix shorter than the prompt.
    """

    chains: list[np.ndarray]
    holdings: list[list[tuple[int, int]]]  # per replica: (chain, prefix length)
    full_match: list[int]
    partial_match: list[int]
    prompt_blocks: int

    @property
    def blocks(self) -> int:
        return sum(len(chain) for chain in self.chains)

    @property
    def pairs(self) -> int:
        """(replica, block) pairs: blocks times how many replicas hold each, on average."""
        return sum(length for held in self.holdings for _, length in held)

    def replica_hashes(self, replica: int) -> np.ndarray:
        parts = [self.chains[chain][:length] for chain, length in self.holdings[replica]]
        return np.concatenate(parts) if parts else np.empty(0, dtype="<u8")

    def prompt(self) -> list[int]:
        """Fresh int objects, as a gateway gets from hashing a request's tokens."""
        return self.chains[0][: self.prompt_blocks].tolist()


def build_corpus(rng: np.random.Generator, blocks: int, replicas: int, prompt_blocks: int) -> Corpus:
    num_chains = max(1, min(blocks // CHAIN_BLOCKS, blocks // prompt_blocks))
    chains = np.array_split(random_hashes(rng, blocks), num_chains)  # chain 0 ≥ prompt_blocks long
    holdings: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
    matched = rng.choice(replicas, FULL_MATCH_REPLICAS + PARTIAL_MATCH_REPLICAS, replace=False).tolist()
    full_match, partial_match = matched[:FULL_MATCH_REPLICAS], matched[FULL_MATCH_REPLICAS:]
    for replica in full_match:
        holdings[replica].append((0, len(chains[0])))
    for replica in partial_match:
        holdings[replica].append((0, int(rng.integers(1, prompt_blocks))))
    owners = rng.permutation(np.arange(num_chains - 1) % replicas)  # every replica owns a share
    for chain, owner in enumerate(owners.tolist(), start=1):
        length = len(chains[chain])
        holdings[owner].append((chain, length))
        num_sharers = int(rng.integers(0, MAX_SHARERS + 1))
        for offset in rng.choice(replicas - 1, num_sharers, replace=False).tolist():
            holdings[(owner + 1 + offset) % replicas].append((chain, int(rng.integers(1, length + 1))))
    return Corpus(chains, holdings, full_match, partial_match, prompt_blocks)


def replica_id(replica: int) -> str:
    return f"bench-replica-{replica:03d}:8000"


def heartbeat(rid: str) -> dict[str, str]:
    """An idle replica's heartbeat, every field of ``HEARTBEAT_FIELDS``; no TTL, the run is short."""
    return {
        "v": str(PROTOCOL_VERSION),
        "url": f"http://{rid}",
        "model": MODEL,
        "fingerprint": FINGERPRINT,
        "block_size": str(DEFAULT_BLOCK_SIZE),
        "epoch": "1",
        "kv_total_pages": "65536",
        "kv_used_pages": "0",
        "running": "0",
        "waiting": "0",
        "waiting_prefill_tokens": "0",
        "ts": repr(time.time()),
    }


def write_corpus(client: redis.Redis, corpus: Corpus) -> None:
    """What the corpus's replicas would have published: heartbeats, registrations, blocks sets."""
    step = 8 * SADD_MEMBERS
    for replica in range(len(corpus.holdings)):
        rid = replica_id(replica)
        packed = corpus.replica_hashes(replica).astype("<u8").tobytes()
        with client.pipeline(transaction=False) as pipe:
            pipe.hset(KEYS.heartbeat(rid), mapping=heartbeat(rid))
            pipe.sadd(KEYS.replicas, rid)
            for start in range(0, len(packed), step):
                chunk = packed[start : start + step]
                pipe.sadd(KEYS.blocks(rid), *(chunk[i : i + 8] for i in range(0, len(chunk), 8)))
            pipe.execute()


# -- 3 and 4: bootstrap time, memory per block ---------------------------------------------------


async def bootstrap(redis_url: str, corpus: Corpus) -> tuple[float, BlockIndex]:
    """Seconds a fresh mirror's ``start()`` takes (it returns bootstrapped), and its index."""
    mirror = IndexMirror(redis_url)
    started = time.perf_counter()
    await mirror.start()
    seconds = time.perf_counter() - started
    await mirror.stop()
    index = mirror.index
    if index.size != corpus.blocks or index.num_replicas != len(corpus.holdings):
        raise RuntimeError(
            f"bootstrap loaded {index.size:,} blocks of {index.num_replicas} replicas, expected "
            f"{corpus.blocks:,} of {len(corpus.holdings)}"
        )
    return seconds, index


def memory_per_block(redis_url: str, corpus: Corpus) -> dict[str, float]:
    """Bytes the allocator holds for a bootstrapped mirror, per distinct block (a bootstrap of its
    own: tracing slows allocation several times over), beside the index's own estimate."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = asyncio.run(bootstrap(redis_url, corpus))[1]
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return {
        "memory_bytes_per_block_tracemalloc": used / index.size,
        "memory_bytes_per_block_estimate": index.bytes_per_block(),
    }


def bootstraps(redis_url: str, corpus: Corpus) -> tuple[dict[str, Any], BlockIndex]:
    """Median of ``BOOTSTRAP_REPEATS`` bootstraps, and the last one's index."""
    samples = []
    for _ in range(BOOTSTRAP_REPEATS):
        seconds, index = asyncio.run(bootstrap(redis_url, corpus))
        samples.append(seconds)
    return {"bootstrap_s": statistics.median(samples), "bootstrap_samples_s": samples}, index


# -- 5: lookup latency ---------------------------------------------------------------------------

LookupFn = Callable[[str, Sequence[int]], object]


def check_matches(index: BlockIndex, corpus: Corpus, prompt: list[int], miss: list[int]) -> None:
    """The prompt must be walked to its end (the worst case) and the miss must stop at block 0."""
    found = index.lookup(MODEL, prompt)
    full = sorted(rid for rid, depth in found.items() if depth == len(prompt))
    if full != sorted(map(replica_id, corpus.full_match)):
        raise RuntimeError(f"prompt fully matched on {full}, expected the corpus's full-match replicas")
    if any(index.lookup(MODEL, miss).values()):
        raise RuntimeError("the miss prompt matched something")


def time_calls(lookup: LookupFn, hashes: list[int], count: int) -> list[int]:
    """Nanoseconds per call; GC off meanwhile, so a collection other code triggered is not in a sample."""
    for _ in range(WARMUP_LOOKUPS):
        lookup(MODEL, hashes)
    samples = [0] * count
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(count):
            started = clock()
            lookup(MODEL, hashes)
            samples[i] = clock() - started
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def latency_us(samples: list[int]) -> dict[str, float]:
    p50, p99 = np.percentile(samples, [50, 99]) / 1000
    return {
        "p50": float(p50),
        "p99": float(p99),
        "max": max(samples) / 1000,
        "mean": statistics.mean(samples) / 1000,
    }


def lookup_latencies(
    index: BlockIndex, corpus: Corpus, count: int, rng: np.random.Generator
) -> dict[str, dict[str, float]]:
    """p50/p99/max/mean µs of a full match and of a miss at block 0, with and without predictions
    (some partial holders predicted to hold the whole prompt, as after routing it there)."""
    prompt, miss = corpus.prompt(), random_hashes(rng, corpus.prompt_blocks).tolist()
    check_matches(index, corpus, prompt, miss)
    for replica in corpus.partial_match[:PREDICTED_REPLICAS]:
        index.predict(replica_id(replica), prompt, PREDICTION_TTL_S)
    cases: dict[str, tuple[LookupFn, list[int]]] = {
        "full_match": (index.lookup, prompt),
        "miss": (index.lookup, miss),
        "full_match_with_predictions": (index.lookup_with_predictions, prompt),
        "miss_with_predictions": (index.lookup_with_predictions, miss),
    }
    latencies = {}
    for name, (lookup, hashes) in cases.items():
        progress(f"  {count:,} lookups: {name}")
        latencies[name] = latency_us(time_calls(lookup, hashes, count))
    return latencies


# -- report --------------------------------------------------------------------------------------


def check(name: str, value: float, limit: float, at_least: bool = False) -> dict[str, Any]:
    passed = value >= limit if at_least else value <= limit
    target = f"{'>=' if at_least else '<='} {limit:g}"
    return {"check": name, "value": value, "target": target, "passed": passed}


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    lookups = results["lookup_us"]
    return [
        check("lookup_p99_us", lookups["full_match"]["p99"], LOOKUP_P99_TARGET_US),
        check(
            "lookup_with_predictions_p99_us",
            lookups["full_match_with_predictions"]["p99"],
            LOOKUP_P99_TARGET_US,
        ),
        check("bootstrap_s", results["bootstrap_s"], BOOTSTRAP_TARGET_S),
        check("publisher_heartbeat_lowest_ttl_ms", results["publisher_heartbeat_lowest_ttl_ms"], 1, True),
    ]


TARGET_TEXT = {
    "lookup_p99_us": f"p99 ≤ {LOOKUP_P99_TARGET_US:g} µs",
    "lookup_with_predictions_p99_us": f"p99 ≤ {LOOKUP_P99_TARGET_US:g} µs",
    "bootstrap_s": f"≤ {BOOTSTRAP_TARGET_S:g} s",
    "publisher_heartbeat_lowest_ttl_ms": "> 0 (never expired)",
}


def markdown_table(s: Settings, results: dict[str, Any], outcome: dict[str, bool]) -> str:
    r, lookups = results, results["lookup_us"]

    def rate(key: str) -> str:
        return f"{r[key]:,.0f}"

    def latency(name: str) -> str:
        return " / ".join(f"{lookups[name][q]:.1f}" for q in ("p50", "p99", "max"))

    where = f"{s.replicas} replicas, {s.blocks:,} blocks"
    quantiles = "p50 / p99 / max (µs)"
    memory = f"{r['memory_bytes_per_block_tracemalloc']:.0f} / {r['memory_bytes_per_block_estimate']:.0f}"
    rows: list[tuple[str, str, str | None]] = [  # label, value, check
        (
            f"publish throughput, 1 replica, {s.blocks:,} hashes (hashes/s)",
            rate("publish_hashes_per_s"),
            None,
        ),
        (
            "publisher heartbeat TTL left, lowest during the burst (ms; −2: expired)",
            str(r["publisher_heartbeat_lowest_ttl_ms"]),
            "publisher_heartbeat_lowest_ttl_ms",
        ),
        (
            "mirror apply rate, tailing live in its own process (hashes/s)",
            rate("mirror_apply_hashes_per_s"),
            None,
        ),
        ("mirror lag gauge when the live mirror held them all (s)", f"{r['mirror_lag_s']:.3f}", None),
        ("mirror apply rate, catching up alone (hashes/s)", rate("mirror_catch_up_hashes_per_s"), None),
        (
            f"`lookup`, {s.prompt_blocks}-block prompt fully matched, {where}: {quantiles}",
            latency("full_match"),
            "lookup_p99_us",
        ),
        (
            f"`lookup_with_predictions`, same prompt: {quantiles}",
            latency("full_match_with_predictions"),
            "lookup_with_predictions_p99_us",
        ),
        (f"`lookup`, miss at block 0: {quantiles}", latency("miss"), None),
        (f"`lookup_with_predictions`, miss at block 0: {quantiles}", latency("miss_with_predictions"), None),
        (
            f"bootstrap of a fresh mirror, {where} (s, median of {BOOTSTRAP_REPEATS})",
            f"{r['bootstrap_s']:.3f}",
            "bootstrap_s",
        ),
        ("mirror memory per indexed block: tracemalloc / `bytes_per_block()` (B)", memory, None),
    ]
    lines = ["| metric | value | target | pass |", "|---|---|---|---|"]
    for label, value, name in rows:
        target, passed = (TARGET_TEXT[name], "pass" if outcome[name] else "FAIL") if name else ("", "")
        lines.append(f"| {label} | {value} | {target} | {passed} |")
    return "\n".join(lines)


def machine_info(redis_version: str, load: float) -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "redis_server": redis_version,
        "redis_py": package_version("redis"),
        "hiredis": package_version("hiredis"),
        "load_average_at_start": load,
    }


def preamble(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["corpus"]
    return "\n".join(
        [
            f"Machine: {m['cpu']}, {m['cores']} cores; redis-server {m['redis_server']} (loopback, no "
            f"persistence); Python {m['python']}; redis-py {m['redis_py']}, hiredis {m['hiredis']}.",
            f"Corpus: {c['blocks']:,} blocks in {c['chains']:,} chains of shared prefixes over "
            f"{c['replicas']} replicas, {c['pairs']:,} (replica, block) pairs ({c['pairs_per_block']:.2f} "
            f"per block); the prompt is fully held by {FULL_MATCH_REPLICAS} replicas, partly by "
            f"{PARTIAL_MATCH_REPLICAS}, {PREDICTED_REPLICAS} of which are predicted to hold it all. "
            f"Latencies: {report['settings']['lookups']:,} calls each, GC off, perf_counter_ns.",
            f"Command: `{report['command']}`",
        ]
    )


# -- entry point ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_index",
        description="Benchmark the Redis cache index: publisher, mirror, lookups (needs redis-server).",
    )
    add_size_options(parser, FULL, QUICK, "results/bench_index.json")
    return parser.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> Settings:
    sizes = chosen_sizes(args, FULL, QUICK)
    s = Settings(out=args.out, **sizes)
    if s.replicas < FULL_MATCH_REPLICAS + PARTIAL_MATCH_REPLICAS:
        raise SystemExit(f"--replicas must be at least {FULL_MATCH_REPLICAS + PARTIAL_MATCH_REPLICAS}")
    if not 2 <= s.prompt_blocks <= s.blocks:
        raise SystemExit("--prompt-blocks must be at least 2 and at most --blocks")
    if s.lookups < 1:
        raise SystemExit("--lookups must be positive")
    return s


def measure(s: Settings, server: RedisServer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every phase, in order; returns the results and the corpus's shape."""
    rng = np.random.default_rng(0)
    results = asyncio.run(publish_and_apply(server.url, s.blocks, rng))
    if results["publisher_heartbeat_lowest_ttl_ms"] < 0:
        progress(
            "warning: the burst starved the publisher's heartbeat past its TTL; a mirror polling "
            f"then drops the replica (the live mirror applied {results['mirror_hashes_applied']:,.0f} "
            "hashes from the stream, the rest from a reload of the set)"
        )
    client = server.client()
    try:
        client.flushall()
        progress(f"building and writing a corpus of {s.blocks:,} blocks over {s.replicas} replicas")
        corpus = build_corpus(rng, s.blocks, s.replicas, s.prompt_blocks)
        write_corpus(client, corpus)
    finally:
        client.close()
    progress("memory of a bootstrapped mirror (tracemalloc)")
    results |= memory_per_block(server.url, corpus)
    progress(f"bootstrap time, {BOOTSTRAP_REPEATS} fresh mirrors")
    timings, index = bootstraps(server.url, corpus)
    results |= timings
    results["lookup_us"] = lookup_latencies(index, corpus, s.lookups, rng)
    shape = {
        "blocks": corpus.blocks,
        "chains": len(corpus.chains),
        "replicas": s.replicas,
        "pairs": corpus.pairs,
        "pairs_per_block": corpus.pairs / corpus.blocks,
    }
    return results, shape


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    s = resolve_settings(parse_args(argv))
    load = warn_if_busy("bench_index")
    with tempfile.TemporaryDirectory(prefix="bench_index.") as workdir:
        server = RedisServer(Path(workdir))
        server.start()
        try:
            with server.client() as client:
                redis_version = client.info("server")["redis_version"]
            results, shape = measure(s, server)
        finally:
            server.stop()
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "loadtests.bench_index", *argv]),
        "machine": machine_info(redis_version, load),
        "settings": asdict(s),
        "corpus": shape,
        "results": results,
        "checks": checks(results),
    }
    outcome = {c["check"]: c["passed"] for c in report["checks"]}
    report["table"] = preamble(report) + "\n\n" + markdown_table(s, results, outcome)
    publish("bench_index", report, s.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
