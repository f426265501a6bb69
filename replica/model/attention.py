"""Attention over the paged KV pool for a step that mixes decodes and (chunked) prefills.

Tokens of one step are laid out flat: first one token per decoding sequence, then each prefill
chunk. New K/V are written into their pool slots first; attention then reads every sequence's
whole context back from the pool, whole pages at a time, so cached prefixes, earlier chunks and
this step's tokens are all one thing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replica.model.decode_context import DecodeContext
from replica.model.ops import decode_attention, extend_attention


@dataclass
class PrefillGroup:
    """Prefill chunks of one shape: ``count`` sequences' ``length`` new tokens each, attending to
    ``context`` keys. Run as one batch of matrix products: a wave of equal-length prompts costs
    one set of attention calls a layer, not one per prompt."""

    starts: list[int]  # each chunk's flat offset in the step
    length: int
    context: int  # keys each chunk attends to: its earlier context and the chunk itself
    rows: torch.Tensor | None  # the chunks' flat rows, in order; None for one chunk (a slice)
    context_pages: torch.Tensor | None  # the chunks' context pages, one after the other; None: none earlier
    offsets: torch.Tensor | None = None  # starts as a tensor: set where ops.extend_attention runs (pages too)

    @property
    def count(self) -> int:
        return len(self.starts)


@dataclass
class AttentionBatch:
    """Per-step metadata, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [tokens]: where each new token's K/V goes
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    decode_pages: torch.Tensor | None  # [decodes, pages of the longest context] (padded)
    decode_bias: torch.Tensor | None  # [kv_heads * decodes, group, keys]: see decode_bias()
    prefills: list[PrefillGroup]
    decode_context: DecodeContext | None = None  # the last step's gathered decode K/V
    decode_positions: torch.Tensor | None = None  # [decodes]: each new token's index in that context
    decode_lengths: torch.Tensor | None = None  # [decodes]: set where ops.decode_attention reads the pool


@functools.lru_cache(maxsize=16)
def bottom_right_causal_bias(
    num_queries: int, num_keys: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """SDPA's additive mask: query i sits at key position ``num_keys - num_queries + i`` and sees
    keys up to there (0), not after (-inf).

    SDPA's ``is_causal`` aligns the triangle top-left, which is wrong when the queries are the tail
    of a longer context (chunked prefill, prefix-cache hits). Additive in the queries' dtype: SDPA
    turns a boolean mask into this on every call (the same bits; a 512-query chunk over 1,024
    keys 14 % faster in bf16). Cached: every layer of a step asks for the same one (read-only).
    """
    offset = num_keys - num_queries
    rows = torch.arange(num_queries, device=device).unsqueeze(1)
    cols = torch.arange(num_keys, device=device).unsqueeze(0)
    bias = torch.zeros(num_queries, num_keys, dtype=dtype, device=device)
    return bias.masked_fill_(cols > rows + offset, float("-inf"))


def decode_bias(
    lengths: torch.Tensor, keys: int, kv_heads: int, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """The decode scores' additive mask, built once a step: 0 over each sequence's ``length`` real
    keys, -inf over the padding up to ``keys``; one row per query head, in the decode's
    [kv_heads * decodes, group, keys] order."""
    valid = torch.arange(keys, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    bias = torch.zeros(valid.shape, dtype=dtype, device=lengths.device).masked_fill_(~valid, float("-inf"))
    return bias.unsqueeze(1).repeat(kv_heads, group, 1)


def paged_attention(
    q: torch.Tensor,
    new_kv: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: AttentionBatch,
    layer: int,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; new_kv: [tokens, 2, kv_heads, dim];
    kv_cache: [2, kv_heads, pages, page_size, dim] (the pool's layer ``layer``).

    Returns [tokens, heads, dim], contiguous: each sequence's attention writes its rows of one
    output tensor (no concatenation of per-sequence results)."""
    two, kv_heads, pages, page_size, dim = kv_cache.shape
    slots = kv_cache.view(two, kv_heads, pages * page_size, dim)
    slots.index_copy_(2, batch.slot_mapping, new_kv.permute(1, 2, 0, 3))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    decodes = batch.num_decodes
    if decodes and batch.decode_lengths is not None:
        assert batch.decode_pages is not None
        decode_attention(q[:decodes], kv_cache, batch.decode_pages, batch.decode_lengths, out[:decodes])
    elif decodes:
        context = _decode_context(new_kv[:decodes], kv_cache, batch, layer)
        _decode_attention(q[:decodes], context, batch, out[:decodes])
    for group in batch.prefills:
        _prefill_group(q, new_kv, kv_cache, group, out)
    return out


def _prefill_group(
    q: torch.Tensor, new_kv: torch.Tensor, kv_cache: torch.Tensor, group: PrefillGroup, out: torch.Tensor
) -> None:
    """One group's attention, written into its rows of ``out``: the native kernel where the
    runner set ``offsets`` (it reads the pages itself); else a lone chunk is sliced, several are
    gathered into one batch and their rows scattered back."""
    count, length = group.count, group.length
    if group.offsets is not None:
        assert group.context_pages is not None
        table = group.context_pages.view(count, -1)
        extend_attention(q, kv_cache, table, group.offsets, length, group.context, out)
        return
    kv_heads, dim = kv_cache.shape[1], kv_cache.shape[-1]
    if group.rows is None:
        rows = slice(group.starts[0], group.starts[0] + length)
        queries, new = q[rows], new_kv[rows]
    else:
        queries, new = q.index_select(0, group.rows), new_kv.index_select(0, group.rows)
    if group.context_pages is None:
        context = new.view(count, length, 2, kv_heads, dim).permute(2, 0, 3, 1, 4)
    else:
        gathered = _gather_pages(kv_cache, group.context_pages)
        context = gathered.view(2, kv_heads, count, -1, dim)[:, :, :, : group.context].transpose(1, 2)
    queries = queries.view(count, length, *q.shape[1:])
    if group.rows is None:
        prefill_attention(queries, context[0], context[1], out[rows].view(queries.shape))
    else:
        result = prefill_attention(queries, context[0], context[1])
        out.index_copy_(0, group.rows, result.view(count * length, *q.shape[1:]))


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of chunks' queries q [count, length, heads, dim], the tails of their
    contexts k, v [count, kv_heads, keys, dim]; returns [count, length, heads, dim], written into
    ``out`` when given. SDPA on CUDA, in fp32 and on CPUs with AMX (where the native kernel,
    ``ops.extend_attention``, does not run); the blocked form elsewhere."""
    if q.device.type == "cpu" and q.dtype != torch.float32 and not _cpu_has_amx():
        return blocked_causal_attention(q, k, v, out)
    length, keys = q.shape[1], k.shape[2]
    mask = None if length == keys else bottom_right_causal_bias(length, keys, q.dtype, q.device)
    result = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    ).transpose(1, 2)
    return result if out is None else out.copy_(result)


@functools.cache
def _cpu_has_amx() -> bool:
    """Whether SDPA's CPU flash kernel runs its bf16/fp16 matmuls on AMX tiles. There it beats the
    blocked form 1.7-3.3x (2-core Xeon with AMX, SmolLM2's heads, alternated: a 512-token chunk
    over 1,024 keys 4.5 against 11.5 ms, a cache hit's 32 tokens over 1,568 keys 0.67 against
    1.21 ms); without AMX it is the slower one."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


QUERY_BLOCK = 128


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The CPU path in bf16/fp16 without AMX: per block of ``QUERY_BLOCK`` query rows, two batched
    matmuls and a softmax over only the keys the block can see, as transformers' eager attention
    computes it (scores in the model's dtype, softmax accumulated in fp32). Shapes as
    :func:`prefill_attention`.

    SDPA's CPU flash kernel made whole bf16 prefills 16-27 % slower on a 2-core AVX512-BF16
    host without AMX (SmolLM2-135M, 512-token chunks: a cold 1,024-token prompt 1.18 s against 0.96 s, 1,568
    tokens 2.16 s against 1.70 s, 32 tokens after a 1,536-token cached prefix 73 against 63 ms).
    The query heads sharing a KV head are stacked as that head's query rows, so a block is one
    matmul per KV head and chunk; only the block's last ``rows`` keys need the triangle. Blocks
    of 64 and 256 rows were slower than 128. The scale goes on the queries as they are stacked
    (the copy is needed anyway), not on the many more scores: with a power-of-two scale (head_dim
    64, 256) the bits are the same. A chunk's bits do not depend on how many share its batch.
    """
    count, length, heads, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    batch = count * kv_heads
    earlier = keys - length
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    for first in range(0, length, QUERY_BLOCK):
        rows = min(QUERY_BLOCK, length - first)
        visible = earlier + first + rows
        query = q.new_empty(count, kv_heads, group, rows, dim)
        block = q[:, first : first + rows].view(count, rows, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        torch.mul(block, dim**-0.5, out=query)
        seen = k[:, :, :visible].reshape(batch, visible, dim)
        scores = torch.bmm(query.view(batch, group * rows, dim), seen.transpose(1, 2))
        scores[:, :, visible - rows :].add_(_causal_bias(rows, group, q.dtype, q.device))
        weights = torch.softmax(scores, dim=-1)  # accumulates in fp32: same bits as eager's cast
        result = torch.bmm(weights, v[:, :, :visible].reshape(batch, visible, dim))
        written = out[:, first : first + rows].view(count, rows, kv_heads, group, dim)
        written.copy_(result.view(count, kv_heads, group, rows, dim).permute(0, 3, 1, 2, 4))
    return out


@functools.lru_cache(maxsize=16)
def _causal_bias(rows: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a block's ``rows`` queries add to their scores over the block's last ``rows`` keys:
    -inf where a key lies after the query, 0 elsewhere; repeated for the ``group`` query heads
    stacked per KV head: [group * rows, rows]. Adding it gives the bits ``masked_fill_`` gives,
    4x faster at 128 rows. Cached: every layer's blocks ask for the same few (read-only)."""
    return bottom_right_causal_bias(rows, rows, dtype, device).repeat(group, 1)


def _decode_context(
    new_kv: torch.Tensor, kv_cache: torch.Tensor, batch: AttentionBatch, layer: int
) -> torch.Tensor:
    """The decodes' contexts, one padded row each: [2, kv_heads, decodes * keys, dim]. Gathered
    from the pool (after this step's tokens went in), or the last step's with those appended."""
    carried = batch.decode_context
    if carried is not None and carried.carry:
        context = carried.layers[layer]
        assert context is not None and batch.decode_positions is not None
        return context.index_copy_(2, batch.decode_positions, new_kv.permute(1, 2, 0, 3))
    assert batch.decode_pages is not None
    context = _gather_pages(kv_cache, batch.decode_pages.reshape(-1))
    if carried is not None and carried.keep:
        carried.layers[layer] = context
    return context


def _decode_attention(
    q: torch.Tensor, context: torch.Tensor, batch: AttentionBatch, out: torch.Tensor
) -> None:
    """One new query per sequence against its whole context: q [decodes, heads, dim], written
    into ``out`` of the same shape.

    Written as two batched matmuls and a softmax, as transformers' eager attention computes it
    (scores in the model's dtype, softmax in fp32). SDPA's CPU flash kernel spends most of a
    decode step's attention on its blocking for a handful of queries: the matmuls are 1.5-4x
    faster at 160-1,200 tokens of context. The query heads that share a KV head are that head's
    query rows, so each (KV head, sequence) is one small matrix product.
    """
    assert batch.decode_bias is not None
    decodes, heads, dim = q.shape
    kv_heads = context.shape[1]
    group = heads // kv_heads
    keys = context.shape[2] // decodes
    k = context[0].view(kv_heads * decodes, keys, dim)
    v = context[1].view(kv_heads * decodes, keys, dim)
    query = q.view(decodes, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * decodes, group, dim)
    scores = torch.baddbmm(batch.decode_bias, query, k.transpose(1, 2), alpha=dim**-0.5)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    result = torch.bmm(weights, v).view(kv_heads, decodes, group, dim)
    out.view(decodes, kv_heads, group, dim).copy_(result.transpose(0, 1))


def _gather_pages(kv_cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """These pages of one layer, in order: [2, kv_heads, len(pages) * page_size, dim]."""
    two, kv_heads, _, page_size, dim = kv_cache.shape
    return kv_cache.index_select(2, pages).view(two, kv_heads, pages.numel() * page_size, dim)
