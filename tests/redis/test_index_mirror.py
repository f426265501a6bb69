"""IndexMirror against a real redis-server and the real replica publisher over real radix caches.

Each simulated replica is a RadixCache over a tiny KVPool doing random inserts and evictions;
its KVPublisher publishes them exactly as a serving replica would. After quiescence the mirror's
view of every replica must equal the cache's own hashes, the publisher's ``blocks`` and the
Redis blocks set.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest
import torch
from redis.asyncio import Redis

from gateway.index.drains import SharedDrains
from gateway.index.mirror import IndexMirror
from kvroute.protocol import (
    HEARTBEAT_FIELDS,
    EventKind,
    Keys,
    block_hashes,
    encode_event,
    hash_member,
    model_seed,
)
from launcher.local_redis import RedisServer
from replica.engine.llm_engine import EngineStats
from replica.kvcache.events import KVEventOutbox
from replica.kvcache.pool import KVPool
from replica.kvcache.radix_cache import RadixCache
from replica.publisher import KVPublisher, PublisherConfig
from tests.helpers.metrics import sample_value
from tests.helpers.waiting import wait_until_async

BLOCK = 4
FINGERPRINT = "test-tokenizer"
PREFIX = "t"
HEARTBEAT_TTL = 0.4
KEYS = Keys(PREFIX)
TIMEOUT_S = 30  # each test's bound

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)


class SimReplica:
    """A radix cache doing random inserts and evictions, published by a real KVPublisher."""

    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        model: str,
        seed: int,
        *,
        pages: int = 40,
        stream_maxlen: int = 10_000,
    ) -> None:
        self.replica_id = replica_id
        self.model = model
        self.rng = random.Random(seed)
        self.pool = KVPool(1, pages, BLOCK, 1, 1, torch.float32, "cpu")
        outbox = KVEventOutbox()
        self.cache = RadixCache(self.pool, model_seed(model, FINGERPRINT), outbox)
        # A few shared conversation prefixes, so inserts extend and branch existing paths.
        self.bases = [[self.rng.randrange(50) for _ in range(6 * BLOCK)] for _ in range(4)]
        config = PublisherConfig(
            redis_url,
            replica_id,
            f"http://{replica_id}",
            prefix=PREFIX,
            heartbeat_interval=0.1,
            heartbeat_ttl=HEARTBEAT_TTL,
            batch_interval=0.01,
            max_batch_hashes=16,
            stream_maxlen=stream_maxlen,
        )
        self.publisher = KVPublisher(
            config, model=model, fingerprint=FINGERPRINT, block_size=BLOCK, outbox=outbox, stats=self.stats
        )

    def stats(self) -> EngineStats:
        used = self.pool.num_pages - self.pool.num_free
        return EngineStats(
            num_running=0,
            num_waiting=0,
            waiting_prefill_tokens=0,
            kv_total_pages=self.pool.num_pages,
            kv_used_pages=used,
            kv_cache_usage=0.0,
            cached_pages=self.cache.num_cached_pages,
            evictable_pages=self.cache.evictable_pages,
            block_size=BLOCK,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
        )

    def prompt(self) -> list[int]:
        base = self.rng.choice(self.bases)
        cut = self.rng.randrange(len(base) + 1)
        return base[:cut] + [self.rng.randrange(50) for _ in range(self.rng.randrange(3 * BLOCK))]

    def insert(self, tokens: list[int]) -> None:
        """What a finished request does: keeps its full pages in the tree, evicting to make room."""
        matched = self.cache.match_prefix(tokens, len(tokens) // BLOCK)
        node = matched[-1] if matched else self.cache.root
        self.cache.lock(node)
        for start in range(len(matched) * BLOCK, len(tokens) // BLOCK * BLOCK, BLOCK):
            if self.pool.num_free == 0 and self.cache.evict(1) == 0:
                break
            page = self.pool.allocate(1)[0]
            child = self.cache.insert_page(node, tuple(tokens[start : start + BLOCK]), page)
            if child.page != page:
                self.pool.free([page])
            node = child
        self.cache.unlock(node)

    def step(self) -> None:
        if self.rng.random() < 0.75:
            self.insert(self.prompt())
        else:
            self.cache.evict(self.rng.randrange(1, 4))

    async def churn(self, steps: int, pause: float = 0.003) -> None:
        for _ in range(steps):
            self.step()
            await asyncio.sleep(pause)

    async def crash(self) -> None:
        """Stops publishing without deregistering, as a killed process would."""
        pending = set(self.publisher._tasks)
        while pending:
            # Cancel again until it sticks: on Python 3.11 redis-py's asyncio.wait_for around a
            # socket write can swallow a cancellation (CPython gh-86296).
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.05)
        assert self.publisher._redis is not None
        await self.publisher._redis.aclose()


async def redis_blocks(redis: Redis, replica_id: str) -> set[int]:
    return {int.from_bytes(member, "little") for member in await redis.smembers(KEYS.blocks(replica_id))}


async def views_agree(mirror: IndexMirror, redis: Redis, replicas: list[SimReplica]) -> bool:
    """Mirror == publisher == cache == Redis for every replica, and nobody else in the mirror."""
    if sorted(info.replica_id for info in mirror.replicas()) != sorted(r.replica_id for r in replicas):
        return False
    epochs = {info.replica_id: info.epoch for info in mirror.replicas()}
    union: set[int] = set()
    for replica in replicas:
        truth = replica.cache.block_hashes()
        union |= truth
        if replica.publisher.blocks != truth or epochs[replica.replica_id] != replica.publisher.epoch:
            return False
        if mirror.index.replica_blocks(replica.replica_id) != truth:
            return False
        if await redis_blocks(redis, replica.replica_id) != truth:
            return False
    return mirror.index.size == len(union)


def check_lookups(mirror: IndexMirror, replica: SimReplica) -> None:
    """The mirror's lookup agrees with the replica's own radix tree on prompts it has seen."""
    seed = model_seed(replica.model, FINGERPRINT)
    for base in replica.bases:
        held = len(replica.cache.match_prefix(base, len(base) // BLOCK))
        hashes = block_hashes(base, BLOCK, seed)
        assert mirror.lookup(replica.model, hashes)[replica.replica_id] == held


def index_metric(mirror: IndexMirror, name: str, **labels: str) -> float:
    """A sample of the mirror's own registry; 0 while the series has none."""
    return sample_value(mirror.registry, name, default=0.0, **labels)


def new_mirror(server: RedisServer) -> IndexMirror:
    return IndexMirror(server.url, prefix=PREFIX, poll_interval=0.1, block_ms=50)


def test_gateway_never_imports_torch_or_the_replica() -> None:
    code = (
        "import sys, gateway.index.mirror, gateway.index.block_index\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "bad = [m for m in sys.modules if m == 'replica' or m.startswith('replica.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_churn_with_a_mirror_started_midway(redis_server: RedisServer) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)
        replicas = [
            SimReplica(redis_server.url, f"r{i}", "model-a" if i < 2 else "model-b", seed=i) for i in range(4)
        ]
        for replica in replicas:
            await replica.publisher.start()
        churn = [asyncio.create_task(replica.churn(400)) for replica in replicas]
        await asyncio.sleep(0.4)
        mirror = new_mirror(redis_server)
        await mirror.start()  # mid-way: the stream and the sets are already busy
        assert not mirror.stale
        try:
            await asyncio.gather(*churn)
            await wait_until_async(lambda: views_agree(mirror, redis, replicas), "views to agree", timeout=10)
            for replica in replicas:
                check_lookups(mirror, replica)
            assert {info.model for info in mirror.replicas("model-a")} == {"model-a"}
            assert len(mirror.replicas("model-b")) == 2
            assert index_metric(mirror, "kvroute_index_blocks") == mirror.index.size
            assert index_metric(mirror, "kvroute_index_replicas", model="model-a") == 2
            assert index_metric(mirror, "kvroute_index_events_applied_total") > 0
            assert index_metric(mirror, "kvroute_index_bootstraps_total", reason="start") == 1
            assert index_metric(mirror, "kvroute_index_stale") == 0
            assert 0 <= index_metric(mirror, "kvroute_index_lag_seconds") < 5
            # Graceful stop deregisters: the mirror drops the replica at once.
            await replicas[0].publisher.stop()
            await wait_until_async(
                lambda: views_agree(mirror, redis, replicas[1:]), "r0 to be dropped", timeout=5
            )
        finally:
            await mirror.stop()
            for replica in replicas[1:]:
                await replica.publisher.stop()
            await redis.aclose()


async def test_replaying_events_already_in_the_snapshot_converges(redis_server: RedisServer) -> None:
    """A mirror whose stream position is older than its snapshot (the bootstrap race at its
    worst: the whole stream, flushes and a restart included) still ends exact."""

    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)
        first = SimReplica(redis_server.url, "r0", "m", seed=7)
        await first.publisher.start()
        await first.churn(100)
        await first.crash()  # the same replica id comes back under a new epoch
        replica = SimReplica(redis_server.url, "r0", "m", seed=8)
        await replica.publisher.start()
        await replica.churn(100)
        replica.cache.flush()  # a CLEARED within the stream, then more events
        await replica.churn(100)
        mirror = new_mirror(redis_server)
        await mirror.start()
        try:
            await wait_until_async(lambda: views_agree(mirror, redis, [replica]), "views to agree", timeout=5)
            await mirror.pause()
            # Rewind to before everything: every entry gets replayed over the snapshot.
            mirror._streams["m"].last_id = b"0-0"
            mirror.resume()
            await wait_until_async(
                lambda: index_metric(mirror, "kvroute_index_events_applied_total") > 20,
                "replay",
                timeout=5,
            )
            await wait_until_async(
                lambda: views_agree(mirror, redis, [replica]), "views to agree after replay", timeout=5
            )
            assert index_metric(mirror, "kvroute_index_bootstraps_total", reason="gap") == 0
        finally:
            await mirror.stop()
            await replica.publisher.stop()
            await redis.aclose()


async def test_replica_restart_purges_its_old_blocks(redis_server: RedisServer) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)
        mirror = new_mirror(redis_server)
        await mirror.start()
        old = SimReplica(redis_server.url, "r0", "m", seed=1)
        await old.publisher.start()
        await old.churn(80)
        new: SimReplica | None = None
        try:
            await wait_until_async(
                lambda: views_agree(mirror, redis, [old]), "the first epoch to be mirrored", timeout=5
            )
            old_blocks = old.cache.block_hashes()
            assert old_blocks
            await old.crash()
            new = SimReplica(redis_server.url, "r0", "m", seed=2)  # same id, empty cache
            await new.publisher.start()
            assert new.publisher.epoch != old.publisher.epoch
            await wait_until_async(
                lambda: mirror.replicas()[0].epoch == new.publisher.epoch, "the new epoch", timeout=5
            )
            assert mirror.index.size == 0
            assert mirror.lookup("m", sorted(old_blocks)) == {"r0": 0}
            await new.churn(40)
            await wait_until_async(
                lambda: views_agree(mirror, redis, [new]), "the new epoch's blocks", timeout=5
            )
            assert not (old_blocks - new.cache.block_hashes()) & set(mirror.index.replica_blocks("r0"))
        finally:
            await mirror.stop()
            if new is not None:
                await new.publisher.stop()
            await redis.aclose()


async def test_dead_replica_is_dropped_when_its_heartbeat_expires(redis_server: RedisServer) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)
        mirror = new_mirror(redis_server)
        await mirror.start()
        replicas = [SimReplica(redis_server.url, f"r{i}", "m", seed=i) for i in range(2)]
        for replica in replicas:
            await replica.publisher.start()
            await replica.churn(40)
        try:
            await wait_until_async(lambda: views_agree(mirror, redis, replicas), "views to agree", timeout=5)
            loop = asyncio.get_running_loop()
            crashed_at = loop.time()
            await replicas[0].crash()
            await wait_until_async(
                lambda: len(mirror.replicas()) == 1, "the dead replica to go", timeout=3 * HEARTBEAT_TTL
            )
            assert loop.time() - crashed_at <= 3 * HEARTBEAT_TTL
            assert await views_agree(mirror, redis, replicas[1:])
        finally:
            await mirror.stop()
            await replicas[1].publisher.stop()
            await redis.aclose()


async def test_a_long_silent_registration_is_pruned(redis_server: RedisServer) -> None:
    """A crashed replica leaves its id and blocks set in Redis; after ``prune_after`` without a
    heartbeat the mirror deletes them, and a replica that comes back registers again."""

    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)
        mirror = IndexMirror(redis_server.url, prefix=PREFIX, poll_interval=0.1, block_ms=50, prune_after=1.0)
        await mirror.start()
        crashed, alive = (SimReplica(redis_server.url, f"r{i}", "m", seed=i) for i in range(2))
        for replica in (crashed, alive):
            await replica.publisher.start()
            await replica.churn(20)
        keys = Keys(PREFIX)
        try:
            await wait_until_async(lambda: len(mirror.replicas()) == 2, "both replicas", timeout=5)
            await redis.sadd(keys.drained, "r0", "r1")
            await crashed.crash()
            await wait_until_async(
                lambda: len(mirror.replicas()) == 1, "the crash to show", timeout=3 * HEARTBEAT_TTL
            )
            # not at once: a replica cut off from Redis for a moment must not lose its blocks set
            assert await redis.sismember(keys.replicas, "r0") and await redis.exists(keys.blocks("r0"))
            await asyncio.sleep(1.5)
            assert await redis.smembers(keys.replicas) == {b"r1"}
            assert not await redis.exists(keys.blocks("r0"))
            assert await redis.smembers(keys.drained) == {b"r1"}
            assert await views_agree(mirror, redis, [alive])
        finally:
            await mirror.stop()
            await alive.publisher.stop()
            await redis.aclose()


async def test_a_drain_made_during_a_poll_outlives_that_poll(redis_server: RedisServer) -> None:
    """A poll reads the drain set, then this gateway drains one replica and puts another back
    before the poll is applied: the poll's answer must carry both, or the drained replica would be
    routed to again until the next poll."""

    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)
        drains = SharedDrains(KEYS, lambda: redis)

        async def poll_read() -> set[bytes]:
            async with redis.pipeline(transaction=False) as pipe:
                drains.read(pipe)
                [reply] = await pipe.execute()
            return reply

        try:
            await redis.sadd(KEYS.drained, "r1")
            reply = await poll_read()
            assert await drains.share("r0", True) and await drains.share("r1", False)
            assert reply == {b"r1"} and drains.members(reply) == {"r0"}
            reply = await poll_read()  # the next poll reads them from Redis itself
            assert reply == {b"r0"} and drains.members(reply) == {"r0"}
        finally:
            await redis.delete(KEYS.drained)
            await redis.aclose()


async def test_redis_restart_both_sides_recover(redis_server: RedisServer) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        mirror = new_mirror(redis_server)
        await mirror.start()
        replicas = [SimReplica(redis_server.url, f"r{i}", "m", seed=10 + i) for i in range(3)]
        for replica in replicas:
            await replica.publisher.start()
        await asyncio.gather(*(replica.churn(60) for replica in replicas))
        redis = Redis.from_url(redis_server.url)
        try:
            await wait_until_async(lambda: views_agree(mirror, redis, replicas), "views to agree", timeout=5)
            before = {rid: mirror.index.replica_blocks(rid) for rid in ("r0", "r1", "r2")}
            epochs = {replica.publisher.epoch for replica in replicas}

            redis_server.stop()
            await wait_until_async(lambda: mirror.stale, "the mirror to notice", timeout=5)
            assert index_metric(mirror, "kvroute_index_stale") == 1
            # Caches move on meanwhile; the mirror keeps serving its last state.
            await asyncio.gather(*(replica.churn(30) for replica in replicas))
            assert {rid: mirror.index.replica_blocks(rid) for rid in before} == before

            redis_server.start()  # empty: everything must be republished
            await redis.aclose()
            redis = Redis.from_url(redis_server.url)  # the old client's connection died
            await wait_until_async(lambda: not mirror.stale, "the mirror to resync", timeout=5)
            await wait_until_async(
                lambda: views_agree(mirror, redis, replicas), "views to agree after restart", timeout=10
            )
            assert not epochs & {replica.publisher.epoch for replica in replicas}
            assert index_metric(mirror, "kvroute_index_bootstraps_total", reason="resync") >= 1
        finally:
            await mirror.stop()
            for replica in replicas:
                await replica.publisher.stop()
            await redis.aclose()


async def test_mirror_starts_stale_without_redis_and_syncs_when_it_comes(redis_server: RedisServer) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        redis_server.stop()
        mirror = new_mirror(redis_server)
        await mirror.start()  # must not raise
        try:
            assert mirror.stale
            assert mirror.lookup("m", [1, 2, 3]) == {}
            redis_server.start()
            await wait_until_async(lambda: not mirror.stale, "the first bootstrap", timeout=5)
        finally:
            await mirror.stop()


async def test_stream_trimmed_past_a_slow_mirror_triggers_a_bootstrap(redis_server: RedisServer) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        # Small stream nodes, so that the publishers' approximate MAXLEN really trims.
        client = redis_server.client()
        client.config_set("stream-node-max-entries", 4)
        client.close()
        redis = Redis.from_url(redis_server.url)
        replicas = [
            SimReplica(redis_server.url, f"r{i}", "m", seed=20 + i, stream_maxlen=8) for i in range(2)
        ]
        for replica in replicas:
            await replica.publisher.start()
        mirror = new_mirror(redis_server)
        await mirror.start()
        try:
            # A mirror that keeps up sees no gap. The pause gives it room on a loaded host: at the
            # default pace a stall of ~10 ms in its poll loop lets MAXLEN 8 trim past it.
            await asyncio.gather(*(replica.churn(20, pause=0.02) for replica in replicas))
            await wait_until_async(lambda: views_agree(mirror, redis, replicas), "views to agree", timeout=5)
            assert index_metric(mirror, "kvroute_index_bootstraps_total", reason="gap") == 0

            await mirror.pause()
            added_before = (await redis.xinfo_stream(KEYS.events("m")))["entries-added"]
            await asyncio.gather(*(replica.churn(40, pause=0.02) for replica in replicas))
            info = await redis.xinfo_stream(KEYS.events("m"))
            assert info["entries-added"] - added_before > 30  # many more entries than MAXLEN...
            assert info["length"] < 30  # ...and the stream no longer holds them all

            mirror.resume()
            await wait_until_async(
                lambda: index_metric(mirror, "kvroute_index_bootstraps_total", reason="gap") >= 1,
                "the gap",
                timeout=5,
            )
            await wait_until_async(
                lambda: views_agree(mirror, redis, replicas), "views to agree after the gap", timeout=5
            )
        finally:
            await mirror.stop()
            for replica in replicas:
                await replica.publisher.stop()
            await redis.aclose()


@pytest.mark.parametrize("bad", [{"v": "999"}, {"v": "1", "url": "x"}])
async def test_bad_heartbeats_are_ignored(redis_server: RedisServer, bad: dict[str, str]) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)
        await redis.sadd(KEYS.replicas, "weird")
        await redis.hset(KEYS.heartbeat("weird"), mapping=bad)
        mirror = new_mirror(redis_server)
        await mirror.start()
        try:
            assert not mirror.stale
            assert mirror.replicas() == []
        finally:
            await mirror.stop()
            await redis.aclose()


async def test_epochs_at_the_protocol_level(redis_server: RedisServer) -> None:
    """Hand-written Redis state: a heartbeat epoch change reloads the replica even without a
    CLEARED in the stream; events of another epoch, or of an unknown replica, are ignored."""

    async with asyncio.timeout(TIMEOUT_S):
        redis = Redis.from_url(redis_server.url)

        async def register(epoch: str, hashes: list[int]) -> None:
            fields = dict.fromkeys(HEARTBEAT_FIELDS, "0")
            fields.update(v="1", url="http://x", model="m", fingerprint="f", block_size="4", epoch=epoch)
            fields.update(gateways="{}")
            async with redis.pipeline(transaction=True) as pipe:
                pipe.sadd(KEYS.replicas, "x")
                pipe.hset(KEYS.heartbeat("x"), mapping=fields)
                pipe.delete(KEYS.blocks("x"))
                pipe.sadd(KEYS.blocks("x"), *map(hash_member, hashes))
                await pipe.execute()

        async def publish(replica_id: str, epoch: str, kind: EventKind, hashes: list[int]) -> None:
            await redis.xadd(KEYS.events("m"), encode_event(replica_id, epoch, kind, hashes, 0.0))

        await register("e1", [1, 2, 3])
        await redis.sadd(KEYS.blocks("x"), b"not-8-bytes")  # skipped by the snapshot read
        await publish("x", "e1", EventKind.STORED, [1, 2, 3])
        mirror = new_mirror(redis_server)
        await mirror.start()
        try:
            assert mirror.lookup("m", [1, 2, 3, 4]) == {"x": 3}
            assert mirror.index.replica_blocks("x") == {1, 2, 3}
            await publish("x", "e1", EventKind.STORED, [4])
            await wait_until_async(
                lambda: mirror.lookup("m", [1, 2, 3, 4]) == {"x": 4}, "e1's event", timeout=2
            )
            await register("e2", [7, 8])  # a new epoch nobody announced in the stream
            await wait_until_async(lambda: mirror.replicas()[0].epoch == "e2", "the epoch change", timeout=2)
            assert mirror.index.replica_blocks("x") == {7, 8}
            await publish("x", "e1", EventKind.STORED, [9])  # a late event of the old epoch
            await publish("ghost", "e1", EventKind.STORED, [10])  # a replica without a heartbeat
            await publish("x", "e2", EventKind.REMOVED, [8])
            await wait_until_async(lambda: mirror.index.replica_blocks("x") == {7}, "e2's event", timeout=2)
            assert mirror.index.size == 1
            # A flush as the publisher writes it: CLEARED under a new epoch, set and heartbeat along.
            await publish("x", "e3", EventKind.CLEARED, [])
            await publish("x", "e3", EventKind.STORED, [5])
            await register("e3", [5])
            await wait_until_async(lambda: mirror.index.replica_blocks("x") == {5}, "e3's events", timeout=2)
            await asyncio.sleep(3 * mirror.poll_interval)
            assert mirror.index.replica_blocks("x") == {5}
            assert mirror.replicas()[0].epoch == "e3"
        finally:
            await mirror.stop()
            await redis.aclose()
