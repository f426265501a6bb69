"""The packed-weight matmuls (gemm.cpp's panels in fp32, oneDNN's packing otherwise): same numbers
as ``F.linear`` for every row count the engine uses, and each row independent of the others."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replica.model import native
from replica.model.linear import Linear


def panels_run_here() -> bool:
    library = native.kernels()
    return library is not None and bool(library.gemm_f32_supported())


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_linear_matches_plain_matmul(dtype: torch.dtype, tolerance: float, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    linear = Linear(weight, bias)
    onednn_native = dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float32 and panels_run_here():
        assert linear.panels is not None and linear.packed is None, "fp32 should run gemm.cpp's panels"
    elif torch.backends.mkldnn.is_available() and onednn_native:
        assert linear.packed is not None, "CPU weights should be packed for oneDNN where it is present"
    elif dtype == torch.bfloat16:  # no AVX512-BF16/AMX: oneDNN would emulate it; the plain path runs
        assert linear.packed is None
    expected = F.linear(x.float(), weight.float(), bias.float())
    got = linear(x).float()
    assert torch.allclose(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    assert linear.nbytes == 96 * 64 * weight.element_size() + 96 * bias.element_size()


@pytest.mark.parametrize(("columns", "width"), [(96, 64), (32, 7), (48, 1536)])
def test_panels_match_plain_matmul_and_keep_rows_apart(columns: int, width: int) -> None:
    """Every tile shape of gemm.cpp (6-row tiles, 1-5 row tails, one or two panels, odd widths);
    a row gives the same bits alone as in any batch, with one thread or two."""
    if not panels_run_here():
        pytest.skip("gemm.cpp's panels need the native kernels on a CPU with AVX2 and FMA")
    generator = torch.Generator().manual_seed(columns + width)
    weight = torch.randn(columns, width, generator=generator)
    bias = torch.randn(columns, generator=generator)
    x = torch.randn(70, width, generator=generator)
    for with_bias in (None, bias):
        linear = Linear(weight, with_bias)
        assert linear.panels is not None
        together = linear(x)
        expected = F.linear(x.double(), weight.double(), None if with_bias is None else bias.double())
        assert torch.allclose(together.double(), expected, rtol=1e-4, atol=1e-4 * width**0.5)
        batches = (slice(0, 1), slice(5, 7), slice(8, 11), slice(13, 17), slice(20, 25), slice(30, 70))
        threads = torch.get_num_threads()
        try:
            for count in (1, 2):
                torch.set_num_threads(count)
                for rows in batches:
                    assert torch.equal(linear(x[rows]), together[rows]), (count, rows)
        finally:
            torch.set_num_threads(threads)


def test_panels_take_strided_rows_and_leave_odd_columns_to_onednn() -> None:
    if not panels_run_here():
        pytest.skip("gemm.cpp's panels need the native kernels on a CPU with AVX2 and FMA")
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 40, generator=generator)
    wide = torch.randn(9, 100, generator=generator)
    linear = Linear(weight)
    assert torch.equal(linear(wide[:, 10:50]), linear(wide[:, 10:50].contiguous()))
    odd = Linear(torch.randn(30, 40, generator=generator))
    assert odd.panels is None, "30 columns are not whole panels: oneDNN's packing runs"
    assert odd(wide[:, :40]).shape == (9, 30)
