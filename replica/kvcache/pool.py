"""The paged KV pool: pages and the list of free ones, and (torch engine) the tensor they cut up.

``PagePool`` is the bookkeeping alone, so the radix cache, the KV manager and the scheduler never
need torch; ``KVPool`` adds the K/V storage. The simulated engine uses a bare ``PagePool`` and
therefore never imports torch (torch is imported inside ``KVPool`` for that reason).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from replica.engine.config import EngineConfig


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """``num_pages`` pages of ``page_size`` token slots each, and which of them are free."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(f"asked for {count} KV pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def free_page_ids(self) -> list[int]:
        return list(self._free)


class KVPool(PagePool):
    """Storage for K and V of every layer, ``page_size`` token slots per page.

    Layout ``[layers, 2, kv_heads, pages, page_size, head_dim]`` (K then V): a token's slot is
    ``page * page_size + offset``, the same in every layer. Pages are gathered whole, and each
    (K or V, head) comes out as one contiguous ``[tokens, head_dim]`` matrix, which attention's
    matmuls read without a copy (2-3x faster decode attention than slot rows of K and V).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        import torch

        super().__init__(num_pages, page_size)
        self.kv = torch.zeros(
            num_layers, 2, num_kv_heads, num_pages, page_size, head_dim, dtype=dtype, device=device
        )


def pool_pages(config: EngineConfig, bytes_per_token: int) -> int:
    """Pages for ``kv_cache_tokens`` when given, else as many whole pages as fit the memory budget."""
    if config.kv_cache_tokens:
        return max(1, -(-config.kv_cache_tokens // config.block_size))
    budget = int(config.kv_cache_memory_gb * 1024**3)
    return max(1, budget // (config.block_size * bytes_per_token))
