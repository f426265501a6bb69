"""Matrix multiplies with weights pre-packed for oneDNN on CPU.

On CPU, plain ``F.linear`` goes through a slow path for every dtype. Measured on this
project's 2-core AMD EPYC with SmolLM2's shapes, against oneDNN with weights packed once at
load: bf16 1.2-2x slower (one row and sixteen); fp32, where it is MKL's gemm, 3x slower for one
row, 3.5x for sixteen and 2.5x for a 512-row prefill chunk. CUDA, and builds without oneDNN, use
the plain weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BATCH_HINT = 16  # rows oneDNN tunes its packed layout for; any row count works


class Linear:
    """``y = x @ weight.T + bias`` with the fastest layout this device offers."""

    __slots__ = ("bias", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed = _pack(weight)
        self.weight = None if self.packed is not None else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        matrix = self.packed if self.packed is not None else self.weight
        extra = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return matrix.shape[0] * matrix.shape[1] * matrix.dtype.itemsize + extra


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed weight, or None where packing is unavailable or would not be exact."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except RuntimeError:
        return None
    expected = F.linear(probe.float(), weight.float())
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    if not torch.allclose(
        got.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
    ):
        return None
    return packed
