"""The bridge's reading of vLLM's KV events: the decoder on bytes built as vLLM builds them, the
re-hashing of vLLM blocks into kvroute's chain, and the in-order delivery over real ZMQ sockets
(gaps replayed or turned into a new epoch, a restarted numbering noticed)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest

from bridge.chains import ChainTranslator
from bridge.subscriber import EventSubscriber, Restart
from bridge.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedBatch,
    decode_frames,
    decode_payload,
)
from kvroute.protocol import EventKind, block_hashes, model_seed
from launcher.local_redis import free_port
from tests.helpers import vllm_events as vllm

SEED = model_seed("m", "f" * 64)
TOKENS = [random.Random(7).randrange(1, 50_000) for _ in range(3 * 128 + 40)]


def test_decodes_map_encoded_events_as_vllm_0_32_sends_them() -> None:
    body = vllm.payload(
        vllm.stored([11, 12], None, TOKENS[:256], 128),
        vllm.BlockRemoved([11], "GPU"),
        vllm.AllBlocksCleared(),
    )
    ts, events = decode_payload(body)
    assert ts == 1.0
    assert events == [
        BlockStored([11, 12], None, TOKENS[:256], 128, "GPU", True, None),
        BlockRemoved([11], "GPU", None),
        AllBlocksCleared(),
    ]


def test_decodes_array_encoded_events_of_older_vllm_and_bytes_hashes() -> None:
    sha = bytes(range(32))
    old = vllm.OldBlockStored([5], None, TOKENS[:16], 16, None)
    ts, events = decode_payload(msgspec.msgpack.encode(vllm.EventBatch(2.5, [old])))
    assert ts == 2.5
    assert events == [BlockStored([5], None, TOKENS[:16], 16, None, True, None)]
    _, events = decode_payload(vllm.payload(vllm.stored([sha], sha[::-1], TOKENS[:16], 16)))
    assert events[0].block_hashes == [sha] and events[0].parent_block_hash == sha[::-1]


def test_lora_and_multimodal_blocks_are_not_plain() -> None:
    lora = vllm.BlockStored([1], None, TOKENS[:16], 16, 3, None, "adapter")
    media = vllm.BlockStored([2], None, TOKENS[:16], 16, None, None, None, extra_keys=[("img", 0)])
    salted_none = vllm.BlockStored([3], None, TOKENS[:16], 16, None, None, None, extra_keys=[None])
    _, events = decode_payload(vllm.payload(lora, media, salted_none))
    assert [event.plain for event in events] == [False, False, True]


@pytest.mark.parametrize(
    "frames",
    [
        [b"", (0).to_bytes(8, "big")],
        [b"", b"\x00\x01", vllm.payload()],
        [b"", (0).to_bytes(8, "big"), b"\xc1not msgpack"],
        [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1})],
        [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}]])],
        [b"", (0).to_bytes(8, "big"), vllm.payload(vllm.stored([1, 2], None, TOKENS[:20], 16))],
        [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [["BlockRemoved", [1.5], None]]])],
    ],
    ids=[
        "two-frames",
        "short-seq",
        "not-msgpack",
        "not-a-batch",
        "unknown-event",
        "token-count",
        "float-hash",
    ],
)
def test_malformed_messages_are_refused(frames: list[bytes]) -> None:
    with pytest.raises(MalformedBatch):
        decode_frames(frames)


def test_vllm_blocks_become_the_kvroute_chain_of_the_same_tokens() -> None:
    translator = ChainTranslator(SEED, 16)
    first = translator.apply(BlockStored([101, 102], None, TOKENS[:256], 128))
    second = translator.apply(BlockStored([103], 102, TOKENS[256:384], 128))
    expected = block_hashes(TOKENS[:384], 16, SEED)
    assert first == [(EventKind.STORED, expected[:16])]
    assert second == [(EventKind.STORED, expected[16:24])]
    assert translator.num_blocks == 24


def test_removal_takes_every_kvroute_block_a_vllm_block_covered() -> None:
    translator = ChainTranslator(SEED, 16)
    translator.apply(BlockStored([101, 102], None, TOKENS[:256], 128))
    expected = block_hashes(TOKENS[:256], 16, SEED)
    assert translator.apply(BlockRemoved([102])) == [(EventKind.REMOVED, expected[8:16])]
    assert translator.apply(BlockRemoved([102])) == []  # twice: nothing more to remove
    # the removed block's chain end is still known: a child stored under it later is indexed
    assert (
        translator.apply(BlockStored([103], 102, TOKENS[256:384], 128))[0][1]
        == block_hashes(TOKENS[:384], 16, SEED)[16:24]
    )


def test_an_unknown_parent_skips_the_block_and_its_descendants() -> None:
    translator = ChainTranslator(SEED, 16)
    assert translator.apply(BlockStored([201], 999, TOKENS[:128], 128)) == []
    assert translator.apply(BlockStored([202], 201, TOKENS[128:256], 128)) == []
    assert translator.unknown_parent == 2 and translator.num_blocks == 0


def test_clear_forgets_blocks_and_chain_ends() -> None:
    translator = ChainTranslator(SEED, 16)
    translator.apply(BlockStored([101], None, TOKENS[:128], 128))
    assert translator.apply(AllBlocksCleared()) == [(EventKind.CLEARED, [])]
    assert translator.num_blocks == 0
    assert translator.apply(BlockStored([102], 101, TOKENS[128:256], 128)) == []


def test_one_prefix_held_twice_is_removed_when_the_last_holder_goes() -> None:
    translator = ChainTranslator(SEED, 16)
    translator.apply(BlockStored([101], None, TOKENS[:128], 128, medium="GPU"))
    assert translator.apply(BlockStored([101], None, TOKENS[:128], 128, medium="CPU")) == []  # offloaded copy
    assert translator.apply(BlockRemoved([101], medium="GPU")) == []
    assert translator.apply(BlockRemoved([101], medium="CPU")) == [
        (EventKind.REMOVED, block_hashes(TOKENS[:128], 16, SEED))
    ]


def test_blocks_that_are_not_a_plain_token_prefix_are_skipped() -> None:
    translator = ChainTranslator(SEED, 16)
    assert translator.apply(BlockStored([1], None, TOKENS[:128], 128, plain=False)) == []
    assert translator.apply(BlockStored([2], None, TOKENS[:128], 128, group_idx=1)) == []
    assert translator.skipped == 2


def test_a_vllm_block_size_kvroute_does_not_divide_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        ChainTranslator(SEED, 16).apply(BlockStored([1], None, TOKENS[:24], 24))


# -- delivery over real ZMQ sockets ------------------------------------------------------------


class Received:
    """The subscriber's stream read by a task into a queue, so a test can wait with a timeout (an
    async generator cancelled mid-wait is finished for good)."""

    def __init__(self, subscriber: EventSubscriber) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.task = asyncio.create_task(self._read(subscriber))

    async def _read(self, subscriber: EventSubscriber) -> None:
        async for item in subscriber.stream():
            await self.queue.put(item)

    async def take(self, count: int) -> list[object]:
        async with asyncio.timeout(10):
            return [await self.queue.get() for _ in range(count)]

    def stop(self) -> None:
        self.task.cancel()


Wire = tuple[vllm.FakeVllmPublisher, EventSubscriber, Received]


@asynccontextmanager
async def wired(
    replay: bool = True,
) -> AsyncIterator[tuple[vllm.FakeVllmPublisher, EventSubscriber, Received]]:
    """A vLLM-like publisher (with its replay socket, or none) and a subscriber reading it, once
    batches come through (ZMQ drops what a PUB sends before the subscription arrives), with every
    batch sent so far taken: the next one expected is the next one sent."""
    events = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}" if replay else None
    publisher = vllm.FakeVllmPublisher(events, replay_endpoint)
    subscriber = EventSubscriber(events, replay_endpoint)
    received = Received(subscriber)
    try:
        async with asyncio.timeout(10):
            while received.queue.empty():
                publisher.send(vllm.AllBlocksCleared())
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)  # a probe still in flight
        while not received.queue.empty():
            assert not isinstance(received.queue.get_nowait(), Restart)
        yield publisher, subscriber, received
    finally:
        received.stop()
        subscriber.close()
        publisher.close()


def _seqs(items: list[object]) -> list[object]:
    return ["restart" if isinstance(item, Restart) else item.seq for item in items]


@pytest.mark.anyio
async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async with wired() as (publisher, subscriber, stream):
        n, gaps, replays = publisher.next_seq, subscriber.gaps, publisher.replays_served
        publisher.send(vllm.stored([1], None, TOKENS[:16], 16), skip=True)
        publisher.send(vllm.stored([2], 1, TOKENS[16:32], 16), skip=True)
        publisher.send(vllm.stored([3], 2, TOKENS[32:48], 16))
        batches = await stream.take(3)
        assert _seqs(batches) == [n, n + 1, n + 2]
        assert [batch.events[0].block_hashes for batch in batches] == [[1], [2], [3]]
        assert subscriber.gaps == gaps + 1 and publisher.replays_served == replays + 1


@pytest.mark.anyio
async def test_a_gap_nothing_can_replay_is_a_restart() -> None:
    async with wired() as (publisher, _, stream):
        n = publisher.next_seq
        publisher.send(vllm.AllBlocksCleared(), skip=True)
        publisher.forget_buffer()  # fell out of vLLM's buffer
        publisher.send(vllm.AllBlocksCleared())
        assert _seqs(await stream.take(2)) == ["restart", n + 1]


@pytest.mark.anyio
async def test_without_a_replay_socket_a_gap_is_a_restart() -> None:
    async with wired(replay=False) as (publisher, _, stream):
        n = publisher.next_seq
        publisher.send(vllm.AllBlocksCleared(), skip=True)
        publisher.send(vllm.AllBlocksCleared())
        assert _seqs(await stream.take(2)) == ["restart", n + 1]


@pytest.mark.anyio
async def test_numbering_that_starts_again_is_a_restart() -> None:
    async with wired() as (publisher, subscriber, stream):
        n, restarts = publisher.next_seq, subscriber.restarts
        publisher.send(vllm.AllBlocksCleared())
        publisher.restart_numbering()
        publisher.send(vllm.AllBlocksCleared())
        assert _seqs(await stream.take(3)) == [n, "restart", 0]
        assert subscriber.restarts == restarts + 1


@pytest.mark.anyio
async def test_a_catch_up_replays_what_vllm_buffers_without_duplicates() -> None:
    async with wired() as (publisher, subscriber, stream):
        subscriber.request_catch_up()
        n = publisher.send(vllm.AllBlocksCleared())  # on the live socket too
        assert _seqs(await stream.take(n + 1)) == list(range(n + 1))  # all buffered, in order
        publisher.send(vllm.AllBlocksCleared())
        assert _seqs(await stream.take(1)) == [n + 1]  # n, queued live too, was not repeated
        assert subscriber.restarts == 0


@pytest.mark.anyio
async def test_a_catch_up_takes_what_is_left_of_vllm_s_buffer() -> None:
    async with wired() as (publisher, subscriber, stream):
        n = publisher.send(vllm.AllBlocksCleared(), skip=True)
        publisher.forget_buffer(keep_latest=1)  # batches 0..n-1 fell out; n is still there
        subscriber.request_catch_up()
        assert _seqs(await stream.take(1)) == [n]
        publisher.send(vllm.AllBlocksCleared())
        assert _seqs(await stream.take(1)) == [n + 1]
