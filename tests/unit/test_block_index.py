"""BlockIndex: leading-prefix counts per replica, model isolation, removal, predictions, cost."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from gateway.index.block_index import BlockIndex, PrefixMatch


def chain(n: int, rng: random.Random) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


def test_lookup_counts_leading_blocks_per_replica(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m")
    index.add_replica("b", "m")
    index.add_replica("c", "m")
    prompt = chain(8, rng)
    index.stored("a", prompt[:5])
    index.stored("b", prompt)
    index.stored("c", prompt[1:])  # holds later blocks but not block 0: no usable prefix
    assert index.lookup("m", prompt) == {"a": 5, "b": 8, "c": 0}
    assert index.lookup("m", prompt[:3]) == {"a": 3, "b": 3, "c": 0}
    assert index.lookup("m", []) == {"a": 0, "b": 0, "c": 0}
    assert index.lookup("m", chain(4, rng)) == {"a": 0, "b": 0, "c": 0}
    # Replicas evict leaves first, so what remains of a chain is always a prefix of it.
    index.removed("b", prompt[:2:-1])
    assert index.lookup("m", prompt)["b"] == 3
    assert index.size == 8


def test_models_are_isolated(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m1")
    index.add_replica("b", "m2")
    prompt = chain(4, rng)
    index.stored("a", prompt)
    index.stored("b", prompt)
    assert index.lookup("m1", prompt) == {"a": 4}
    assert index.lookup("m2", prompt) == {"b": 4}
    assert index.lookup("unknown", prompt) == {}
    assert sorted(index.replica_ids()) == ["a", "b"]
    assert index.replica_ids("m2") == ["b"]


def test_stored_and_removed_are_idempotent(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m")
    prompt = chain(4, rng)
    for _ in range(2):
        index.stored("a", prompt)
    assert index.lookup("m", prompt) == {"a": 4}
    for _ in range(2):
        index.removed("a", prompt[2:])
    index.removed("a", chain(3, rng))  # never held: ignored
    assert index.lookup("m", prompt) == {"a": 2}
    assert index.replica_blocks("a") == frozenset(prompt[:2])
    assert index.size == 2


def test_remove_replica_frees_its_slot_and_blocks(rng: random.Random) -> None:
    index = BlockIndex()
    slots = [index.add_replica(name, "m") for name in ("a", "b", "c")]
    assert slots == [0, 1, 2]
    assert index.add_replica("b", "m") == 1  # already there: same slot
    prompt = chain(6, rng)
    shared, own = prompt[:3], prompt[3:]
    index.stored("a", shared)
    index.stored("b", prompt)
    index.remove_replica("b")
    index.remove_replica("b")  # unknown now: ignored
    assert not index.has_replica("b")
    assert index.num_replicas == 2
    assert index.size == len(shared)
    assert index.lookup("m", prompt) == {"a": 3, "c": 0}
    # The freed slot is reused, and the newcomer does not inherit b's blocks.
    assert index.add_replica("d", "m") == 1
    assert index.lookup("m", prompt) == {"a": 3, "c": 0, "d": 0}
    assert index.lookup("m", own) == {"a": 0, "c": 0, "d": 0}
    # The last replica of a model takes the model with it.
    index.remove_replica("a")
    index.remove_replica("c")
    index.remove_replica("d")
    assert index.lookup("m", prompt) == {}
    assert index.size == 0


def test_add_replica_under_another_model_starts_empty(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m1")
    prompt = chain(3, rng)
    index.stored("a", prompt)
    index.add_replica("a", "m2")
    assert index.lookup("m1", prompt) == {}
    assert index.lookup("m2", prompt) == {"a": 0}
    assert index.size == 0


def test_clear_drops_blocks_and_predictions(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m")
    prompt = chain(4, rng)
    index.stored("a", prompt[:2])
    index.predict("a", prompt, ttl_s=10, now=0)
    index.clear("a")
    assert index.lookup_with_predictions("m", prompt, now=1) == {"a": PrefixMatch(0, 0)}
    assert index.size == 0
    assert index.num_predicted == 0


def test_predictions_count_separately_until_confirmed(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m")
    index.add_replica("b", "m")
    prompt = chain(6, rng)
    index.stored("a", prompt[:2])
    index.predict("a", prompt, ttl_s=5, now=100)
    assert index.num_predicted == 4  # the two held blocks are not predictions
    assert index.lookup("m", prompt) == {"a": 2, "b": 0}
    assert index.lookup_with_predictions("m", prompt, now=101) == {
        "a": PrefixMatch(2, 6),
        "b": PrefixMatch(0, 0),
    }
    # A stored event confirms part of the prediction; the rest stays predicted.
    index.stored("a", prompt[2:4])
    assert index.num_predicted == 2
    assert index.lookup_with_predictions("m", prompt, now=102)["a"] == PrefixMatch(4, 6)
    # A removed event does not cancel a prediction (the routed request may still store it).
    index.removed("a", prompt[3:4])
    assert index.lookup_with_predictions("m", prompt, now=102)["a"] == PrefixMatch(3, 3)


def test_predictions_expire_and_are_pruned(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m")
    prompt = chain(4, rng)
    index.predict("a", prompt, ttl_s=1, now=0)
    assert index.lookup_with_predictions("m", prompt, now=0.5)["a"] == PrefixMatch(0, 4)
    # Refreshing extends the expiry.
    index.predict("a", prompt[:2], ttl_s=1, now=0.9)
    assert index.lookup_with_predictions("m", prompt, now=1.5)["a"] == PrefixMatch(0, 2)
    assert index.num_predicted == 2
    assert index.lookup_with_predictions("m", prompt, now=2.0)["a"] == PrefixMatch(0, 0)
    assert index.num_predicted == 0
    # Many short-lived predictions over time never pile up: predict() prunes what expired.
    for step in range(1000):
        index.predict("a", chain(8, rng), ttl_s=1, now=10 + step)
    assert index.num_predicted <= 16
    assert len(index._expiry_heap) <= 16
    assert len(index._predicted_masks) <= 16


def test_removing_a_replica_drops_its_predictions(rng: random.Random) -> None:
    index = BlockIndex()
    index.add_replica("a", "m")
    prompt = chain(3, rng)
    index.predict("a", prompt, ttl_s=10, now=0)
    index.remove_replica("a")
    index.add_replica("b", "m")  # reuses a's slot
    assert index.lookup_with_predictions("m", prompt, now=1) == {"b": PrefixMatch(0, 0)}
    assert index.num_predicted == 0
    index.prune_predictions(now=100)  # stale heap entries of the dropped replica are skipped
    assert not index._expiry_heap


class CountingDict(dict[int, int]):
    """The masks dict, counting how many hashes a lookup asks it about."""

    gets = 0

    def get(self, key: int, default: int | None = None) -> int | None:  # type: ignore[override]
        CountingDict.gets += 1
        return super().get(key, default)


def test_lookup_work_is_proportional_to_the_match(rng: random.Random) -> None:
    index = BlockIndex()
    for r in range(64):
        index.add_replica(f"r{r}", "m")
        index.stored(f"r{r}", chain(2000, rng))  # unrelated blocks: a large index
    prompt = chain(512, rng)
    index.stored("r7", prompt[:100])
    index.stored("r9", prompt[:40])
    index._masks = CountingDict(index._masks)

    CountingDict.gets = 0
    result = index.lookup("m", chain(512, rng))  # a miss at block 0
    assert CountingDict.gets == 1
    assert set(result.values()) == {0} and len(result) == 64

    # Two drop-out points (block 40, block 100), each found by bisecting 512 blocks: about
    # 2 x (log2(512) + 1) reads, where a walk block by block would read 101.
    CountingDict.gets = 0
    result = index.lookup("m", prompt)
    assert CountingDict.gets <= 2 * (9 + 2)
    assert result["r7"] == 100 and result["r9"] == 40
    assert sum(result.values()) == 140

    CountingDict.gets = 0
    index.lookup_with_predictions("m", prompt)
    assert CountingDict.gets <= 4 * (9 + 2)  # the confirmed walk and the combined walk


def test_memory_estimate_matches_tracemalloc(rng: random.Random) -> None:
    """``memory_bytes`` against what the allocator really handed out, for 8 and 64 replicas.

    Measured here (CPython 3.11, 64-bit hashes, each block held by one replica): about 170 B per
    block with 8 replicas, 140 B with 64 (dict entry + set entry + the 40-byte int object, with
    the hash tables' spare capacity).
    """
    for replicas, per_replica in ((8, 10_000), (64, 2_000)):
        index = BlockIndex()
        for r in range(replicas):
            index.add_replica(f"r{r}", "m")
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            batches = [chain(per_replica, rng) for _ in range(replicas)]
            for r, batch in enumerate(batches):
                index.stored(f"r{r}", batch)
            del batches  # the index now holds the only references to the ints
            measured = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        per_block = measured / index.size
        assert 100 < per_block < 250
        assert index.bytes_per_block() == pytest.approx(per_block, rel=0.3)


def test_bisecting_lookup_agrees_with_a_block_by_block_walk(rng: random.Random) -> None:
    """Random prefix-closed holdings (as replicas' radix caches always are), many prompts."""
    index = BlockIndex()
    chains = [chain(300, rng) for _ in range(6)]
    held: dict[str, set[int]] = {}
    predicted: dict[str, set[int]] = {}
    for r in range(20):
        rid = f"r{r}"
        index.add_replica(rid, "m")
        held[rid] = set()
        for blocks in rng.sample(chains, 3):
            prefix = blocks[: rng.randrange(len(blocks) + 1)]
            index.stored(rid, prefix)
            held[rid].update(prefix)
        guess = rng.choice(chains)[: rng.randrange(300)]
        index.predict(rid, guess, ttl_s=60)
        predicted[rid] = held[rid] | set(guess)
    for blocks in chains:
        prompt = blocks[: rng.randrange(1, len(blocks) + 1)]
        expected = {rid: leading(prompt, mine) for rid, mine in held.items()}
        assert index.lookup("m", prompt) == expected
        both = index.lookup_with_predictions("m", prompt)
        assert {rid: match.confirmed for rid, match in both.items()} == expected
        assert {rid: match.with_predicted for rid, match in both.items()} == {
            rid: leading(prompt, mine) for rid, mine in predicted.items()
        }


def leading(prompt: list[int], held: set[int]) -> int:
    return next((i for i, block in enumerate(prompt) if block not in held), len(prompt))
