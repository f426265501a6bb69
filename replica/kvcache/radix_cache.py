"""Page-aligned radix prefix cache: a trie with one node per full KV page.

Each node owns one pool page whose K/V hold exactly its ``page_size`` tokens at their positions
after the node's ancestors, and carries the chained block hash of that prefix (kvroute.protocol),
so the tree and the gateway's index speak of the same blocks. Nodes are referenced (locked) by
the sequences using them; only unreferenced leaves are evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence

from kvroute.protocol import EventKind, chain_hash
from replica.kvcache.events import KVEventOutbox
from replica.kvcache.pool import PagePool


class RadixNode:
    __slots__ = ("block_hash", "children", "key", "last_access", "page", "parent", "ref")

    def __init__(self, key: tuple[int, ...], page: int, block_hash: int, parent: RadixNode | None) -> None:
        self.key = key
        self.page = page
        self.block_hash = block_hash
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.ref = 0
        self.last_access = 0


class RadixCache:
    """The tree, its LRU eviction, reference counting, and the event outbox."""

    def __init__(self, pool: PagePool, seed_hash: int, outbox: KVEventOutbox | None = None) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.seed_hash = seed_hash
        self.outbox = outbox
        self.root = RadixNode((), -1, seed_hash, None)
        self.root.ref = 1  # never evicted
        self._clock = itertools.count(1)
        self._evictable_leaves: set[RadixNode] = set()
        self.num_cached_pages = 0
        self.protected_pages = 0  # pages in the tree referenced by running sequences

    @property
    def evictable_pages(self) -> int:
        return self.num_cached_pages - self.protected_pages

    # -- lookup ---------------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], max_pages: int) -> list[RadixNode]:
        """Nodes of the longest cached whole-page prefix, at most ``max_pages`` of them (now used)."""
        matched = self._walk(token_ids, max_pages)
        now = next(self._clock)
        for node in matched:
            node.last_access = now
        return matched

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens are cached right now; a peek that leaves the LRU order alone."""
        return len(self._walk(token_ids, len(token_ids) // self.page_size)) * self.page_size

    def _walk(self, token_ids: Sequence[int], max_pages: int) -> list[RadixNode]:
        size, node, matched = self.page_size, self.root, []
        pages = min(max_pages, len(token_ids) // size)
        ids = tuple(token_ids[: pages * size])  # one conversion; its slices are the children's keys
        for start in range(0, pages * size, size):
            child = node.children.get(ids[start : start + size])
            if child is None:
                break
            matched.append(child)
            node = child
        return matched

    # -- references -----------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Pins ``node`` and its ancestors against eviction."""
        while node is not self.root:
            self._inc_ref(node)
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            self._dec_ref(node)
            node = node.parent  # type: ignore[assignment]

    def _inc_ref(self, node: RadixNode) -> None:
        if node.ref == 0:
            self.protected_pages += 1
            self._evictable_leaves.discard(node)
        node.ref += 1

    def _dec_ref(self, node: RadixNode) -> None:
        node.ref -= 1
        if node.ref == 0:
            self.protected_pages -= 1
            if not node.children:
                self._evictable_leaves.add(node)

    # -- insertion ------------------------------------------------------------------------------

    def insert_page(self, parent: RadixNode, page_tokens: tuple[int, ...], page: int) -> RadixNode:
        """Adds ``page`` (K/V already written) as a child of ``parent``, which the caller has locked.

        The caller's lock moves from ``parent`` down to the returned node. If the tree already
        holds these tokens, the existing node is returned: the caller must use its page and free
        its own.
        """
        child = parent.children.get(page_tokens)
        if child is None:
            child = RadixNode(page_tokens, page, chain_hash(parent.block_hash, page_tokens), parent)
            parent.children[page_tokens] = child
            self._evictable_leaves.discard(parent)
            self.num_cached_pages += 1
            self._emit(EventKind.STORED, [child.block_hash])
        child.last_access = next(self._clock)
        # A lock counts on a node and all its ancestors, so moving it one level down only adds
        # the child's count.
        self._inc_ref(child)
        return child

    # -- eviction -------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Frees up to ``num_pages`` unreferenced leaf pages, least recently used first."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[int] = []
        removed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and leaf.ref == 0 and not leaf.children
            del parent.children[leaf.key]
            self._evictable_leaves.discard(leaf)
            self.num_cached_pages -= 1
            freed.append(leaf.page)
            removed.append(leaf.block_hash)
            if parent is not self.root and parent.ref == 0 and not parent.children:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if freed:
            self.pool.free(freed)
            self._emit(EventKind.REMOVED, removed)
        return len(freed)

    def flush(self) -> None:
        """Drops every cached page; only valid while no sequence holds a reference."""
        if self.protected_pages:
            raise RuntimeError("cannot flush the prefix cache while requests are using it")
        pages = [node.page for node in self.iter_nodes()]
        self.root.children.clear()
        self._evictable_leaves.clear()
        self.num_cached_pages = 0
        self.pool.free(pages)
        self._emit(EventKind.CLEARED, [])

    # -- inspection -----------------------------------------------------------------------------

    def iter_nodes(self) -> list[RadixNode]:
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def block_hashes(self) -> set[int]:
        """Every cached block's hash: what a Redis snapshot of this replica must hold."""
        return {node.block_hash for node in self.iter_nodes()}

    def check_integrity(self) -> None:
        """Tree-internal invariants: counters, leaf set and reference counts agree with the tree."""
        nodes = self.iter_nodes()
        assert len(nodes) == self.num_cached_pages, "cached page counter drifted"
        assert len({n.page for n in nodes}) == len(nodes), "a page is in the tree twice"
        assert sum(1 for n in nodes if n.ref > 0) == self.protected_pages, "protected counter drifted"
        leaves = {n for n in nodes if n.ref == 0 and not n.children}
        assert leaves == self._evictable_leaves, "evictable leaf set drifted"
        for node in nodes:
            assert node.ref >= 0
            assert node.parent is not None
            assert node.ref <= node.parent.ref or node.parent is self.root, "child locked, parent not"

    def _emit(self, kind: EventKind, hashes: list[int]) -> None:
        if self.outbox is not None:
            self.outbox.append(kind, hashes, time.time())
