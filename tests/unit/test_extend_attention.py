"""Prefill attention on AMX tiles or AVX512-BF16 (``ops.extend_attention``) against SDPA in fp64:
chunks that fill their pages or end inside one, the tails of longer contexts read from scattered
pages, a cache hit's few tokens after a long prefix, single tokens, several chunks of one shape in
one call (each the same alone), and the head sizes it takes or leaves to SDPA. Runs only on CPUs
with one of the two (the kernel takes AMX's tiles where both are)."""

from __future__ import annotations

import pytest
import torch

from replica.model import ops
from replica.model.attention import AttentionBatch, PrefillGroup, paged_attention
from tests.unit.test_prefill_attention import causal_reference

KV_HEADS, HEADS, PAGE_SIZE, PAGES = 3, 9, 16, 512


@pytest.fixture(autouse=True)
def needs_amx() -> None:
    if not ops.native_prefill_attention(torch.bfloat16, "cpu", 64):
        pytest.skip("no AMX or AVX512-BF16 on this CPU (or no compiler): prefill attention is torch's here")


def _attend(
    q: torch.Tensor, kv_cache: torch.Tensor, tables: list[list[int]], length: int, context: int
) -> torch.Tensor:
    """The chunks' attention through ``paged_attention`` with the kernel's group (every chunk's
    context pages and start rows); their own K/V are already in the pool."""
    dim = kv_cache.shape[-1]
    every_slot = torch.tensor(tables).unsqueeze(-1) * PAGE_SIZE + torch.arange(PAGE_SIZE)
    slots = every_slot.flatten(1)[:, context - length : context].flatten()
    new_kv = kv_cache.view(2, KV_HEADS, -1, dim)[:, :, slots].permute(2, 0, 1, 3).contiguous()
    starts = [chunk * length for chunk in range(len(tables))]
    pages = torch.tensor([page for table in tables for page in table])
    group = PrefillGroup(starts, length, context, None, pages, torch.tensor(starts))
    return paged_attention(q, new_kv, kv_cache, AttentionBatch(slots, 0, None, None, [group]), 0)


@pytest.mark.parametrize(
    ("length", "context"),
    [
        (1, 1),
        (16, 16),  # one full page
        (45, 45),  # pages and a part
        (512, 512),  # a cold prompt's first chunk
        (512, 1024),  # its second: the tail of a longer context
        (32, 1568),  # a cache hit: a few tokens after a long prefix
        (1, 700),
        (37, 101),
    ],
)
@pytest.mark.parametrize("dim", [32, 64, 96, 128])
@pytest.mark.parametrize("count", [1, 3])
def test_extend_attention_matches_sdpa(length: int, context: int, dim: int, count: int) -> None:
    generator = torch.Generator().manual_seed(length * 1000 + context + dim)
    kv_cache = torch.randn(2, KV_HEADS, PAGES, PAGE_SIZE, dim, generator=generator).to(torch.bfloat16)
    width = -(-context // PAGE_SIZE)
    order = torch.randperm(PAGES, generator=generator).tolist()
    tables = [order[chunk * width : (chunk + 1) * width] for chunk in range(count)]
    # q heads side by side with k and v heads, as the fused projection lays them out: a strided view
    qkv = torch.randn(count * length, HEADS + 2 * KV_HEADS, dim, generator=generator).to(torch.bfloat16)
    q = qkv[:, :HEADS]
    got = _attend(q, kv_cache, tables, length, context)
    for chunk, table in enumerate(tables):
        rows = slice(chunk * length, (chunk + 1) * length)
        keys = kv_cache[:, :, table].reshape(2, KV_HEADS, -1, dim)[:, :, :context]
        expected = causal_reference(q[rows].unsqueeze(0), keys[:1], keys[1:])[0]
        torch.testing.assert_close(got[rows].double(), expected, rtol=2e-2, atol=2e-2)
        alone = _attend(q[rows], kv_cache, [table], length, context)
        assert torch.equal(alone, got[rows]), "a chunk's rows do not depend on the chunks beside it"


def test_head_sizes_it_does_not_take_stay_with_sdpa() -> None:
    assert ops.native_prefill_attention(torch.bfloat16, "cpu", 128)
    for dim in (16, 80, 256):
        assert not ops.native_prefill_attention(torch.bfloat16, "cpu", dim)
    assert not ops.native_prefill_attention(torch.float32, "cpu", 64)
