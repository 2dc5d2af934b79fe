"""The patch Gram of stride-1 convolutions from shifted views equals the naive patches' product."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from core.conv_gram import Geometry, ShiftedPatches, plan
from core.layers import SHIFTED_FLOP_FRACTION, Conv2dHelper
from tests.core.reference import conv_patches_naive, with_bias_column

KERNELS = [(3, 3), (1, 3), (2, 2), (5, 3)]
DILATIONS = [(1, 1), (2, 1), (1, 2)]
PADDINGS = [(0, 0), (1, 1), (2, 1), (3, 3)]
SIZES = [(5, 7), (4, 4), (9, 6)]


def naive_gram(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    rows = conv_patches_naive(x, conv)
    if conv.bias is not None:
        rows = with_bias_column(rows)
    rows = rows.reshape(-1, rows.shape[-1])
    return rows.T @ rows


def shifted_gram(x: torch.Tensor, conv: nn.Conv2d, scale: float = 1.0) -> torch.Tensor:
    geometry = Geometry(conv.kernel_size, conv.dilation, conv.padding)  # type: ignore[arg-type]
    layout = ShiftedPatches(x, plan(geometry, x.shape[2], x.shape[3]), x.dtype)
    dim = conv.weight[0].numel() + int(conv.bias is not None)
    out = torch.full((dim, dim), float("nan"), dtype=x.dtype)  # every entry must be written
    return layout.gram(out, scale, conv.bias is not None)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dilation", DILATIONS)
def test_every_geometry_matches_the_naive_patches(kernel: tuple[int, int],
                                                  dilation: tuple[int, int]) -> None:
    """Kernels square and not, dilations, paddings from none to more than the kernel needs,
    inputs square and not, with and without the bias entry, in float64."""
    torch.manual_seed(0)
    checked = 0
    for padding, (h, w), bias in itertools.product(PADDINGS, SIZES, (False, True)):
        conv = nn.Conv2d(3, 2, kernel, padding=padding, dilation=dilation, bias=bias).double()
        reach = ((kernel[0] - 1) * dilation[0], (kernel[1] - 1) * dilation[1])
        if h + 2 * padding[0] <= reach[0] or w + 2 * padding[1] <= reach[1]:
            continue
        x = torch.randn(2, 3, h, w, dtype=torch.float64)
        got = shifted_gram(x, conv)
        torch.testing.assert_close(got, naive_gram(x, conv), rtol=1e-12, atol=1e-12)
        assert torch.equal(got, got.T)
        checked += 1
    assert checked >= 12


def test_fp32_result_is_exactly_symmetric_and_scaled() -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(8, 4, 3, padding=1)
    x = torch.randn(3, 8, 12, 10)
    got = shifted_gram(x, conv, scale=0.25)
    assert torch.equal(got, got.T)
    expected = 0.25 * naive_gram(x.double(), conv.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_one_example_and_one_output_position() -> None:
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 2, 3, padding=0, bias=True).double()
    x = torch.randn(1, 2, 3, 3, dtype=torch.float64)  # a single patch
    torch.testing.assert_close(shifted_gram(x, conv), naive_gram(x, conv))


def test_plan_of_a_3x3_kernel() -> None:
    """13 displacements (a GEMM each) for the 81 blocks; the centre offset's window is the
    whole image, so its diagonal block is one correlation with no edge correction."""
    p = plan(Geometry((3, 3), (1, 1), (1, 1)), 8, 8)
    assert len(p.shifts) == 13 and len(p.blocks) == 45
    assert p.output == (8, 8) and p.positions == 64
    centre = next(b for b in p.blocks if b.alpha == b.beta == 4)
    assert centre.corrections == ()
    corner = next(b for b in p.blocks if b.alpha == b.beta == 0)  # misses the last row and column
    assert sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in corner.corrections) == 8 + 8 - 1
    assert p.flops(32, 64) < 0.6 * p.patch_flops(32, 64)


def test_plan_refuses_a_kernel_larger_than_the_padded_input() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        plan(Geometry((5, 5), (1, 1), (0, 0)), 4, 9)


@pytest.mark.parametrize(("conv", "shape", "shifted"), [
    (nn.Conv2d(64, 64, 3, padding=1), (32, 64, 16, 16), True),
    (nn.Conv2d(64, 64, 3, padding="same", dilation=2), (32, 64, 16, 16), True),
    (nn.Conv2d(64, 64, 3, stride=2, padding=1), (32, 64, 16, 16), False),  # strided
    (nn.Conv2d(64, 64, 1), (32, 64, 16, 16), False),  # the rows are the input itself
    (nn.Conv2d(64, 64, 3, padding=1), (32, 64, 1, 1), False),  # mostly padding: costlier
    (nn.Conv2d(512, 512, 3, padding=1), (32, 512, 4, 4), False),  # 0.84 of the FLOPs: too few
    (nn.Conv2d(512, 512, 3, padding=1), (16, 512, 7, 7), True),  # 0.61
])
def test_helper_plans_only_where_it_saves_enough_flops(conv: nn.Conv2d, shape: tuple[int, ...],
                                                       shifted: bool) -> None:
    p = Conv2dHelper(conv).shifted_plan(torch.Size(shape))
    assert (p is not None) == shifted
    if p is not None:
        saved = p.flops(shape[0], shape[1]) / p.patch_flops(shape[0], shape[1])
        assert saved < SHIFTED_FLOP_FRACTION


def test_switch_turns_the_shifted_product_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("core.layers.SHIFTED_CONV_GRAM", False)
    helper = Conv2dHelper(nn.Conv2d(64, 64, 3, padding=1))
    assert helper.shifted_plan(torch.Size((32, 64, 16, 16))) is None
