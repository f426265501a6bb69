"""Gives sequences their pages: prefix hits from the radix cache, fresh pages from the pool.

The one place that knows both the pool and the tree, so the page accounting invariant
``free + cached + held by running sequences == total`` is kept (and checked) here.
"""

from __future__ import annotations

from collections.abc import Iterable

from replica.engine.sequence import Sequence
from replica.kvcache.pool import PagePool
from replica.kvcache.radix_cache import RadixCache


class KVManager:
    def __init__(self, pool: PagePool, cache: RadixCache) -> None:
        self.pool = pool
        self.cache = cache
        self.page_size = pool.page_size
        self.prefix_queries = 0  # prompt tokens looked up at first admission
        self.prefix_hits = 0  # of those, tokens served from the cache

    def admit(self, seq: Sequence) -> None:
        """Attaches the longest cached prefix, always leaving at least one token to compute."""
        max_pages = (len(seq.token_ids) - 1) // self.page_size
        matched = self.cache.match_prefix(seq.token_ids, max_pages)
        if matched:
            self.cache.lock(matched[-1])
            seq.tree_node = matched[-1]
        seq.page_table = [node.page for node in matched]
        seq.num_tree_pages = len(matched)
        seq.num_computed = len(matched) * self.page_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_computed

    def available_pages(self) -> int:
        return self.pool.num_free + self.cache.evictable_pages

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes the page table cover ``num_tokens`` tokens, evicting cached pages if needed."""
        missing = -(-num_tokens // self.page_size) - len(seq.page_table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            self.cache.evict(missing - self.pool.num_free)
            if missing > self.pool.num_free:
                return False
        seq.page_table.extend(self.pool.allocate(missing))
        return True

    def commit(self, seq: Sequence) -> None:
        """Publishes every page whose K/V is fully written into the tree (prompt and output alike)."""
        size = self.page_size
        full_pages = seq.num_computed // size
        while seq.num_tree_pages < full_pages:
            index = seq.num_tree_pages
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            own_page = seq.page_table[index]
            node = self.cache.insert_page(seq.tree_node, tokens, own_page)
            if node.page != own_page:  # another sequence cached the same prefix first: share it
                self.pool.free([own_page])
                seq.page_table[index] = node.page
            seq.tree_node = node
            seq.num_tree_pages += 1

    def release(self, seq: Sequence) -> None:
        """Unlocks the sequence's tree path and frees its private pages; its KV is forgotten."""
        if seq.tree_node is not self.cache.root:
            self.cache.unlock(seq.tree_node)
        self.pool.free(seq.private_pages)
        seq.tree_node = self.cache.root
        seq.page_table = []
        seq.num_tree_pages = 0
        seq.num_computed = 0

    def check_integrity(self, live: Iterable[Sequence]) -> None:
        """Asserts that every page is exactly one of free, cached, or held privately by a sequence."""
        self.cache.check_integrity()
        live = list(live)
        private = [page for seq in live for page in seq.private_pages]
        free = self.pool.free_page_ids()
        cached = [node.page for node in self.cache.iter_nodes()]
        assert len(free) + len(cached) + len(private) == self.pool.num_pages, (
            f"page leak: {len(free)} free + {len(cached)} cached + {len(private)} held "
            f"!= {self.pool.num_pages} total"
        )
        assert len(set(free) | set(cached) | set(private)) == self.pool.num_pages, "a page is owned twice"
        locks: dict[int, int] = {}
        for seq in live:
            node = seq.tree_node
            while node is not self.cache.root:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent  # type: ignore[assignment]
        for node in self.cache.iter_nodes():
            assert node.ref == locks.get(id(node), 0), "tree reference count disagrees with sequences"
