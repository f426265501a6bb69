"""The replica's Redis publisher against a real redis-server: registration, exact publishing from a
real engine, replayable streams, load in heartbeats, outages and hangs, trimming, and the CLI path.

The invariant most tests end on: the replica's blocks set in Redis, a replay of the
model's stream, the publisher's own view and the radix cache all hold the same hashes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvroute.protocol import (
    HEARTBEAT_FIELDS,
    PROTOCOL_VERSION,
    Event,
    EventKind,
    Keys,
    block_hashes,
    decode_event,
    default_advertise_url,
    replica_id_for,
)
from launcher.local_redis import RedisServer
from replica.engine.llm_engine import EngineStats, LLMEngine
from replica.engine.sampling_params import SamplingParams
from replica.kvcache.events import KVEventOutbox
from replica.publisher import KVPublisher, PublisherConfig
from tests.conftest import EngineFactory
from tests.helpers.processes import ReplicaProcess, stopped
from tests.helpers.waiting import wait_until, wait_until_async
from tests.unit.test_engine_logits import random_prompt

pytestmark = pytest.mark.anyio  # async tests run on asyncio (tests/conftest.py)

KEYS = Keys()
REPLICA = "127.0.0.1:8001"
URL = "http://127.0.0.1:8001"
MODEL = "tiny-model"
IDLE = EngineStats(
    num_running=0,
    num_waiting=0,
    waiting_prefill_tokens=0,
    kv_total_pages=64,
    kv_used_pages=0,
    kv_cache_usage=0.0,
    cached_pages=0,
    evictable_pages=0,
    block_size=16,
    prefix_cache_queries=0,
    prefix_cache_hits=0,
    num_preemptions=0,
)


def fast_config(server: RedisServer, **overrides: Any) -> PublisherConfig:
    settings: dict[str, Any] = {
        "redis_url": server.url,
        "replica_id": REPLICA,
        "advertise_url": URL,
        "heartbeat_interval": 0.1,
        "heartbeat_ttl": 0.6,
        "batch_interval": 0.01,
        "socket_timeout": 0.5,
    } | overrides
    return PublisherConfig(**settings)


def outbox_publisher(server: RedisServer, outbox: KVEventOutbox, **overrides: Any) -> KVPublisher:
    """A publisher fed by hand through ``outbox``, reporting an idle engine."""
    return KVPublisher(
        fast_config(server, **overrides),
        model=MODEL,
        fingerprint="f00d",
        block_size=16,
        outbox=outbox,
        stats=lambda: IDLE,
    )


def engine_publisher(server: RedisServer, engine: LLMEngine, **overrides: Any) -> KVPublisher:
    assert engine.cache.outbox is not None
    return KVPublisher(
        fast_config(server, **overrides),
        model=engine.served_model_name,
        fingerprint=engine.tokenizer.fingerprint,
        block_size=engine.pool.page_size,
        outbox=engine.cache.outbox,
        stats=engine.stats,
    )


def redis_blocks(client: redis.Redis, replica: str = REPLICA) -> set[int]:
    return {int.from_bytes(member, "little") for member in client.smembers(KEYS.blocks(replica))}


def heartbeat(client: redis.Redis, replica: str = REPLICA) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(KEYS.heartbeat(replica)).items()}


def stream(client: redis.Redis, model: str = MODEL) -> list[Event]:
    return [decode_event(fields) for _, fields in client.xrange(KEYS.events(model))]


def replay(events: list[Event], replica: str = REPLICA) -> tuple[str, set[int]]:
    """What a mirror replaying ``events`` from the start believes: (epoch, blocks)."""
    epoch, held = "", set[int]()
    for event in events:
        if event.replica_id != replica:
            continue
        if event.kind is EventKind.CLEARED:
            epoch, held = event.epoch, set()
            continue
        assert event.epoch == epoch, "an event outside the epoch its CLEARED opened"
        if event.kind is EventKind.STORED:
            held.update(event.hashes)
        else:
            held.difference_update(event.hashes)
    return epoch, held


def hashes_of(events: list[Event], kind: EventKind) -> list[int]:
    return [h for event in events if event.kind is kind for h in event.hashes]


def generate(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Runs one greedy request to completion on the calling thread; returns its output tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    output: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                output.extend(delta.token_ids)
    return output


def in_sync(client: redis.Redis, publisher: KVPublisher, engine: LLMEngine) -> bool:
    return redis_blocks(client) == publisher.blocks == engine.cache.block_hashes()


def frozen(server: RedisServer) -> AbstractContextManager[None]:
    """The real redis-server hung: connections still open (the kernel accepts), nothing answers."""
    assert server.process is not None
    return stopped(server.process.pid)


async def test_registers_with_a_full_heartbeat_and_a_cleared_event(redis_server: RedisServer) -> None:
    client = redis_server.client()

    publisher = outbox_publisher(redis_server, KVEventOutbox())
    await publisher.start()
    try:
        assert publisher.connected and len(publisher.epoch) == 16
        beat = heartbeat(client)
        # every field but tokenizer_url, which only a bridge writes (a replica serves its own)
        assert set(beat) == set(HEARTBEAT_FIELDS) - {"tokenizer_url"}
        assert beat | {"ts": ""} == {
            "v": str(PROTOCOL_VERSION),
            "url": URL,
            "model": MODEL,
            "fingerprint": "f00d",
            "block_size": "16",
            "epoch": publisher.epoch,
            "kv_total_pages": "64",
            "kv_used_pages": "0",
            "running": "0",
            "waiting": "0",
            "waiting_prefill_tokens": "0",
            "gateways": "{}",
            "ts": "",
        }
        assert abs(float(beat["ts"]) - time.time()) < 5
        assert 0 < client.pttl(KEYS.heartbeat(REPLICA)) <= 600
        assert client.smembers(KEYS.replicas) == {REPLICA.encode()}
        (first,) = stream(client)
        assert (first.kind, first.epoch, first.replica_id, first.hashes) == (
            EventKind.CLEARED,
            publisher.epoch,
            REPLICA,
            [],
        )
        # refreshed before it expires
        await asyncio.sleep(1.0)
        assert heartbeat(client)["epoch"] == publisher.epoch
        assert float(heartbeat(client)["ts"]) > float(beat["ts"])
    finally:
        await publisher.stop()


async def test_publishes_exactly_what_the_engine_caches(
    redis_server: RedisServer, make_engine: EngineFactory
) -> None:
    client = redis_server.client()
    engine = make_engine()
    prompt = random_prompt(100, seed=3)

    publisher = engine_publisher(redis_server, engine)
    await publisher.start()
    try:
        # the engine runs on its own thread while the publisher drains concurrently
        output = await asyncio.to_thread(generate, engine, "a", prompt, 30)
        await wait_until_async(
            lambda: in_sync(client, publisher, engine),
            "Redis, the publisher and the cache to agree",
            timeout=5,
        )
        expected = block_hashes(prompt + output, 16, engine.block_seed)
        assert len(expected) == 8 and redis_blocks(client) == set(expected)
        events = stream(client, engine.served_model_name)
        assert sorted(hashes_of(events, EventKind.STORED)) == sorted(expected)
        assert replay(events) == (publisher.epoch, set(expected))

        assert engine.cache.evict(3) == 3
        await wait_until_async(
            lambda: in_sync(client, publisher, engine), "the evictions to reach Redis", timeout=5
        )
        assert redis_blocks(client) == set(expected[:5])
        events = stream(client, engine.served_model_name)
        assert sorted(hashes_of(events, EventKind.REMOVED)) == sorted(expected[5:])
        assert replay(events) == (publisher.epoch, set(expected[:5]))
    finally:
        await publisher.stop()


async def test_a_flush_starts_a_new_epoch_in_the_same_transaction(redis_server: RedisServer) -> None:
    client = redis_server.client()
    outbox = KVEventOutbox()

    publisher = outbox_publisher(redis_server, outbox)
    await publisher.start()
    first_epoch = publisher.epoch
    try:
        outbox.append(EventKind.STORED, [1, 2, 3], time.time())
        outbox.append(EventKind.CLEARED, [], time.time())
        outbox.append(EventKind.STORED, [4], time.time())
        await wait_until_async(
            lambda: redis_blocks(client) == {4}, "the flush and block 4 to reach Redis", timeout=5
        )
        assert publisher.epoch != first_epoch and publisher.blocks == {4}
        assert heartbeat(client)["epoch"] == publisher.epoch
        assert replay(stream(client)) == (publisher.epoch, {4})
    finally:
        await publisher.stop()


async def test_big_batches_are_split_and_still_replay(redis_server: RedisServer) -> None:
    client = redis_server.client()
    outbox = KVEventOutbox()

    publisher = outbox_publisher(redis_server, outbox, max_batch_hashes=100)
    await publisher.start()
    try:
        outbox.append(EventKind.STORED, list(range(1, 1001)), time.time())
        outbox.append(EventKind.REMOVED, list(range(1, 251)), time.time())
        await wait_until_async(
            lambda: redis_blocks(client) == set(range(251, 1001)),
            "the split batches to reach Redis",
            timeout=5,
        )
        events = stream(client)
        assert max(len(event.hashes) for event in events) == 100
        assert replay(events) == (publisher.epoch, set(range(251, 1001)))
    finally:
        await publisher.stop()


async def test_a_big_snapshot_gets_a_deadline_sized_to_it(redis_server: RedisServer) -> None:
    """A republish is one transaction however big the cache: a fixed deadline shorter than its
    work would fail it on every retry, and the replica would never come back."""
    client = redis_server.client()
    outbox = KVEventOutbox()
    snapshot = list(range(1, 300_001))
    outbox.append(EventKind.STORED, snapshot, time.time())

    publisher = outbox_publisher(redis_server, outbox, socket_timeout=0.1)
    await publisher.start()  # the registration republishes what the outbox already holds
    try:
        assert publisher.connected
        assert client.scard(KEYS.blocks(REPLICA)) == len(snapshot)
    finally:
        await publisher.stop()


async def test_heartbeat_tracks_load_and_stop_deregisters(
    redis_server: RedisServer, make_engine: EngineFactory
) -> None:
    client = redis_server.client()
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def load_is(**expected: str) -> Callable[[], bool]:
        return lambda: expected.items() <= heartbeat(client).items()

    publisher = engine_publisher(redis_server, engine)
    await publisher.start()
    stopped = False
    try:
        engine.add_request("a", random_prompt(40, seed=4), params)
        await wait_until_async(
            load_is(waiting="1", waiting_prefill_tokens="40", running="0"),
            "a heartbeat with the request waiting",
            timeout=5,
        )
        engine.step()  # the whole prompt fits one step's budget
        await wait_until_async(
            load_is(waiting="0", waiting_prefill_tokens="0", running="1"),
            "a heartbeat with the request running",
            timeout=5,
        )
        assert int(heartbeat(client)["kv_used_pages"]) >= 3
        while engine.has_unfinished():
            engine.step()
        await wait_until_async(load_is(running="0"), "a heartbeat with nothing running", timeout=5)
        await wait_until_async(
            lambda: in_sync(client, publisher, engine),
            "Redis, the publisher and the cache to agree",
            timeout=5,
        )
        assert redis_blocks(client)
        client.sadd(KEYS.drained, REPLICA, "another-replica")  # an admin drained it (and another)

        await publisher.stop()
        stopped = True
        assert not publisher.connected
        assert not client.exists(KEYS.heartbeat(REPLICA), KEYS.blocks(REPLICA))
        assert client.smembers(KEYS.replicas) == set()
        assert client.smembers(KEYS.drained) == {b"another-replica"}, "a drain ends with its replica"
        events = stream(client, engine.served_model_name)
        assert events[-1].kind is EventKind.CLEARED and events[-1].epoch == publisher.epoch
        assert replay(events) == (publisher.epoch, set())
    finally:
        if not stopped:
            await publisher.stop()


async def test_redis_restart_republishes_everything_under_a_new_epoch(
    redis_server: RedisServer, make_engine: EngineFactory
) -> None:
    client = redis_server.client()
    engine = make_engine()
    model = engine.served_model_name

    publisher = engine_publisher(redis_server, engine)
    await publisher.start()
    try:
        await asyncio.to_thread(generate, engine, "a", random_prompt(70, seed=5), 10)
        await wait_until_async(
            lambda: in_sync(client, publisher, engine),
            "Redis, the publisher and the cache to agree",
            timeout=5,
        )
        old_epoch = publisher.epoch

        redis_server.stop()
        await asyncio.to_thread(generate, engine, "b", random_prompt(90, seed=6), 10)
        assert engine.cache.evict(2) == 2
        await wait_until_async(
            lambda: not publisher.connected, "the publisher to notice the outage", timeout=5
        )
        await wait_until_async(
            lambda: publisher.blocks == engine.cache.block_hashes(),
            "the publisher to track the cache offline",
            timeout=5,
        )

        redis_server.start()  # empty: no persistence
        await wait_until_async(
            lambda: publisher.connected and in_sync(client, publisher, engine),
            "the republish after the restart",
            timeout=5,
        )
        assert publisher.epoch != old_epoch
        assert heartbeat(client)["epoch"] == publisher.epoch
        assert client.smembers(KEYS.replicas) == {REPLICA.encode()}
        events = stream(client, model)
        assert (events[0].kind, events[0].epoch) == (EventKind.CLEARED, publisher.epoch)
        assert {event.kind for event in events[1:]} == {EventKind.STORED}
        assert sorted(hashes_of(events, EventKind.STORED)) == sorted(publisher.blocks)
        assert replay(events) == (publisher.epoch, publisher.blocks)

        # and ordinary publishing carries on
        await asyncio.to_thread(generate, engine, "c", random_prompt(50, seed=7), 10)
        await wait_until_async(
            lambda: in_sync(client, publisher, engine), "the new blocks to reach Redis", timeout=5
        )
        assert replay(stream(client, model)) == (publisher.epoch, publisher.blocks)
    finally:
        await publisher.stop()


async def test_hung_redis_times_out_resyncs_and_never_blocks_stop(redis_server: RedisServer) -> None:
    client = redis_server.client()
    outbox = KVEventOutbox()

    publisher = outbox_publisher(redis_server, outbox, socket_timeout=0.3)
    await publisher.start()
    stopped = False
    try:
        outbox.append(EventKind.STORED, [1, 2, 3], time.time())
        await wait_until_async(
            lambda: redis_blocks(client) == {1, 2, 3}, "blocks 1-3 to reach Redis", timeout=5
        )
        old_epoch = publisher.epoch
        with frozen(redis_server):
            outbox.append(EventKind.STORED, [4], time.time())
            outbox.append(EventKind.REMOVED, [1], time.time())
            await wait_until_async(
                lambda: not publisher.connected, "the publisher to notice the hang", timeout=5
            )
        # Redis kept its data but may have missed any part of it: a full republish fixes that
        await wait_until_async(
            lambda: publisher.connected and redis_blocks(client) == {2, 3, 4},
            "the republish after the hang",
            timeout=5,
        )
        assert publisher.epoch != old_epoch and heartbeat(client)["epoch"] == publisher.epoch
        assert replay(stream(client)) == (publisher.epoch, {2, 3, 4})

        with frozen(redis_server):
            started = time.monotonic()
            await publisher.stop()
            stopped = True
            assert time.monotonic() - started < 1.5
    finally:
        if not stopped:
            await publisher.stop()


async def test_starts_without_redis_and_registers_when_it_appears(redis_server: RedisServer) -> None:
    client = redis_server.client()
    outbox = KVEventOutbox()
    redis_server.stop()

    publisher = outbox_publisher(redis_server, outbox)
    await publisher.start()
    try:
        assert not publisher.connected
        outbox.append(EventKind.STORED, [7, 8], time.time())
        await wait_until_async(
            lambda: publisher.blocks == {7, 8}, "the publisher to track the cache offline", timeout=5
        )
        redis_server.start()
        await wait_until_async(
            lambda: publisher.connected and redis_blocks(client) == {7, 8},
            "the registration once Redis appears",
            timeout=5,
        )
        assert heartbeat(client)["epoch"] == publisher.epoch
        assert replay(stream(client)) == (publisher.epoch, {7, 8})
    finally:
        await publisher.stop()


async def test_a_failing_stats_read_skips_one_beat_and_keeps_the_epoch(redis_server: RedisServer) -> None:
    """engine.stats() runs on the event loop while the engine thread mutates the scheduler, so a
    read can fail now and then; that must not cost a new epoch (mirrors would drop the replica)."""
    client = redis_server.client()
    calls = itertools.count()

    def flaky_stats() -> EngineStats:
        if next(calls) % 2:
            raise RuntimeError("deque mutated during iteration")
        return IDLE

    publisher = KVPublisher(
        fast_config(redis_server),
        model=MODEL,
        fingerprint="f00d",
        block_size=16,
        outbox=KVEventOutbox(),
        stats=flaky_stats,
    )
    await publisher.start()
    try:
        first_beat = float(heartbeat(client)["ts"])
        await asyncio.sleep(0.8)
        assert next(calls) >= 6, "heartbeats stopped"
        assert publisher.connected and float(heartbeat(client)["ts"]) > first_beat
        assert heartbeat(client)["epoch"] == publisher.epoch
        assert [event.kind for event in stream(client)] == [EventKind.CLEARED]
    finally:
        await publisher.stop()


async def test_stream_is_trimmed(redis_server: RedisServer) -> None:
    client = redis_server.client()
    outbox = KVEventOutbox()

    publisher = outbox_publisher(redis_server, outbox, stream_maxlen=50)
    await publisher.start()
    try:
        for block in range(1, 1001):  # alternating kinds: nothing merges, 2000 events
            outbox.append(EventKind.STORED, [block], time.time())
            outbox.append(EventKind.REMOVED, [block], time.time())
        outbox.append(EventKind.STORED, [5000], time.time())
        await wait_until_async(
            lambda: redis_blocks(client) == {5000}, "the last block to reach Redis", timeout=5
        )
        # approximate MAXLEN trims whole stream nodes (100 entries by default)
        assert 50 <= client.xlen(KEYS.events(MODEL)) <= 50 + 100
    finally:
        await publisher.stop()


def test_default_identity() -> None:
    assert default_advertise_url("127.0.0.1", 8001) == "http://127.0.0.1:8001"
    assert default_advertise_url("::1", 8001) == "http://[::1]:8001"
    assert "0.0.0.0" not in default_advertise_url("0.0.0.0", 8001)
    assert replica_id_for("http://127.0.0.1:8001") == "127.0.0.1:8001"
    assert replica_id_for("https://replica-3.example.com/") == "replica-3.example.com:443"
    assert replica_id_for("http://[::1]:8001") == "::1:8001"
    with pytest.raises(ValueError, match="heartbeat_ttl"):
        PublisherConfig("redis://x", "r", "http://x", heartbeat_interval=1.0, heartbeat_ttl=1.0)


def test_cli_replica_publishes_and_deregisters_on_sigterm(
    redis_server: RedisServer, llama_dir: Path, tmp_path: Path
) -> None:
    client = redis_server.client()
    process = ReplicaProcess(
        llama_dir, tmp_path / "replica.log",
        "--dtype", "float32", "--kv-cache-tokens", "2048",
        "--redis", redis_server.url, "--heartbeat-interval", "0.2",
    )  # fmt: skip
    replica = f"127.0.0.1:{process.port}"
    try:
        response = httpx.post(
            f"{process.url}/v1/chat/completions",
            json={
                "model": llama_dir.name,
                "messages": [{"role": "user", "content": "tell me about caches " * 10}],
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        wait_until(lambda: redis_blocks(client, replica), "the replica to publish its blocks", timeout=5)
        beat = heartbeat(client, replica)
        assert beat["url"] == process.url and beat["model"] == llama_dir.name
        assert client.smembers(KEYS.replicas) == {replica.encode()}

        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert process.terminate() == -signal.SIGTERM, process.log_path.read_text()
        assert not client.exists(KEYS.heartbeat(replica), KEYS.blocks(replica))
        assert client.smembers(KEYS.replicas) == set()
        events = stream(client, llama_dir.name)
        assert events[-1].kind is EventKind.CLEARED
        assert replay(events, replica) == (events[-1].epoch, set())
    finally:
        process.kill()


def test_sigterm_leaves_the_index_at_once_and_still_finishes_in_flight_requests(
    redis_server: RedisServer, llama_dir: Path, tmp_path: Path
) -> None:
    """Gateways must stop routing to a stopping replica before its graceful period, not after."""
    profile = tmp_path / "slow.json"
    slow_decode = {"decode_base_s": 0.05, "decode_seq_s": 0.0, "decode_context_s": 0.0}
    prefill = {"prefill_base_s": 0.0, "prefill_token_s": 0.0, "prefill_pair_s": 0.0, "prefill_seq_s": 0.0}
    profile.write_text(json.dumps({"name": "slow-decode", **slow_decode, **prefill}))
    client = redis_server.client()
    process = ReplicaProcess(
        llama_dir, tmp_path / "replica.log", "--engine", "sim", "--profile", str(profile),
        "--redis", redis_server.url, "--heartbeat-interval", "0.2",
    )  # fmt: skip
    replica = f"127.0.0.1:{process.port}"
    try:
        body = {"model": llama_dir.name, "prompt": "hello", "max_tokens": 60, "stream": True}
        with httpx.stream("POST", f"{process.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")), "no first chunk"
            process.process.send_signal(signal.SIGTERM)
            wait_until(  # the stream still has ~2.5 s to go
                lambda: not (client.exists(KEYS.heartbeat(replica)) or client.smembers(KEYS.replicas)),
                "the replica to deregister after SIGTERM",
                timeout=1.0,
            )
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]", process.log_path.read_text()
        text_chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert sum(1 for chunk in text_chunks if chunk["choices"]) == 59  # the first one came earlier
        assert process.process.wait(timeout=30) == -signal.SIGTERM
    finally:
        process.kill()
