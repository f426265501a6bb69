"""Publishes what a replica caches, and how loaded it is, to Redis, so gateways can route on it.

Two asyncio tasks on the server's event loop, never on the engine thread:

- the publish loop drains the radix cache's outbox as soon as it has events, but at most once per
  ``batch_interval`` (so a chat's last pages are indexed before its next turn can arrive, and a
  busy engine still costs one write per interval), applies every event to ``blocks`` (the
  publisher's own exact copy of the cache's hashes), and writes each batch to Redis as the
  blocks-set update *and* the stream entry in one MULTI/EXEC, so a reader never sees one without
  the other;
- the heartbeat loop refreshes the heartbeat hash, whose TTL makes a silently dead replica vanish.

All writes go through one lock, so a heartbeat can never land with an epoch older than a CLEARED
already written. Redis being away never reaches the engine or the HTTP server: ``blocks`` stays
exact meanwhile, and when Redis answers again the publisher starts a new epoch and republishes the
whole snapshot in one transaction, because what Redis missed (or lost, if it restarted) is unknown.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvroute.protocol import DEFAULT_PREFIX, EventKind, Heartbeat, Keys, encode_event, hash_member
from kvroute.settings import REQUIRED, option
from replica.kvcache.events import KVEvent, KVEventOutbox

log = logging.getLogger("kvroute.replica.publisher")

RETRY_INTERVAL_S = 0.5  # how often an unreachable Redis is tried again
# Deadline slack per hash in one transaction: a full republish of a big cache is one MULTI/EXEC that
# takes ~2 µs per hash (packing plus Redis's work), and a fixed deadline would fail it forever.
SECONDS_PER_HASH = 5e-6


class SourceShare(Protocol):
    running: int
    waiting: int
    waiting_prefill_tokens: int


class PublishedLoad(Protocol):
    """What a heartbeat reports: the engine's ``EngineStats``, or a bridge's view of a vLLM server."""

    @property
    def kv_total_pages(self) -> int: ...
    @property
    def kv_used_pages(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def waiting_prefill_tokens(self) -> int: ...
    @property
    def by_source(self) -> Mapping[str, SourceShare] | None:
        """Each gateway's share; None when the engine cannot tell (no ``gateways`` field then)."""


# One stream entry's worth of work: its kind and (for STORED/REMOVED) at most max_batch_hashes hashes.
_Piece = tuple[EventKind, list[int]]


@dataclass(frozen=True)
class PublisherConfig:
    """What ``kvroute replica --redis URL`` publishes, where, and how often: the fields with a flag are
    its "cache index (Redis)" options (``kvroute.settings``)."""

    redis_url: str = option(
        REQUIRED,
        "--redis",
        "publish cache contents and load to redis://HOST:PORT/DB (default: standalone)",
        metavar="URL",
    )
    replica_id: str = option(
        REQUIRED, "--replica-id", "stable name in Redis (default: host:port of the advertise URL)"
    )
    advertise_url: str = option(
        REQUIRED,
        "--advertise-url",
        "base URL gateways should call (default: http://HOST:PORT, the hostname for a wildcard host)",
        metavar="URL",
    )
    prefix: str = option(DEFAULT_PREFIX, "--redis-prefix", "key prefix in Redis")
    heartbeat_interval: float = option(0.5, "--heartbeat-interval", "seconds between heartbeats")
    heartbeat_ttl: float = option(2.0, "--heartbeat-ttl", "seconds a heartbeat stays without refresh")
    batch_interval: float = 0.02  # the shortest time between two outbox drains, seconds
    max_batch_hashes: int = 4096  # hashes per MULTI/EXEC and per stream entry
    stream_maxlen: int = option(100_000, "--stream-maxlen", "approximate length cap of the event stream")
    tokenizer_url: str | None = None  # where gateways fetch the tokenizer, when advertise_url lacks it
    socket_timeout: float = 2.0  # seconds: connect, and any one transaction (plus SECONDS_PER_HASH)

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        if self.heartbeat_interval <= 0 or self.batch_interval <= 0:
            raise ValueError("heartbeat_interval and batch_interval must be positive")
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_ttl ({self.heartbeat_ttl} s) must exceed heartbeat_interval "
                f"({self.heartbeat_interval} s), or the replica flickers in and out of gateways"
            )
        if self.max_batch_hashes < 1 or self.stream_maxlen < 1:
            raise ValueError("max_batch_hashes and stream_maxlen must be at least 1")


def _new_epoch() -> str:
    return secrets.token_hex(8)


def _chunks(hashes: list[int], size: int) -> list[list[int]]:
    return [hashes[start : start + size] for start in range(0, len(hashes), size)]


class KVPublisher:
    """Keeps one replica's heartbeat, blocks set and stream entries in Redis (see module doc)."""

    def __init__(
        self,
        config: PublisherConfig,
        *,
        model: str,
        fingerprint: str,
        block_size: int,
        outbox: KVEventOutbox,
        stats: Callable[[], PublishedLoad],
    ) -> None:
        self.config = config
        self.model = model
        self.fingerprint = fingerprint
        self.block_size = block_size
        self._outbox = outbox
        self._stats = stats
        keys = Keys(config.prefix)
        self._replicas_key = keys.replicas
        self._drained_key = keys.drained
        self._heartbeat_key = keys.heartbeat(config.replica_id)
        self._blocks_key = keys.blocks(config.replica_id)
        self._events_key = keys.events(model)
        self._blocks: set[int] = set()
        self._epoch = ""
        self._connected = False
        self._outage_reported = False
        self._next_retry = 0.0
        self._redis: Redis | None = None
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._has_events = asyncio.Event()  # set (from the engine thread) when the outbox fills
        self._tasks: list[asyncio.Task[None]] = []
        self._deregistration: asyncio.Task[None] | None = None

    @property
    def epoch(self) -> str:
        """The current epoch (hex): new at start, at every flush, every republish, and at stop."""
        return self._epoch

    @property
    def connected(self) -> bool:
        """Whether the last Redis write succeeded (False from an error until the republish)."""
        return self._connected

    @property
    def blocks(self) -> set[int]:
        """Every block hash the replica caches, as of the last drain (live view: do not mutate)."""
        return self._blocks

    async def start(self) -> None:
        """Registers under a new epoch (or, if Redis is away, keeps trying) and starts the loops."""
        self._redis = Redis.from_url(
            self.config.redis_url,
            socket_connect_timeout=self.config.socket_timeout,
            socket_timeout=None,  # each transaction has its own deadline, sized to its work
            retry=Retry(NoBackoff(), 0),  # a failed write means "resync", never a blind re-send
        )
        loop = asyncio.get_running_loop()
        self._outbox.notify = lambda: loop.call_soon_threadsafe(self._has_events.set)
        self._apply(self._outbox.drain())
        await self._resync()
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="kvroute-kv-publish"),
            asyncio.create_task(self._heartbeat_loop(), name="kvroute-kv-heartbeat"),
        ]

    async def stop(self) -> None:
        """Deregisters at once (heartbeat, replicas entry, blocks set, any drain, CLEARED), so gateways need
        not wait for the TTL; bounded by ``socket_timeout`` when Redis is away. Idempotent: the
        server calls it when a shutdown signal arrives and again when its lifespan ends."""
        if self._deregistration is None:
            self._deregistration = asyncio.create_task(self._deregister())
        await asyncio.shield(self._deregistration)

    async def _deregister(self) -> None:
        self._stopping.set()
        self._outbox.notify = None
        for task in self._tasks:
            task.cancel()  # a write cut short is harmless: everything it touched is deleted below
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._apply(self._outbox.drain())
        self._epoch = _new_epoch()
        try:
            async with self._transaction() as pipe:
                pipe.delete(self._heartbeat_key, self._blocks_key)
                pipe.srem(self._replicas_key, self.config.replica_id)
                pipe.srem(self._drained_key, self.config.replica_id)
                self._queue_xadd(pipe, EventKind.CLEARED, [])
        except (RedisError, OSError) as error:
            log.warning(
                "could not deregister from Redis (%s: %s); the heartbeat will expire instead",
                type(error).__name__,
                error,
            )
        self._connected = False
        assert self._redis is not None
        await self._redis.aclose()

    # -- loops ----------------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        while not self._stopping.is_set():
            self._has_events.clear()
            events = self._outbox.drain()
            self._apply(events)
            if self._connected:
                await self._publish(events)
            elif time.monotonic() >= self._next_retry:
                await self._resync()
            # a drain that filled a whole batch means more is likely waiting: go again at once
            backlog = sum(len(event.block_hashes) for event in events) >= self.config.max_batch_hashes
            if not backlog:
                await self._sleep(self.config.batch_interval)
                if self._connected:  # (while Redis is away, keep retrying on the interval)
                    await self._has_events.wait()

    async def _heartbeat_loop(self) -> None:
        while not await self._sleep(self.config.heartbeat_interval):
            async with self._lock:
                if not self._connected:
                    continue  # the publish loop's republish writes the heartbeat
                try:
                    stats = self._stats()
                except Exception:  # nothing was written: skip one beat, the TTL allows for it
                    log.exception("engine stats failed; skipping one heartbeat")
                    continue
                try:
                    async with self._transaction() as pipe:
                        self._queue_heartbeat(pipe, stats)
                except Exception as error:
                    self._lost(error)

    async def _sleep(self, seconds: float) -> bool:
        """Waits ``seconds``; True as soon as the publisher is stopping."""
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            return False
        return True

    # -- writes ---------------------------------------------------------------------------------

    def _apply(self, events: list[KVEvent]) -> None:
        for event in events:
            if event.kind is EventKind.STORED:
                self._blocks.update(event.block_hashes)
            elif event.kind is EventKind.REMOVED:
                self._blocks.difference_update(event.block_hashes)
            else:
                self._blocks.clear()

    async def _publish(self, events: list[KVEvent]) -> None:
        """One MULTI/EXEC per batch of at most ``max_batch_hashes`` hashes.

        The lock is taken per batch, so a heartbeat slips in between batches of a long burst
        (a million hashes take seconds, longer than the heartbeat TTL).
        """
        for batch in self._batches(events):
            async with self._lock:
                if not self._connected:
                    return  # a write failed meanwhile; the republish covers these events
                try:
                    async with self._transaction(sum(len(hashes) for _, hashes in batch)) as pipe:
                        for kind, hashes in batch:
                            self._queue_event(pipe, kind, hashes)
                except Exception as error:
                    self._lost(error)
                    return

    async def _resync(self) -> None:
        """New epoch and the whole of ``blocks``, in one transaction: the registration at start,
        and the recovery after an outage (Redis may have lost everything, or missed some batches)."""
        self._next_retry = time.monotonic() + RETRY_INTERVAL_S
        async with self._lock:
            self._epoch = _new_epoch()
            chunks = _chunks(list(self._blocks), self.config.max_batch_hashes)
            try:
                async with self._transaction(len(self._blocks)) as pipe:
                    pipe.delete(self._blocks_key)
                    for chunk in chunks:
                        pipe.sadd(self._blocks_key, *map(hash_member, chunk))
                    self._queue_heartbeat(pipe, self._stats())
                    self._queue_xadd(pipe, EventKind.CLEARED, [])
                    for chunk in chunks:
                        self._queue_xadd(pipe, EventKind.STORED, chunk)
            except Exception as error:
                self._lost(error)
                return
            self._connected = True
        if self._outage_reported:
            self._outage_reported = False
            log.info(
                "Redis reachable again: republished %d blocks under epoch %s", len(self._blocks), self._epoch
            )

    def _lost(self, error: Exception) -> None:
        """Any failed write leaves Redis in an unknown state: only a republish under a new epoch
        repairs it, and the publish loop makes it: it is woken here, or a replica whose cache does
        not change would wait for a cache event that never comes, and never register again. Redis
        errors are the expected cause; anything else also gets its traceback."""
        self._connected = False
        self._has_events.set()
        if not self._outage_reported:
            self._outage_reported = True
            log.warning(
                "publishing to Redis failed (%s: %s); serving on, will republish under a new epoch",
                type(error).__name__,
                error,
                exc_info=not isinstance(error, RedisError | OSError),
            )

    def _batches(self, events: list[KVEvent]) -> list[list[_Piece]]:
        """Consecutive pieces grouped so that no transaction carries more than max_batch_hashes."""
        limit = self.config.max_batch_hashes
        batches: list[list[_Piece]] = []
        batch: list[_Piece] = []
        size = 0
        for event in events:
            kind = event.kind
            pieces = [[]] if kind is EventKind.CLEARED else _chunks(event.block_hashes, limit)
            for hashes in pieces:
                if batch and size + len(hashes) > limit:
                    batches.append(batch)
                    batch, size = [], 0
                batch.append((kind, hashes))
                size += len(hashes)
        if batch:
            batches.append(batch)
        return batches

    @asynccontextmanager
    async def _transaction(self, num_hashes: int = 0) -> AsyncIterator[Pipeline]:
        """A MULTI/EXEC pipeline, executed when the block ends, all under one deadline: a dead or
        hung Redis costs ``socket_timeout`` (plus slack for big snapshots), never a hang."""
        assert self._redis is not None
        async with asyncio.timeout(self.config.socket_timeout + num_hashes * SECONDS_PER_HASH):
            async with self._redis.pipeline(transaction=True) as pipe:
                yield pipe
                await pipe.execute()

    def _queue_event(self, pipe: Pipeline, kind: EventKind, hashes: list[int]) -> None:
        if kind is EventKind.STORED:
            pipe.sadd(self._blocks_key, *map(hash_member, hashes))
        elif kind is EventKind.REMOVED:
            pipe.srem(self._blocks_key, *map(hash_member, hashes))
        else:  # the cache was flushed: a new epoch, announced in the heartbeat in the same step
            self._epoch = _new_epoch()
            pipe.delete(self._blocks_key)
            self._queue_heartbeat(pipe, self._stats())
        self._queue_xadd(pipe, kind, hashes)

    def _queue_xadd(self, pipe: Pipeline, kind: EventKind, hashes: list[int]) -> None:
        fields = encode_event(self.config.replica_id, self._epoch, kind, hashes, time.time())
        pipe.xadd(self._events_key, fields, maxlen=self.config.stream_maxlen, approximate=True)

    def _queue_heartbeat(self, pipe: Pipeline, stats: PublishedLoad) -> None:
        """HSET every heartbeat field, PEXPIRE, and SADD to the replicas set (Redis may have restarted)."""
        heartbeat = Heartbeat(
            url=self.config.advertise_url,
            model=self.model,
            fingerprint=self.fingerprint,
            block_size=self.block_size,
            epoch=self._epoch,
            kv_total_pages=stats.kv_total_pages,
            kv_used_pages=stats.kv_used_pages,
            running=stats.num_running,
            waiting=stats.num_waiting,
            waiting_prefill_tokens=stats.waiting_prefill_tokens,
            ts=time.time(),
            gateways=None
            if stats.by_source is None
            else {
                gateway: (load.running, load.waiting, load.waiting_prefill_tokens)
                for gateway, load in stats.by_source.items()
            },
            tokenizer_url=self.config.tokenizer_url,
        )
        pipe.hset(self._heartbeat_key, mapping=heartbeat.encode())
        pipe.pexpire(self._heartbeat_key, round(self.config.heartbeat_ttl * 1000))
        pipe.sadd(self._replicas_key, self.config.replica_id)
