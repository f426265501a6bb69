"""The page-aligned radix cache on its own: matching, locking, LRU eviction, hashes, events."""

from __future__ import annotations

import pytest
import torch

from kvroute.protocol import EventKind, block_hashes, model_seed
from replica.kvcache.events import KVEventOutbox
from replica.kvcache.pool import KVPool
from replica.kvcache.radix_cache import RadixCache, RadixNode

PAGE = 4
SEED = model_seed("tiny", "fingerprint")


def make_cache(pages: int = 16) -> tuple[KVPool, RadixCache, KVEventOutbox]:
    pool = KVPool(1, pages, PAGE, 1, 1, torch.float32, "cpu")
    outbox = KVEventOutbox()
    return pool, RadixCache(pool, SEED, outbox), outbox


def insert(pool: KVPool, cache: RadixCache, tokens: list[int]) -> RadixNode:
    """Inserts every full page of ``tokens`` as one sequence would; returns the locked last node."""
    node = cache.root
    for start in range(0, len(tokens) // PAGE * PAGE, PAGE):
        page = pool.allocate(1)[0]
        new = cache.insert_page(node, tuple(tokens[start : start + PAGE]), page)
        if new.page != page:
            pool.free([page])
        node = new
    return node


def check(pool: KVPool, cache: RadixCache) -> None:
    cache.check_integrity()
    assert pool.num_free + cache.num_cached_pages == pool.num_pages


def test_matches_whole_pages_only() -> None:
    pool, cache, _ = make_cache()
    node = insert(pool, cache, list(range(10)))  # 2 full pages; the 2 leftover tokens are not cached
    cache.unlock(node)
    assert cache.num_cached_pages == 2
    assert len(cache.match_prefix(list(range(7)), max_pages=100)) == 1
    assert len(cache.match_prefix(list(range(8)), max_pages=100)) == 2
    assert len(cache.match_prefix(list(range(8)), max_pages=1)) == 1
    assert cache.match_prefix([0, 1, 2, 99, 4, 5, 6, 7], max_pages=100) == []
    check(pool, cache)


def test_node_hashes_are_the_protocol_chain() -> None:
    pool, cache, outbox = make_cache()
    tokens = list(range(100, 112))
    cache.unlock(insert(pool, cache, tokens))
    nodes = cache.match_prefix(tokens, max_pages=10)
    assert [n.block_hash for n in nodes] == block_hashes(tokens, PAGE, SEED)
    (event,) = outbox.drain()
    assert event.kind is EventKind.STORED and event.block_hashes == block_hashes(tokens, PAGE, SEED)


def test_locked_pages_are_never_evicted_and_lru_goes_first() -> None:
    pool, cache, outbox = make_cache()
    old = insert(pool, cache, [1] * 8)
    cache.unlock(old)
    held = insert(pool, cache, [2] * 8)  # stays locked
    recent = insert(pool, cache, [3] * 8)
    cache.unlock(recent)
    assert (cache.protected_pages, cache.evictable_pages) == (2, 4)
    outbox.drain()
    assert cache.evict(2) == 2  # the whole least recently used branch, leaf first
    assert cache.match_prefix([1] * 8, 10) == []
    (removed,) = outbox.drain()
    assert removed.kind is EventKind.REMOVED
    assert removed.block_hashes == block_hashes([1] * 8, PAGE, SEED)[::-1]
    assert cache.evict(100) == 2  # only [3]*8 can go
    assert len(cache.match_prefix([2] * 8, 10)) == 2
    cache.unlock(held)
    check(pool, cache)


def test_touching_a_prefix_protects_it_from_lru() -> None:
    pool, cache, _ = make_cache()
    for tokens in ([1] * 4, [2] * 4):
        cache.unlock(insert(pool, cache, tokens))
    cache.match_prefix([1] * 4, 10)  # now [2]*4 is the least recently used
    cache.evict(1)
    assert len(cache.match_prefix([1] * 4, 10)) == 1
    assert cache.match_prefix([2] * 4, 10) == []
    check(pool, cache)


def test_shared_prefix_is_stored_once_and_inner_nodes_wait_for_leaves() -> None:
    pool, cache, _ = make_cache()
    a = insert(pool, cache, [7] * 4 + [1] * 4)
    b = insert(pool, cache, [7] * 4 + [2] * 4)
    assert cache.num_cached_pages == 3
    cache.unlock(a)
    assert cache.evict(10) == 1  # [1]*4 leaf only: the shared page is still locked through b
    cache.unlock(b)
    assert cache.evict(10) == 2
    assert cache.num_cached_pages == 0
    check(pool, cache)


def test_duplicate_insert_returns_the_existing_page() -> None:
    pool, cache, _ = make_cache()
    first = insert(pool, cache, [5] * 4)
    page = pool.allocate(1)[0]
    second = cache.insert_page(cache.root, (5, 5, 5, 5), page)
    assert second is first and second.page != page and second.ref == 2
    pool.free([page])
    cache.unlock(first)
    cache.unlock(second)
    check(pool, cache)


def test_flush_clears_everything_and_emits_cleared() -> None:
    pool, cache, outbox = make_cache()
    node = insert(pool, cache, list(range(12)))
    with pytest.raises(RuntimeError):
        cache.flush()
    cache.unlock(node)
    outbox.drain()
    cache.flush()
    assert [e.kind for e in outbox.drain()] == [EventKind.CLEARED]
    assert cache.num_cached_pages == 0 and pool.num_free == pool.num_pages
    check(pool, cache)


def test_block_hashes_depend_on_model_identity() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens, 16, model_seed("a", "f")) != block_hashes(tokens, 16, model_seed("b", "f"))
    assert block_hashes(tokens, 16, model_seed("a", "f")) != block_hashes(tokens, 16, model_seed("a", "g"))
    assert block_hashes(tokens[:31], 16, SEED) == block_hashes(tokens, 16, SEED)[:1]
