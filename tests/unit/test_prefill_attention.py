"""The CPU prefill attention (query blocks, bmm and softmax) against SDPA in fp64, for chunks that
span several query blocks, sit at the tail of a longer context, or are a single token, alone or
several of one shape in a batch; the dispatch in front of it, which keeps SDPA for fp32; and
paged attention's groups of equal chunks, which give each chunk the bits it gets alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from replica.model.attention import (
    QUERY_BLOCK,
    AttentionBatch,
    PrefillGroup,
    blocked_causal_attention,
    paged_attention,
    prefill_attention,
)


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain SDPA in fp64 with the bottom-right causal mask written out; shapes as prefill_attention."""
    queries, keys = q.shape[1], k.shape[2]
    mask = torch.arange(keys).unsqueeze(0) <= torch.arange(queries).unsqueeze(1) + keys - queries
    out = F.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double(), v.double(), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    ("length", "keys"),
    [
        (1, 1),
        (QUERY_BLOCK, QUERY_BLOCK),
        (2 * QUERY_BLOCK + 45, 2 * QUERY_BLOCK + 45),  # whole blocks and a partial one
        (QUERY_BLOCK + 3, 5 * QUERY_BLOCK),  # a later chunk: the tail of a longer context
        (1, 700),  # one new token after a cached prefix
    ],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("attention", [blocked_causal_attention, prefill_attention])
def test_prefill_attention_matches_sdpa(
    attention: Callable[..., torch.Tensor],
    count: int,
    dtype: torch.dtype,
    tolerance: float,
    length: int,
    keys: int,
    heads: int,
    kv_heads: int,
) -> None:
    generator = torch.Generator().manual_seed(length * 1000 + keys)
    # qkv side by side as the decoder lays them out, so q is a strided view, not a fresh tensor
    qkv = torch.randn(count, length, heads + 2 * kv_heads, 32, generator=generator).to(dtype)
    q = qkv[:, :, :heads]
    k = torch.randn(count, kv_heads, keys, 32, generator=generator).to(dtype)
    v = torch.randn(count, kv_heads, keys, 32, generator=generator).to(dtype)
    got = attention(q, k, v)
    assert got.shape == (count, length, heads, 32) and got.dtype == dtype
    expected = causal_reference(q, k, v)
    assert torch.allclose(got.double(), expected, atol=tolerance, rtol=tolerance)


def test_each_query_sees_only_keys_up_to_its_own_position() -> None:
    """Changing a key after the chunk's first query changes nothing for that query's output."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, QUERY_BLOCK + 10, 4, 16, generator=generator)
    k = torch.randn(1, 2, 300, 16, generator=generator)
    v = torch.randn(1, 2, 300, 16, generator=generator)
    first_query_key = 300 - q.shape[1]
    before = blocked_causal_attention(q, k, v)
    k[:, :, first_query_key + 1 :] += 5.0
    v[:, :, first_query_key + 1 :] -= 5.0
    after = blocked_causal_attention(q, k, v)
    assert torch.equal(before[0, 0], after[0, 0])
    assert not torch.allclose(before[0, 1], after[0, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_into_the_rows_it_is_given(dtype: torch.dtype) -> None:
    """paged_attention hands each sequence its rows of one output tensor: the result lands there,
    equal to a fresh one, and the rows around it keep what they held."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(1, QUERY_BLOCK + 20, 6, 32, generator=generator).to(dtype)
    k = torch.randn(1, 2, 400, 32, generator=generator).to(dtype)
    v = torch.randn(1, 2, 400, 32, generator=generator).to(dtype)
    length = q.shape[1]
    step = torch.full((length + 7, 6, 32), 9.0, dtype=dtype)
    rows = step[5 : 5 + length].view(q.shape)
    returned = prefill_attention(q, k, v, rows)
    assert returned.data_ptr() == rows.data_ptr()
    assert torch.equal(rows, prefill_attention(q, k, v))
    assert (step[:5] == 9.0).all() and (step[5 + length :] == 9.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("earlier", [0, 40])  # fresh prompts; chunks after cached context
def test_chunks_of_one_shape_get_the_bits_they_get_alone(dtype: torch.dtype, earlier: int) -> None:
    """A step's chunks of equal shape run as one group (gathered, one batch, scattered back): each
    chunk's rows are bit for bit what it gets as a group of its own, and a chunk of another shape
    between them keeps its own."""
    page_size, kv_heads, heads, dim = 16, 2, 6, 32
    lengths = [QUERY_BLOCK + 5, 50, QUERY_BLOCK + 5, QUERY_BLOCK + 5]
    generator = torch.Generator().manual_seed(earlier + 1)
    width = -(-(earlier + max(lengths)) // page_size)
    tables = [torch.arange(i * width, (i + 1) * width) for i in range(len(lengths))]
    kv_cache = torch.randn(2, kv_heads, len(lengths) * width, page_size, dim, generator=generator).to(dtype)
    q = torch.randn(sum(lengths), heads, dim, generator=generator).to(dtype)
    new_kv = torch.randn(sum(lengths), 2, kv_heads, dim, generator=generator).to(dtype)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    slots = [(t.unsqueeze(1) * page_size + torch.arange(page_size)).flatten() for t in tables]
    slot_mapping = torch.cat([s[earlier : earlier + n] for s, n in zip(slots, lengths, strict=True)])

    def group(chunks: list[int]) -> PrefillGroup:
        length, context = lengths[chunks[0]], earlier + lengths[chunks[0]]
        rows = torch.cat([torch.arange(starts[i], starts[i] + length) for i in chunks])
        rows = rows if len(chunks) > 1 else None  # a lone chunk is sliced
        pages = torch.cat([tables[i][: -(-context // page_size)] for i in chunks]) if earlier else None
        return PrefillGroup([starts[i] for i in chunks], length, context, rows, pages)

    def attend(groups: list[PrefillGroup]) -> torch.Tensor:
        batch = AttentionBatch(slot_mapping, 0, None, None, groups)
        return paged_attention(q, new_kv, kv_cache.clone(), batch, layer=0)

    alone = attend([group([i]) for i in range(len(lengths))])
    grouped = attend([group([0, 2, 3]), group([1])])
    assert torch.equal(grouped, alone)
    assert not torch.equal(alone[: lengths[0]], alone[starts[2] : starts[2] + lengths[0]])
