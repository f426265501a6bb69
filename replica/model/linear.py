"""Matrix multiplies with weights pre-packed at load: the native fp32 kernel's panels, else oneDNN.

On CPU, plain ``F.linear`` goes through a slow path for every dtype. Measured on this
project's 2-core AMD EPYC with SmolLM2's shapes, against oneDNN with weights packed once at
load: bf16 1.2-2x slower (one row and sixteen); fp32, where it is MKL's gemm, 3x slower for one
row, 3.5x for sixteen and 2.5x for a 512-row prefill chunk. In fp32 on CPUs with AVX2 and FMA,
``gemm.cpp``'s panels are faster still than oneDNN's packed weights (all thirty layers of
SmolLM2: 0.78x the time for one row and for sixteen, 0.90x for 1,024) and keep every row's
result independent of the rows beside it. CUDA, and builds without oneDNN, use the plain weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from replica.model.native import kernels

_BATCH_HINT = 16  # rows oneDNN tunes its packed layout for; any row count works
_PANEL = 16  # output columns per panel of gemm.cpp


class Linear:
    """``y = x @ weight.T + bias`` with the fastest layout this device offers."""

    __slots__ = ("bias", "packed", "panels", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.panels = _panels(weight)
        self.packed = _pack(weight) if self.panels is None else None
        self.weight = weight if self.panels is None and self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return _panel_matmul(x, self.panels, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        matrix = next(m for m in (self.panels, self.packed, self.weight) if m is not None)
        extra = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return math.prod(matrix.shape) * matrix.dtype.itemsize + extra


def _panels(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [N, K] as gemm.cpp's panels [N / 16, K, 16], or None where that kernel does not
    run: not fp32 on the CPU, no native kernels, no AVX2 + FMA, or N not a multiple of 16."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[0] % _PANEL:
        return None
    library = kernels()
    if library is None or not library.gemm_f32_supported():
        return None
    rows, width = weight.shape
    return weight.view(rows // _PANEL, _PANEL, width).transpose(1, 2).contiguous()


def _panel_matmul(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ the panels' weight.T (+ bias), through gemm.cpp."""
    library = kernels()
    assert library is not None  # panels exist only where the library does
    width = panels.shape[1]
    rows = x.reshape(-1, width)
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.to(torch.float32).contiguous()
    columns = panels.shape[0] * _PANEL
    out = rows.new_empty(rows.shape[0], columns)
    ran = library.gemm_f32(
        rows.data_ptr(),
        rows.stride(0),
        panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        columns,
        width,
        torch.get_num_threads(),
    )
    assert ran, "gemm.cpp left the panels' product undone"  # it runs wherever it packed them
    return out.view(*x.shape[:-1], columns)


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
