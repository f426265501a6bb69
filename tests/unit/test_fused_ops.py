"""The fused CPU kernels against the eager ops they replace: they round at the same points, so
RMSNorm (its sum of squares taken in torch's own order) is eager's to the bit, and the rest agree
to an ulp of fp32 (the exp inside SiLU is computed another way), which in bf16 leaves almost every
value equal and the rest one bf16 ulp apart; rows independent of the rows beside them; and the
eager ops taking over where the kernels cannot be built."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replica.model import native, ops
from replica.model.attention import AttentionBatch, decode_bias, paged_attention
from replica.model.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, 300]  # 300 x 576 is past the size where the kernels split rows between threads
HIDDEN, INTERMEDIATE, HEAD_DIM = 576, 1536, 64


@pytest.fixture(autouse=True)
def fresh_library() -> Iterator[None]:
    """Each test finds (or builds) the library anew, and leaves none cached from its settings."""
    native.kernels.cache_clear()
    yield
    native.kernels.cache_clear()


def needs_kernels() -> None:
    if native.kernels() is None:
        pytest.fail("the fused kernels did not build here: a C++ compiler is part of the set-up")


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-30)  # one bf16 ulp at most
        assert (got == expected).float().mean() > 0.99, "an fp32 ulp seldom moves a bf16 rounding"
    else:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_matches_eager(dtype: torch.dtype, rows: int) -> None:
    needs_kernels()
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, HIDDEN, generator=generator) * 3).to(dtype)
    weight = (torch.rand(HIDDEN, generator=generator) + 0.5).to(dtype)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), ops.eager_rms_norm(x, weight, 1e-5))


# Widths through every branch of torch's summation order: under one 8-float vector, leftover
# vectors and tail elements, one cascade flush (576: SmolLM2), several, and a deep one.
@pytest.mark.parametrize("width", [5, 17, 100, 576, 960, 2048, 5000, 16384])
def test_rms_norm_sums_in_torchs_order(width: int) -> None:
    """An fp32 ulp off the mean now and then flips a bf16 rounding, and 30 layers of that turn
    SmolLM2's greedy answer to "What is the capital of France?" from "The ..." to "L'Étoile"."""
    needs_kernels()
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(64, width, generator=generator) * 3).to(torch.bfloat16)
    weight = torch.ones(width, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), ops.eager_rms_norm(x, weight, 1e-6))
    as_fp32 = x.float() * 7.3
    assert torch.equal(
        ops.rms_norm(as_fp32, weight.float(), 1e-6), ops.eager_rms_norm(as_fp32, weight.float(), 1e-6)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_the_residual_and_matches_eager(dtype: torch.dtype, rows: int) -> None:
    needs_kernels()
    generator = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    delta = torch.randn(rows, HIDDEN, generator=generator).to(dtype)
    weight = (torch.rand(HIDDEN, generator=generator) + 0.5).to(dtype)
    fused_residual, eager_residual = residual.clone(), residual.clone()
    normed = ops.add_rms_norm_(fused_residual, delta, weight, 1e-6)
    expected = ops.eager_rms_norm(eager_residual.add_(delta), weight, 1e-6)
    assert torch.equal(fused_residual, eager_residual)  # one rounded add either way
    assert torch.equal(normed, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_eager(dtype: torch.dtype, rows: int) -> None:
    needs_kernels()
    generator = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * INTERMEDIATE, generator=generator) * 4).to(dtype)
    assert_same(ops.silu_and_mul(gate_up), ops.eager_silu_and_mul(gate_up.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_at_the_ends_of_exp(dtype: torch.dtype) -> None:
    """Where exp overflows or underflows SiLU is -0 or x itself, as eager computes it; NaN stays NaN."""
    needs_kernels()
    edges = torch.tensor([-200.0, -100.0, -89.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 89.0, 100.0])
    gate_up = torch.cat([edges, torch.full_like(edges, 1.5)]).unsqueeze(0).to(dtype)
    assert_same(ops.silu_and_mul(gate_up), ops.eager_silu_and_mul(gate_up.clone()))
    nan = torch.tensor([[float("nan"), 1.0]], dtype=dtype)
    assert ops.silu_and_mul(nan).isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_on_a_slice_of_fused_heads_matches_eager(dtype: torch.dtype, rows: int) -> None:
    """q and k heads rotate in place inside the fused qkv rows; the v heads are left alone."""
    needs_kernels()
    heads, kv_heads = 9, 3
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 100000.0, None, dtype, "cpu")
    generator = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, heads + 2 * kv_heads, HEAD_DIM, generator=generator).to(dtype)
    cos, sin = rotary.tables(torch.randint(0, 8192, (rows,), generator=generator))
    fused, eager = qkv.clone(), qkv.clone()
    ops.rotate_(fused[:, : heads + kv_heads], cos, sin)
    ops.eager_rotate_(eager[:, : heads + kv_heads], cos, sin)
    assert_same(fused, eager)
    assert torch.equal(fused[:, heads + kv_heads :], qkv[:, heads + kv_heads :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """Per-row arithmetic whatever the batch or the threads: a seeded request stays reproducible."""
    needs_kernels()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, HIDDEN, generator=generator).to(dtype)
    weight = torch.rand(HIDDEN, generator=generator).to(dtype)
    gate_up = torch.randn(300, 2 * INTERMEDIATE, generator=generator).to(dtype)
    together_norm, together_act = ops.rms_norm(x, weight, 1e-5), ops.silu_and_mul(gate_up)
    for row in (0, 151, 299):
        assert torch.equal(ops.rms_norm(x[row : row + 1], weight, 1e-5), together_norm[row : row + 1])
        assert torch.equal(ops.silu_and_mul(gate_up[row : row + 1]), together_act[row : row + 1])


def test_the_library_is_built_once_under_kvroute_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVROUTE_HOME", str(tmp_path))
    assert native.kernels() is not None
    built = list((tmp_path / "kernels").glob("kvroute_kernels-*.so"))
    assert len(built) == 1, "one library, no partial files left behind"
    stamp = built[0].stat().st_mtime_ns
    native.kernels.cache_clear()
    assert native.kernels() is not None
    assert built[0].stat().st_mtime_ns == stamp, "the second start reuses the cached build"


def test_switched_off_the_eager_ops_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.kernels() is None
    x = torch.randn(4, HIDDEN, dtype=torch.bfloat16)
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), ops.eager_rms_norm(x, weight, 1e-5))


def test_no_compiler_means_eager_ops_and_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVROUTE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ or c++ on it
    monkeypatch.delenv("CXX", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvroute.replica"):
        assert native.kernels() is None
    assert "no C++ compiler" in caplog.text


def test_a_failing_build_means_eager_ops_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = tmp_path / "broken-cxx"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && echo broken 1.0 && exit 0\n'
        "echo 'cc1plus: out of memory' >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("KVROUTE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(fake))
    with caplog.at_level(logging.WARNING, logger="kvroute.replica"):
        assert native.kernels() is None
    assert "out of memory" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so")), "no partial library left to load later"


def paged_decode(
    native_kernel: bool, q: torch.Tensor, kv_cache: torch.Tensor, tables: list[list[int]], lengths: list[int]
) -> torch.Tensor:
    """One decode step's attention through ``paged_attention``, the native kernel's way or the
    batched matmuls' over a gathered context; the new tokens' K/V are already in the pool."""
    _, kv_heads, _, page_size, dim = kv_cache.shape
    width = max(len(table) for table in tables)
    pages = torch.tensor([table + [0] * (width - len(table)) for table in tables])
    lengths_t = torch.tensor(lengths)
    slots = torch.tensor(
        [tables[i][(n - 1) // page_size] * page_size + (n - 1) % page_size for i, n in enumerate(lengths)]
    )
    new_kv = kv_cache.view(2, kv_heads, -1, dim)[:, :, slots].permute(2, 0, 1, 3)  # rewritten as they are
    group = q.shape[1] // kv_heads
    bias = None if native_kernel else decode_bias(lengths_t, width * page_size, kv_heads, group, q.dtype)
    batch = AttentionBatch(
        slots, len(tables), pages, bias, [], decode_lengths=lengths_t if native_kernel else None
    )
    return paged_attention(q, new_kv.contiguous(), kv_cache, batch, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, HEAD_DIM, 80])
@pytest.mark.parametrize("portable", [False, True])
def test_decode_attention_reads_the_pages_as_the_gathered_form(
    dtype: torch.dtype, head_dim: int, portable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences of different lengths over scattered pages, padded page tables: the kernel's
    attention equals the batched matmuls' (fp32 to rounding, bf16 within a unit of its last place),
    and a sequence's rows are the same alone as beside others. Head sizes the AVX-512 form takes
    (16, 64) and one it leaves to the portable loops (80); ``portable`` builds without that form,
    so its loops are checked on AVX-512 hosts too."""
    if portable:
        monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DKVROUTE_PORTABLE"))
    needs_kernels()
    generator = torch.Generator().manual_seed(1)
    kv_heads, heads, page_size, pages = 3, 9, 16, 64
    kv_cache = torch.randn(2, kv_heads, pages, page_size, head_dim, generator=generator).to(dtype)
    lengths = [1, 16, 17, 200, 45]
    order = torch.randperm(pages, generator=generator).tolist()
    tables, used = [], 0
    for n in lengths:
        count = -(-n // page_size)
        tables.append(order[used : used + count])
        used += count
    q = torch.randn(len(lengths), heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)[:, :heads]
    fused = paged_decode(True, q, kv_cache, tables, lengths)
    eager = paged_decode(False, q, kv_cache, tables, lengths)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(fused, eager, rtol=1.6e-2, atol=1e-2)
    else:
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    for row in range(len(lengths)):
        alone = paged_decode(True, q[row : row + 1], kv_cache, tables[row : row + 1], lengths[row : row + 1])
        assert torch.equal(alone, fused[row : row + 1])
