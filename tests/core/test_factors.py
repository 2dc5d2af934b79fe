"""Batch factors captured through the hooks equal the KFAC_MATH.md table, computed naively."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core import KFACPreconditioner
from core.factors import SymmetricGram, gram_diagonal_checks
from core.layers import Conv2dHelper
from tests.core.reference import conv_patches_naive, reference_factors, with_bias_column

SCALINGS = ("kaisa", "kfc", "dpkfac")


def captured_factors(module: nn.Module, x: torch.Tensor, scaling: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of capture; returns (A, G, autograd's output gradient g)."""
    precond = KFACPreconditioner(module, factor_scaling=scaling, factor_dtype="float64",
                                 inverse_dtype="float64", kl_clip=None)
    out = module(x)
    out.retain_grad()
    target = torch.randn_like(out)
    ((out - target) ** 2).sum(dim=tuple(range(1, out.dim()))).mean().backward()
    precond.step()
    layer = precond.layers[0]
    assert layer.a.value is not None and layer.g.value is not None
    return layer.a.value, layer.g.value, out.grad


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_2d_factors(scaling: str, bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=bias).double()
    x = torch.randn(7, 5, dtype=torch.float64)
    a, g, gy = captured_factors(layer, x, scaling)
    rows = with_bias_column(x) if bias else x
    ref_a, ref_g = reference_factors(rows[:, None], gy[:, None], spatial=False, scaling=scaling)
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(g, ref_g)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_3d_factors(scaling: str, bias: bool) -> None:
    """With ``dpkfac`` the rows are averaged per example from the averaged input, the bias
    entry appended after: the same factor as averaging the rows themselves."""
    torch.manual_seed(1)
    layer = nn.Linear(4, 6, bias=bias).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)  # (B, T, D)
    a, g, gy = captured_factors(layer, x, scaling)
    rows = with_bias_column(x) if bias else x
    ref_a, ref_g = reference_factors(rows, gy, spatial=False, scaling=scaling)
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(g, ref_g)


CONVS = [
    dict(kernel_size=3, stride=1, padding=1, dilation=1, bias=True),
    dict(kernel_size=3, stride=2, padding=0, dilation=1, bias=False),
    dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 2), dilation=(2, 1), bias=True),
]


@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("conv_args", CONVS)
def test_conv2d_factors_match_naive_patches(monkeypatch: pytest.MonkeyPatch, scaling: str,
                                            conv_args: dict, shifted: bool) -> None:
    """With patch rows, and (stride 1) from shifted views of the input (core.conv_gram)."""
    monkeypatch.setattr("core.layers.SHIFTED_CONV_GRAM", shifted)
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, **conv_args).double()
    x = torch.randn(2, 2, 7, 6, dtype=torch.float64)
    takes_shifted = Conv2dHelper(conv).shifted_plan(x.shape) is not None
    assert takes_shifted == (shifted and conv.stride == (1, 1))
    a, g, gy = captured_factors(conv, x, scaling)
    patches = conv_patches_naive(x, conv)
    if conv.bias is not None:
        patches = with_bias_column(patches)
    g_rows = gy.flatten(2).transpose(1, 2)  # (B, L, c_out)
    assert patches.shape[1] == g_rows.shape[1]
    ref_a, ref_g = reference_factors(patches, g_rows, spatial=True, scaling=scaling)
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(g, ref_g)


@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize(("kernel", "dilation"), [(3, 1), ((3, 5), 1), ((3, 5), (2, 1))])
def test_same_padding_factors_match_naive_patches_of_its_integer_padding(
        monkeypatch: pytest.MonkeyPatch, kernel: int | tuple[int, int],
        dilation: int | tuple[int, int], shifted: bool) -> None:
    """``padding="same"`` (odd kernels: symmetric) against the naive patches of the same
    convolution given its padding as integers; the references compared before used the code
    under test's own reading of "same"."""
    monkeypatch.setattr("core.layers.SHIFTED_CONV_GRAM", shifted)
    torch.manual_seed(3)
    conv = nn.Conv2d(2, 3, kernel, padding="same", dilation=dilation).double()
    k, d = nn.modules.utils._pair(kernel), nn.modules.utils._pair(dilation)
    twin = nn.Conv2d(2, 3, kernel, dilation=dilation,
                     padding=tuple(d[i] * (k[i] - 1) // 2 for i in range(2))).double()
    x = torch.randn(2, 2, 7, 6, dtype=torch.float64)
    a, g, gy = captured_factors(conv, x, "kfc")
    patches = with_bias_column(conv_patches_naive(x, twin))
    assert patches.shape[1] == 7 * 6  # "same": one row per input position
    ref_a, ref_g = reference_factors(patches, gy.flatten(2).transpose(1, 2), spatial=True,
                                     scaling="kfc")
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(g, ref_g)


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
def test_conv_padding_other_than_zeros_is_skipped_with_warning(mode: str) -> None:
    """Its patches would be zero-padded where the layer pads with other values."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode), nn.Flatten(),
                          nn.Linear(75, 2))
    with pytest.warns(UserWarning, match=f"padding_mode='{mode}'"):
        precond = KFACPreconditioner(model)
    assert [layer.name for layer in precond.layers] == ["2"]


def test_grouped_conv_is_skipped_with_warning() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 4, 5, 5))
    with pytest.warns(UserWarning, match="groups=2"):
        precond = KFACPreconditioner(model)
    assert [layer.name for layer in precond.layers] == ["2"]


@pytest.mark.parametrize("factor_init", ["batch", "identity"])
def test_running_average_starts_at_the_first_batch_or_the_identity(factor_init: str) -> None:
    """``F ← 0.9·F + 0.1·F_batch`` from ``F = F_batch₁`` ("batch"), or from ``F = I`` before
    the first update ("identity", KAISA's and the DP-KFAC code's start): both factors."""
    torch.manual_seed(3)
    layer = nn.Linear(3, 2).double()
    precond = KFACPreconditioner(layer, factor_decay=0.9, factor_dtype="float64", kl_clip=None,
                                 factor_init=factor_init)
    a_batches, g_batches = [], []
    for _ in range(3):
        x = torch.randn(4, 3, dtype=torch.float64)
        layer.zero_grad()
        out = layer(x)
        out.pow(2).sum().backward()
        a_batches.append(with_bias_column(x).T @ with_bias_column(x) / 4)
        g_batches.append((2 * out).T @ (2 * out) / 4)  # KAISA's G of the summed loss
        precond.step()
    for batches, got in ((a_batches, precond.layers[0].a.value),
                         (g_batches, precond.layers[0].g.value)):
        expected = (torch.eye(batches[0].shape[0], dtype=torch.float64)
                    if factor_init == "identity" else None)
        for batch in batches:
            expected = batch if expected is None else 0.9 * expected + 0.1 * batch
        torch.testing.assert_close(got, expected)


def test_factors_stay_fp32_under_bf16_autocast() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    precond = KFACPreconditioner(model, kl_clip=None)
    x = torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    out.float().pow(2).mean().backward()
    precond.step()
    for layer in precond.layers:
        assert layer.a.value.dtype == torch.float32 and layer.g.value.dtype == torch.float32
    rows = with_bias_column(x.double())
    exact = (rows.T @ rows / 16).float()
    # fp32 accuracy, far tighter than bf16's 3 significant digits
    torch.testing.assert_close(precond.layers[0].a.value, exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [2, 3, 512])
def test_blocked_symmetric_product_is_exact_and_symmetric(monkeypatch: pytest.MonkeyPatch,
                                                          block: int) -> None:
    """The GEMM-per-block product that devices without a host ``syrk`` (GPUs) use (for the
    convolution's ``A`` too: its shifted product is switched off)."""
    monkeypatch.setattr("core.factors.HOST_SYRK", False)
    monkeypatch.setattr("core.layers.SHIFTED_CONV_GRAM", False)
    monkeypatch.setattr("core.factors.GRAM_BLOCK", block)
    torch.manual_seed(5)
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    x = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    a, g, gy = captured_factors(conv, x, "kfc")
    patches = with_bias_column(conv_patches_naive(x, conv))
    ref_a, ref_g = reference_factors(patches, gy.flatten(2).transpose(1, 2), spatial=True,
                                     scaling="kfc")
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(g, ref_g)
    assert torch.equal(a, a.T) and torch.equal(g, g.T)


@pytest.mark.parametrize("host_syrk", [True, False])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("conv_args", CONVS[:2])
def test_factors_built_slice_by_slice_equal_the_whole_batch(
        monkeypatch: pytest.MonkeyPatch, scaling: str, conv_args: dict, host_syrk: bool) -> None:
    """Rows built and multiplied one example at a time (the cache-sized slices of large
    batches) give the naive factors of the whole batch, with BLAS ``syrk`` or blocks."""
    monkeypatch.setattr("core.factors.HOST_SYRK", host_syrk)
    monkeypatch.setattr("core.layers.SHIFTED_CONV_GRAM", False)  # rows for every stride
    monkeypatch.setattr("core.layers.ROW_PART_BYTES", 1)
    monkeypatch.setattr("core.layers.MIN_PART_ROWS", 1)
    monkeypatch.setattr("core.factors.GRAM_BLOCK", 2)
    torch.manual_seed(6)
    conv = nn.Conv2d(2, 3, **conv_args).double()
    x = torch.randn(3, 2, 7, 6, dtype=torch.float64)
    a, g, gy = captured_factors(conv, x, scaling)
    patches = conv_patches_naive(x, conv)
    if conv.bias is not None:
        patches = with_bias_column(patches)
    ref_a, ref_g = reference_factors(patches, gy.flatten(2).transpose(1, 2), spatial=True,
                                     scaling=scaling)
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(g, ref_g)
    assert torch.equal(a, a.T) and torch.equal(g, g.T)


def test_linear_factors_with_bias_built_slice_by_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("core.layers.ROW_PART_BYTES", 1)
    monkeypatch.setattr("core.layers.MIN_PART_ROWS", 1)
    torch.manual_seed(7)
    layer = nn.Linear(4, 6).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    a, g, gy = captured_factors(layer, x, "kaisa")
    ref_a, ref_g = reference_factors(with_bias_column(x), gy, spatial=False, scaling="kaisa")
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(g, ref_g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["row-major", "column-major", "strided"])
def test_host_syrk_accumulates_scaled_parts_of_any_layout(dtype: torch.dtype,
                                                          layout: str) -> None:
    """Parts in every layout the captures produce (conv patches row-major, Linear inputs
    column-major, others strided) add up to ``Σ scale_k m_k m_kᵀ``, exactly symmetric."""
    torch.manual_seed(8)
    parts = [torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 9, dtype=torch.float64)]
    scales = [0.5, 2.0]

    def laid_out(m: torch.Tensor) -> torch.Tensor:
        m = m.to(dtype)
        if layout == "column-major":
            return m.T.contiguous().T
        if layout == "strided":  # every other column of a wider matrix
            return torch.stack([m, m], dim=2)[:, :, 0]
        return m

    gram = SymmetricGram(7, dtype, torch.device("cpu"))
    assert gram.syrk
    for m, scale in zip(parts, scales, strict=True):
        gram.add(laid_out(m), scale)
    out = gram.result()
    expected = sum(scale * m @ m.T for m, scale in zip(parts, scales, strict=True))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), expected, **tolerance)
    assert torch.equal(out, out.T)


def test_host_syrk_uses_as_many_blas_threads_as_torch() -> None:
    from threadpoolctl import ThreadpoolController

    gram = SymmetricGram(3, torch.float32, torch.device("cpu"))
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            gram.add(torch.ones(3, 4), 1.0)
            openblas = ThreadpoolController().select(internal_api="openblas").info()
            assert openblas and all(lib["num_threads"] == threads for lib in openblas)
    finally:
        torch.set_num_threads(before)


def test_gram_diagonal_checks_flag_non_finite_and_all_zero_factors() -> None:
    """Per ``(A, G)`` pair: finite exactly when every entry of both is (checked against
    ``isfinite`` of the whole matrices), ``A`` zero exactly when all of it is; factors of
    several sizes, in one call. Diagonal entries near float32's largest value, whose float32
    trace would overflow, are still finite."""
    gen = torch.Generator().manual_seed(4)

    def gram(dim: int, rows: int = 3) -> torch.Tensor:
        m = torch.randn(dim, rows, generator=gen)
        return m @ m.T

    huge = torch.diag(torch.full((3,), 3e38))
    nan_off_diagonal = gram(4)
    nan_off_diagonal[0, 1] = nan_off_diagonal[1, 0] = float("nan")
    nan_row = gram(5)
    nan_row[2, :] = nan_row[:, 2] = float("nan")  # what a NaN row entry makes of a Gram
    inf_diagonal = gram(2)
    inf_diagonal[1, 1] = float("inf")
    pairs = [(gram(3), gram(2)), (torch.zeros(4, 4), gram(6)), (huge, gram(2)),
             (gram(5), nan_row), (inf_diagonal, gram(3)), (torch.zeros(2, 2), torch.zeros(1, 1))]
    expected = [(bool(a.isfinite().all() and g.isfinite().all()), not bool(a.any()))
                for a, g in pairs]
    assert expected == [(True, False), (True, True), (True, False), (False, False),
                        (False, False), (True, True)]
    assert gram_diagonal_checks(pairs) == expected
    assert gram_diagonal_checks([]) == []
    # a NaN off the diagonal alone is not a Gram matrix's: the check reads diagonals only
    assert gram_diagonal_checks([(nan_off_diagonal, gram(2))]) == [(True, False)]
