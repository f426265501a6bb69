"""The paged KV pool: one preallocated tensor cut into pages, and the list of free pages."""

from __future__ import annotations

from collections import deque

import torch


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class KVPool:
    """Storage for K and V of every layer, ``page_size`` token slots per page.

    Layout ``[layers, pages * page_size, 2, kv_heads, head_dim]``: a token's slot is
    ``page * page_size + offset``, the same in every layer, and holds its K and V side by side.
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
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv = torch.zeros(
            num_layers, num_pages * page_size, 2, num_kv_heads, head_dim, dtype=dtype, device=device
        )
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


def pages_for_budget(
    memory_bytes: int,
    page_size: int,
    bytes_per_token: int,
) -> int:
    """How many whole pages fit in a memory budget."""
    return max(1, memory_bytes // (page_size * bytes_per_token))
