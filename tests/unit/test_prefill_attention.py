"""The CPU prefill attention (query blocks, bmm and softmax) against SDPA in fp64, for chunks that
span several query blocks, sit at the tail of a longer context, or are a single token; and the
dispatch in front of it, which keeps SDPA for fp32."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from replica.model.attention import (
    QUERY_BLOCK,
    blocked_causal_attention,
    bottom_right_causal_mask,
    prefill_attention,
)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain SDPA in fp64 with the bottom-right causal mask written out."""
    mask = bottom_right_causal_mask(q.shape[0], k.shape[1], "cpu")
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1).unsqueeze(0),
        k.double().unsqueeze(0),
        v.double().unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


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
@pytest.mark.parametrize("attention", [blocked_causal_attention, prefill_attention])
def test_prefill_attention_matches_sdpa(
    attention: Callable[..., torch.Tensor],
    dtype: torch.dtype,
    tolerance: float,
    length: int,
    keys: int,
    heads: int,
    kv_heads: int,
) -> None:
    generator = torch.Generator().manual_seed(length * 1000 + keys)
    # qkv side by side as the decoder lays them out, so q is a strided view, not a fresh tensor
    qkv = torch.randn(length, heads + 2 * kv_heads, 32, generator=generator).to(dtype)
    q = qkv[:, :heads]
    k = torch.randn(kv_heads, keys, 32, generator=generator).to(dtype)
    v = torch.randn(kv_heads, keys, 32, generator=generator).to(dtype)
    got = attention(q, k, v)
    assert got.shape == (length, heads, 32) and got.dtype == dtype
    expected = _reference(q, k, v)
    assert torch.allclose(got.double(), expected, atol=tolerance, rtol=tolerance)


def test_each_query_sees_only_keys_up_to_its_own_position() -> None:
    """Changing a key after the chunk's first query changes nothing for that query's output."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(QUERY_BLOCK + 10, 4, 16, generator=generator)
    k = torch.randn(2, 300, 16, generator=generator)
    v = torch.randn(2, 300, 16, generator=generator)
    first_query_key = 300 - q.shape[0]
    before = blocked_causal_attention(q, k, v)
    k[:, first_query_key + 1 :] += 5.0
    v[:, first_query_key + 1 :] -= 5.0
    after = blocked_causal_attention(q, k, v)
    assert torch.equal(before[0], after[0])
    assert not torch.allclose(before[1], after[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_into_the_rows_it_is_given(dtype: torch.dtype) -> None:
    """paged_attention hands each sequence its rows of one output tensor: the result lands there,
    equal to a fresh one, and the rows around it keep what they held."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(QUERY_BLOCK + 20, 6, 32, generator=generator).to(dtype)
    k = torch.randn(2, 400, 32, generator=generator).to(dtype)
    v = torch.randn(2, 400, 32, generator=generator).to(dtype)
    step = torch.full((q.shape[0] + 7, 6, 32), 9.0, dtype=dtype)
    rows = step[5 : 5 + q.shape[0]]
    returned = prefill_attention(q, k, v, rows)
    assert returned.data_ptr() == rows.data_ptr()
    assert torch.equal(rows, prefill_attention(q, k, v))
    assert (step[:5] == 9.0).all() and (step[5 + q.shape[0] :] == 9.0).all()
