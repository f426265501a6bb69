"""1 and 2 of :mod:`loadtests.bench_index`: a publisher's throughput, and the apply rate of mirrors
in a process of their own, over one burst of fresh hashes."""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
from redis.asyncio import Redis

from gateway.index.mirror import IndexMirror
from kvroute.protocol import DEFAULT_BLOCK_SIZE, EventKind, decode_event
from loadtests.bench_index.settings import (
    APPEND_HASHES,
    FINGERPRINT,
    FRESH_HEARTBEAT_MS,
    KEYS,
    MODEL,
    POLL_S,
    PUBLISHER_ID,
    phase_timeout,
    poll_until,
    progress,
    random_hashes,
)
from replica.kvcache.events import KVEventOutbox
from replica.publisher import KVPublisher, PublisherConfig

if TYPE_CHECKING:
    from replica.engine.llm_engine import EngineStats


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
