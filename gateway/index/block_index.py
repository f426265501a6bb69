"""The gateway's in-memory cache index: which replica holds which block, answered per prompt prefix.

Every live replica owns one bit (its *slot*); each block hash maps to the bitmask of the replicas
holding it. Because a block hash chains its whole prefix, and a replica's cache holds a block only
with its parent, the replicas holding blocks 0..i of a prompt form a set that only shrinks as i
grows: a lookup bisects for the points where it shrinks, so its work grows with the logarithm of
the match, never with the index size. Each slot also keeps the set of hashes it holds, so
dropping a replica costs its own blocks only.

*Predicted* blocks are the gateway's own guess (a request was just routed there) kept in separate
masks until the replica confirms them with a stored event or their TTL passes. Expired predictions
are pruned lazily, from a heap ordered by expiry, whenever predictions are added or consulted.

No I/O and no locking: the mirror mutates it from one asyncio task, and lookups run on the same
event loop.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple


def _int_bytes(value: int) -> int:
    """An int object's size as pymalloc allocates it (rounded up to 8 bytes)."""
    return -(-sys.getsizeof(value) // 8) * 8


# CPython stores ints in 30-bit digits: a 64-bit hash takes 3 digits (36 bytes, 40 allocated).
# Masks of slots 0..7 only are the interpreter's cached small ints (≤ 256) and cost nothing.
_HASH_INT_BYTES = _int_bytes(2**63)
_SMALL_MASK_SLOTS = 8


class PrefixMatch(NamedTuple):
    """Leading blocks a replica holds: confirmed by its events, and counting predictions too."""

    confirmed: int
    with_predicted: int


class _Replica:
    __slots__ = ("bit", "blocks", "model", "predicted", "replica_id", "slot")

    def __init__(self, replica_id: str, model: str, slot: int) -> None:
        self.replica_id = replica_id
        self.model = model
        self.slot = slot
        self.bit = 1 << slot
        self.blocks: set[int] = set()
        self.predicted: dict[int, float] = {}  # block hash -> expiry (time.monotonic() seconds)


class BlockIndex:
    """Block hash → bitmask of replica slots, per-replica hash sets, and predicted blocks."""

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._predicted_masks: dict[int, int] = {}
        self._replicas: dict[str, _Replica] = {}
        self._by_slot: list[_Replica | None] = []
        self._free_slots: list[int] = []  # min-heap: reuse the lowest slot so masks stay short
        self._model_masks: dict[str, int] = {}
        self._model_members: dict[str, dict[str, _Replica]] = {}
        # (expiry, tie-breaker, replica, hash); entries whose prediction was confirmed, refreshed
        # or dropped meanwhile are recognised as stale when popped.
        self._expiry_heap: list[tuple[float, int, _Replica, int]] = []
        self._tie = itertools.count()
        self._num_predicted = 0

    # -- replicas -------------------------------------------------------------------------------

    def add_replica(self, replica_id: str, model: str) -> int:
        """Gives ``replica_id`` a slot (the lowest free one) and returns it.

        Adding a replica already present under the same model is a no-op; under another model
        it is removed first (its blocks meant nothing for the new model).
        """
        existing = self._replicas.get(replica_id)
        if existing is not None:
            if existing.model == model:
                return existing.slot
            self.remove_replica(replica_id)
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = len(self._by_slot)
            self._by_slot.append(None)
        replica = _Replica(replica_id, model, slot)
        self._by_slot[slot] = replica
        self._replicas[replica_id] = replica
        self._model_masks[model] = self._model_masks.get(model, 0) | replica.bit
        self._model_members.setdefault(model, {})[replica_id] = replica
        return slot

    def remove_replica(self, replica_id: str) -> None:
        """Drops the replica and everything it holds or was predicted to hold; unknown ids are ignored."""
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        self._clear(replica)
        self._by_slot[replica.slot] = None
        heapq.heappush(self._free_slots, replica.slot)
        mask = self._model_masks[replica.model] & ~replica.bit
        members = self._model_members[replica.model]
        del members[replica_id]
        if members:
            self._model_masks[replica.model] = mask
        else:
            del self._model_masks[replica.model]
            del self._model_members[replica.model]

    def has_replica(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def holds(self, replica_id: str, block_hash: int) -> bool:
        """Whether the replica's events have confirmed ``block_hash`` (predictions do not count)."""
        replica = self._replicas.get(replica_id)
        return replica is not None and block_hash in replica.blocks

    def num_blocks(self, replica_id: str) -> int:
        """How many blocks the replica is known to hold (0 for an unknown id)."""
        replica = self._replicas.get(replica_id)
        return 0 if replica is None else len(replica.blocks)

    def replica_blocks(self, replica_id: str) -> frozenset[int]:
        """A copy of the hashes the replica is known to hold (for checks and the admin API)."""
        return frozenset(self._replicas[replica_id].blocks)

    def replica_ids(self, model: str | None = None) -> list[str]:
        if model is None:
            return list(self._replicas)
        return list(self._model_members.get(model, ()))

    # -- events ---------------------------------------------------------------------------------

    def stored(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica now holds ``hashes`` (idempotent); confirms any prediction of them."""
        replica = self._replicas[replica_id]
        bit, blocks, masks = replica.bit, replica.blocks, self._masks
        predicted = replica.predicted
        for block_hash in hashes:
            if block_hash in blocks:
                continue
            blocks.add(block_hash)
            masks[block_hash] = masks.get(block_hash, 0) | bit
            if predicted and block_hash in predicted:
                self._drop_prediction(replica, block_hash)

    def removed(self, replica_id: str, hashes: Iterable[int]) -> None:
        """The replica no longer holds ``hashes`` (idempotent). Predictions stay: the request
        routed there may still store them."""
        replica = self._replicas[replica_id]
        bit, blocks, masks = replica.bit, replica.blocks, self._masks
        for block_hash in hashes:
            if block_hash not in blocks:
                continue
            blocks.remove(block_hash)
            mask = masks[block_hash] & ~bit
            if mask:
                masks[block_hash] = mask
            else:
                del masks[block_hash]

    def clear(self, replica_id: str) -> None:
        """The replica's cache restarted empty (a new epoch): drops its blocks and predictions."""
        self._clear(self._replicas[replica_id])

    def _clear(self, replica: _Replica) -> None:
        masks, keep = self._masks, ~replica.bit
        for block_hash in replica.blocks:
            mask = masks[block_hash] & keep
            if mask:
                masks[block_hash] = mask
            else:
                del masks[block_hash]
        replica.blocks = set()
        for block_hash in list(replica.predicted):
            self._drop_prediction(replica, block_hash)

    # -- predictions ----------------------------------------------------------------------------

    def predict(self, replica_id: str, hashes: Iterable[int], ttl_s: float, now: float | None = None) -> None:
        """Counts ``hashes`` as held by the replica (in ``lookup_with_predictions`` only) until a
        stored event confirms them or ``ttl_s`` passes. ``now`` is ``time.monotonic()`` seconds."""
        now = time.monotonic() if now is None else now
        self.prune_predictions(now)
        replica = self._replicas[replica_id]
        expiry = now + ttl_s
        bit, blocks, predicted, pmasks = replica.bit, replica.blocks, replica.predicted, self._predicted_masks
        for block_hash in hashes:
            if block_hash in blocks:
                continue
            if block_hash in predicted:
                # Refresh in place: the old heap entry is re-pushed at its new expiry when popped.
                predicted[block_hash] = max(predicted[block_hash], expiry)
                continue
            predicted[block_hash] = expiry
            pmasks[block_hash] = pmasks.get(block_hash, 0) | bit
            heapq.heappush(self._expiry_heap, (expiry, next(self._tie), replica, block_hash))
            self._num_predicted += 1

    def prune_predictions(self, now: float | None = None) -> None:
        """Forgets predictions that expired by ``now``; amortised O(log n) per prediction."""
        now = time.monotonic() if now is None else now
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            _, _, replica, block_hash = heapq.heappop(heap)
            expiry = replica.predicted.get(block_hash)
            if expiry is None:
                continue  # confirmed, cleared or removed meanwhile
            if expiry > now:
                heapq.heappush(heap, (expiry, next(self._tie), replica, block_hash))
            else:
                self._drop_prediction(replica, block_hash)

    def _drop_prediction(self, replica: _Replica, block_hash: int) -> None:
        del replica.predicted[block_hash]
        mask = self._predicted_masks[block_hash] & ~replica.bit
        if mask:
            self._predicted_masks[block_hash] = mask
        else:
            del self._predicted_masks[block_hash]
        self._num_predicted -= 1

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        """For every live replica of ``model``: how many leading blocks of ``hashes`` it holds.

        O(replicas of the model + drop-out points × log(len(hashes))) mask reads; see ``_walk``.
        """
        members = self._model_members.get(model)
        if not members:
            return {}
        result = dict.fromkeys(members, 0)
        masks = self._masks
        self._walk(result, len(hashes), self._model_masks[model], lambda i: masks.get(hashes[i], 0))
        return result

    def lookup_with_predictions(
        self, model: str, hashes: Sequence[int], now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Like ``lookup``, but per replica both the confirmed count and the count that treats
        unexpired predicted blocks as held. Twice the walk (once while nothing is predicted), plus
        pruning what expired."""
        self.prune_predictions(now)
        members = self._model_members.get(model)
        if not members:
            return {}
        confirmed = dict.fromkeys(members, 0)
        alive = self._model_masks[model]
        masks, pmasks = self._masks, self._predicted_masks
        self._walk(confirmed, len(hashes), alive, lambda i: masks.get(hashes[i], 0))
        if not pmasks:  # no predictions anywhere: both counts are the same
            return {rid: PrefixMatch(blocks, blocks) for rid, blocks in confirmed.items()}
        combined = dict.fromkeys(members, 0)
        self._walk(combined, len(hashes), alive, lambda i: masks.get(hashes[i], 0) | pmasks.get(hashes[i], 0))
        return {rid: PrefixMatch(confirmed[rid], combined[rid]) for rid in members}

    def _walk(self, result: dict[str, int], length: int, alive: int, holders: Callable[[int], int]) -> None:
        """Records, for each replica in ``alive``, how many leading blocks it holds.

        A replica that holds a block holds its parent too (its radix tree inserts parents first and
        evicts leaves only), so the set of replicas holding blocks 0..i only shrinks as i grows.
        Each point where it shrinks is found by bisection: a prompt matched in full by a few
        replicas costs about log2(length) mask reads, not length.
        """
        position = 0
        while alive and position < length:
            held = holders(position) & alive
            if held != alive:
                _record(result, self._by_slot, alive & ~held, position)
                alive = held
                if not alive:
                    return
            low, high = position, length - 1  # every replica in ``alive`` holds block ``low``
            while low < high:
                middle = (low + high + 1) // 2
                if holders(middle) & alive == alive:
                    low = middle
                else:
                    high = middle - 1
            position = low + 1
        _record(result, self._by_slot, alive, length)

    # -- size -----------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Distinct block hashes held by at least one replica (predictions not counted)."""
        return len(self._masks)

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def num_predicted(self) -> int:
        """Live (replica, block) predictions, expired ones included until the next prune."""
        return self._num_predicted

    def memory_bytes(self) -> int:
        """Estimated bytes held by the confirmed index, in O(replicas).

        Container sizes are exact (``sys.getsizeof`` of the hash → mask dict and of every
        replica's set); the int objects inside are estimated: one 64-bit int per (replica, block)
        pair (each replica's set references the int it was given) and one mask int per block
        once masks outgrow the small-int cache. tests/unit/test_block_index.py checks this estimate
        against ``tracemalloc``.
        """
        pairs = sum(len(replica.blocks) for replica in self._replicas.values())
        total = sys.getsizeof(self._masks) + pairs * _HASH_INT_BYTES
        total += sum(sys.getsizeof(replica.blocks) for replica in self._replicas.values())
        if len(self._by_slot) > _SMALL_MASK_SLOTS:
            total += len(self._masks) * _int_bytes(1 << (len(self._by_slot) - 1))
        return total

    def bytes_per_block(self) -> float:
        """``memory_bytes()`` per distinct indexed block (0.0 when empty)."""
        return self.memory_bytes() / len(self._masks) if self._masks else 0.0


def _record(result: dict[str, int], by_slot: list[_Replica | None], bits: int, depth: int) -> None:
    """Sets ``depth`` as the match length of every replica whose bit is in ``bits``."""
    while bits:
        low = bits & -bits
        replica = by_slot[low.bit_length() - 1]
        assert replica is not None
        result[replica.replica_id] = depth
        bits ^= low
