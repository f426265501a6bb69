"""vLLM's cached blocks turned into kvroute's chain hashes, so one index covers both engines.

vLLM's block hashes come from its own hash function and seed; only the token ids it sends with
each stored block are engine-neutral. Each vLLM block of ``B`` tokens is cut into ``B / b``
kvroute blocks of ``b`` tokens (``b`` divides ``B``: 16 into vLLM's 16 on GPUs or 128 on CPUs) and
hashed with ``kvroute.protocol.block_hashes``, chained from the kvroute hash that ends the
parent's vLLM block (from the model seed for a first block). So the gateway's index and lookup
stay at kvroute's block size, whatever mix of engines serves the model.

A stored block whose parent was never seen (the bridge started after it, or an event was lost)
has an unknown prefix: it and every block chained under it are skipped (counted in
``unknown_parent``), never guessed; the gateway then sees less cached than there is, never more.
Chain ends stay known after a block is removed (bounded, oldest dropped first), since vLLM may
evict a parent before re-storing a child under it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from bridge.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, VllmHash
from kvroute.protocol import EventKind, block_hashes

MAX_KNOWN_CHAIN_ENDS = 1_000_000  # vLLM blocks whose chain end is remembered after removal
_ACCEPTED_MEDIA = (None, "GPU", "CPU")  # where vLLM keeps a block it computes with (not a disk tier)

Change = tuple[EventKind, list[int]]


class ChainTranslator:
    """One vLLM server's events in, kvroute's (kind, hashes) changes out."""

    def __init__(self, seed: int, block_size: int) -> None:
        self.seed = seed
        self.block_size = block_size
        self._covered: dict[tuple[str | None, VllmHash], list[int]] = {}  # held now, by (medium, hash)
        self._chain_ends: OrderedDict[VllmHash, int] = OrderedDict()  # vLLM hash -> last kvroute hash
        self._holders: Counter[int] = Counter()  # kvroute hash -> vLLM blocks covering it now
        self.unknown_parent = 0  # stored vLLM blocks skipped: their prefix is unknown
        self.skipped = 0  # stored vLLM blocks skipped: LoRA / multimodal / another KV group

    @property
    def num_blocks(self) -> int:
        """kvroute blocks held now."""
        return len(self._holders)

    def apply(self, event: KVEvent) -> list[Change]:
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return self._removed(event)
        assert isinstance(event, AllBlocksCleared)
        return self.clear()

    def clear(self) -> list[Change]:
        """Forget everything held (chain ends too: a cleared or restarted vLLM starts over)."""
        self._covered.clear()
        self._chain_ends.clear()
        self._holders.clear()
        return [(EventKind.CLEARED, [])]

    def _stored(self, event: BlockStored) -> list[Change]:
        if event.block_size % self.block_size:
            raise ValueError(
                f"vLLM's block size {event.block_size} is not a multiple of kvroute's {self.block_size}:"
                " start the bridge with a --block-size that divides it"
            )
        if not event.plain or event.group_idx not in (None, 0) or event.medium not in _ACCEPTED_MEDIA:
            self.skipped += len(event.block_hashes)
            return []
        if event.parent_block_hash is None:
            previous: int | None = self.seed
        else:
            previous = self._chain_ends.get(event.parent_block_hash)
        if previous is None:
            self.unknown_parent += len(event.block_hashes)
            return []
        new: list[int] = []
        size = event.block_size
        for index, vllm_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * size : (index + 1) * size]
            hashes = block_hashes(tokens, self.block_size, previous)
            previous = hashes[-1]
            self._remember_end(vllm_hash, previous)
            key = (event.medium, vllm_hash)
            if key in self._covered:
                continue  # stored again (another request made it): already counted
            self._covered[key] = hashes
            for block in hashes:
                self._holders[block] += 1
                if self._holders[block] == 1:
                    new.append(block)
        return [(EventKind.STORED, new)] if new else []

    def _removed(self, event: BlockRemoved) -> list[Change]:
        gone: list[int] = []
        for vllm_hash in event.block_hashes:
            hashes = self._covered.pop((event.medium, vllm_hash), None)
            for block in hashes or ():
                self._holders[block] -= 1
                if self._holders[block] == 0:
                    del self._holders[block]
                    gone.append(block)
        return [(EventKind.REMOVED, gone)] if gone else []

    def _remember_end(self, vllm_hash: VllmHash, end: int) -> None:
        self._chain_ends[vllm_hash] = end
        self._chain_ends.move_to_end(vllm_hash)
        if len(self._chain_ends) > MAX_KNOWN_CHAIN_ENDS:
            self._chain_ends.popitem(last=False)
