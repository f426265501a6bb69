"""The packed-weight matmul: same numbers as ``F.linear``, for every row count the engine uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replica.model.linear import Linear


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_linear_matches_plain_matmul(dtype: torch.dtype, tolerance: float, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    linear = Linear(weight, bias)
    native = dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if torch.backends.mkldnn.is_available() and native:
        assert linear.packed is not None, "CPU weights should be packed for oneDNN where it is present"
    elif dtype == torch.bfloat16:  # no AVX512-BF16/AMX: oneDNN would emulate it; the plain path runs
        assert linear.packed is None
    expected = F.linear(x.float(), weight.float(), bias.float())
    got = linear(x).float()
    assert torch.allclose(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    assert linear.nbytes == 96 * 64 * weight.element_size() + 96 * bias.element_size()
