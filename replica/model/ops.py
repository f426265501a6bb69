"""The decoder's elementwise steps: RMSNorm (with the residual add before it), the gated
activation and rotary embedding.

On the CPU, in fp32 and bf16, each is one fused native kernel (``native.py``); elsewhere, or
without the kernels, the eager ops below, which follow transformers' implementation op for op.
Both round alike (each product and sum to the model's dtype, RMSNorm in fp32 inside), which tests
check kernel against eager.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from replica.model.native import SUFFIXES, kernels


def _native(*tensors: torch.Tensor) -> tuple[ctypes.CDLL, str] | None:
    """The kernels and the dtype's suffix where they apply to these tensors, else None."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in SUFFIXES:
        return None
    library = kernels()
    if library is None or not all(t.is_contiguous() and t.dtype == first.dtype for t in tensors):
        return None
    return library, SUFFIXES[first.dtype]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as transformers computes it."""
    native = _native(x, weight)
    if native is None:
        return eager_rms_norm(x, weight, eps)
    library, suffix = native
    out = torch.empty_like(x)
    width = x.shape[-1]
    getattr(library, f"rms_norm_{suffix}")(
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // width,
        width,
        eps,
        torch.get_num_threads(),
    )
    return out


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += delta`` (in place), then RMSNorm of the new residual: one pass instead of two."""
    native = _native(residual, delta, weight)
    if native is None:
        return eager_rms_norm(residual.add_(delta), weight, eps)
    library, suffix = native
    out = torch.empty_like(residual)
    width = residual.shape[-1]
    getattr(library, f"add_rms_norm_{suffix}")(
        residual.data_ptr(),
        delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        residual.numel() // width,
        width,
        eps,
        torch.get_num_threads(),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` for gate_up [rows, 2 * width], gate first."""
    native = _native(gate_up)
    if native is None:
        return eager_silu_and_mul(gate_up)
    library, suffix = native
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    getattr(library, f"silu_and_mul_{suffix}")(
        gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads()
    )
    return out


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotates x [tokens, heads, head_dim] in place: ``x * cos + rotate_half(x) * sin``, where
    cos and signed_sin are [tokens, 1, head_dim] and signed_sin's first half is negated (see
    ``RotaryEmbedding``). x may be a slice of wider rows (q and k heads of a fused projection)."""
    native = _native(cos, signed_sin)
    tokens, heads, dim = x.shape
    if native is None or x.dtype != cos.dtype or x.stride(2) != 1 or x.stride(1) != dim:
        eager_rotate_(x, cos, signed_sin)
        return
    library, suffix = native
    getattr(library, f"rotary_{suffix}")(
        x.data_ptr(),
        cos.data_ptr(),
        signed_sin.data_ptr(),
        tokens,
        heads,
        dim,
        x.stride(0),
        torch.get_num_threads(),
    )


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
    library, suffix = kernels(), SUFFIXES[q.dtype]
    assert library is not None and q.stride(2) == 1 and q.stride(1) == q.shape[2]
    assert kv_cache.is_contiguous() and out.is_contiguous() and page_table.is_contiguous()
    decodes, heads, dim = q.shape
    _, kv_heads, pages, page_size, _ = kv_cache.shape
    getattr(library, f"decode_attention_{suffix}")(
        q.data_ptr(),
        kv_cache.data_ptr(),
        page_table.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        decodes,
        heads,
        kv_heads,
        dim,
        pages,
        page_size,
        page_table.shape[1],
        q.stride(0),
        dim**-0.5,
        torch.get_num_threads(),
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
