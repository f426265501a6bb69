"""The decoder's elementwise steps (RMSNorm with the residual add before it, the gated activation,
rotary embedding) and decode attention over the paged pool.

On the CPU, in fp32 and bf16, each is one fused native kernel (``native.py``); elsewhere, or
without the kernels, the eager ops below (and ``attention.py``'s batched matmuls), which follow
transformers' implementation op for op. Both round alike (each product and sum to the model's
dtype, RMSNorm in fp32 inside), which tests check kernel against eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from replica.model.native import SUFFIXES, kernels


def _kernel(name: str, *tensors: torch.Tensor) -> Callable[..., None] | None:
    """The kernel ``name`` for these tensors' dtype where it applies to them (CPU, fp32 or bf16,
    one dtype, contiguous), else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in SUFFIXES:
        return None
    library = kernels()
    if library is None or not all(t.is_contiguous() and t.dtype == first.dtype for t in tensors):
        return None
    return getattr(library, f"{name}_{SUFFIXES[first.dtype]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as transformers computes it."""
    kernel = _kernel("rms_norm", x, weight)
    if kernel is None:
        return eager_rms_norm(x, weight, eps)
    return _normed(kernel, x, weight, eps)


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += delta`` (in place), then RMSNorm of the new residual: one pass instead of two."""
    kernel = _kernel("add_rms_norm", residual, delta, weight)
    if kernel is None:
        return eager_rms_norm(residual.add_(delta), weight, eps)
    return _normed(kernel, residual, weight, eps, delta)


def _normed(
    kernel: Callable[..., None], x: torch.Tensor, weight: torch.Tensor, eps: float, *delta: torch.Tensor
) -> torch.Tensor:
    """Runs a norm kernel over x's rows (``delta`` added first where given) into a new tensor."""
    out = torch.empty_like(x)
    width = x.shape[-1]
    pointers = [x.data_ptr(), *(d.data_ptr() for d in delta), weight.data_ptr(), out.data_ptr()]
    kernel(*pointers, x.numel() // width, width, eps, torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` for gate_up [rows, 2 * width], gate first."""
    kernel = _kernel("silu_and_mul", gate_up)
    if kernel is None:
        return eager_silu_and_mul(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
    return out


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotates x [tokens, heads, head_dim] in place: ``x * cos + rotate_half(x) * sin``, where
    cos and signed_sin are [tokens, 1, head_dim] and signed_sin's first half is negated (see
    ``RotaryEmbedding``). x may be a slice of wider rows (q and k heads of a fused projection)."""
    kernel = _kernel("rotary", cos, signed_sin)
    tokens, heads, dim = x.shape
    if kernel is None or x.dtype != cos.dtype or x.stride(2) != 1 or x.stride(1) != dim:
        eager_rotate_(x, cos, signed_sin)
        return
    threads = torch.get_num_threads()
    kernel(x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), tokens, heads, dim, x.stride(0), threads)


def native_decode_attention(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :func:`decode_attention` runs for this dtype and device (else the batched matmuls
    over a gathered context in ``attention.py``)."""
    return torch.device(device).type == "cpu" and dtype in SUFFIXES and kernels() is not None


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One query token per sequence against its context read from the pool's pages, into ``out``.

    q [decodes, heads, dim] (rows may be strided: q heads of the fused projection); kv_cache the
    pool's layer [2, kv_heads, pages, page_size, dim]; page_table [decodes, width] and lengths
    [decodes], int64. Only where :func:`native_decode_attention` holds."""
    kernel = _kernel("decode_attention", kv_cache, out)
    assert kernel is not None
    _paged(kernel, q, kv_cache, page_table, lengths, out)


def native_prefill_attention(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """Whether :func:`extend_attention` runs here: bf16 on a CPU with AMX tiles or AVX512-BF16,
    the kernels built for it, a head size they take."""
    library = kernels() if torch.device(device).type == "cpu" and dtype == torch.bfloat16 else None
    return library is not None and bool(library.extend_attention_supported(head_dim))


def extend_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    starts: torch.Tensor,
    length: int,
    context: int,
    out: torch.Tensor,
) -> None:
    """Causal attention of ``len(starts)`` chunks of ``length`` queries (chunk c's are q's rows
    starts[c] ..), each the tail of a ``context``-key context read from the pool's pages
    page_table[c] (its own K/V already written there), into the same rows of ``out``.

    Shapes as :func:`decode_attention`'s, ``starts`` [chunks] where it has ``lengths``, all bf16.
    Only where :func:`native_prefill_attention` holds."""
    library = kernels()
    assert library is not None and q.dtype == torch.bfloat16
    ran = _paged(library.extend_attention_bf16, q, kv_cache, page_table, starts, out, length, context)
    assert ran, "extend_attention called where native_prefill_attention does not hold"


def _paged(
    kernel: Callable[..., int | None],
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    per_sequence: torch.Tensor,
    out: torch.Tensor,
    *extra: int,
) -> int | None:
    """Calls an attention kernel over the paged pool with the arguments they share: q [tokens,
    heads, dim] (rows may be strided), the pool's layer, page tables [sequences, width], one int64
    per sequence, out [tokens, heads, dim] contiguous; then ``extra``."""
    assert q.dtype == out.dtype == kv_cache.dtype and q.stride(2) == 1 and q.stride(1) == q.shape[2]
    assert out.is_contiguous() and kv_cache.is_contiguous() and page_table.is_contiguous()
    assert per_sequence.is_contiguous() and page_table.shape[0] == per_sequence.shape[0]
    _, heads, dim = q.shape
    _, kv_heads, pages, page_size, _ = kv_cache.shape
    return kernel(
        q.data_ptr(),
        kv_cache.data_ptr(),
        page_table.data_ptr(),
        per_sequence.data_ptr(),
        out.data_ptr(),
        per_sequence.shape[0],
        heads,
        kv_heads,
        dim,
        pages,
        page_size,
        page_table.shape[1],
        q.stride(0),
        dim**-0.5,
        torch.get_num_threads(),
        *extra,
    )


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, round to the model dtype, then scale.

    fp32 takes one fused op (bit-identical); bf16/fp16 must not normalise in low precision, which
    drifts visibly over 30 layers.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def eager_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True) * up


def eager_rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    x.mul_(cos).add_(rotated)
