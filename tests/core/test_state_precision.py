"""The per-factor precision of a narrow second-order state (``precondition_dtype_tolerance``):
the rounding check against dense float64 products, and what the preconditioner keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core import KFACPreconditioner
from core.config import ConfigError
from core.inverse import (
    PROBE_VECTORS,
    SIDES,
    apply_side,
    damped_cholesky,
    damped_inverse,
    eigen_decompose,
    kept_dtype,
    make_state,
    precondition,
    probe_vectors,
    rounding_error,
)
from core.kfac_layer import KFACLayer
from core.layers import helper_for
from tests.core.reference import dense_inverse_precondition


def spd(n: int, rows: int, seed: int) -> Tensor:
    """``(1/rows) Σ x xᵀ`` of ``rows`` random vectors: rank ``min(n, rows)``, in float64."""
    x = torch.randn(n, rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x @ x.T / rows


def side_tensors(kind: str, factor: Tensor, shift: float) -> list[Tensor]:
    if kind == "eigen":
        return list(eigen_decompose(factor, torch.float64))
    if kind == "cholesky_solve":
        return [damped_cholesky(factor, shift, torch.float64)]
    return [damped_inverse(factor, shift, "inverse", torch.float64)]


@pytest.mark.parametrize("kind", ["inverse", "cholesky_solve", "eigen"])
def test_apply_side_is_the_damped_inverse_times_x(kind: str) -> None:
    factor, shift = spd(7, 4, seed=0), 0.3
    x = torch.randn(7, 3, dtype=torch.float64)
    expected = torch.linalg.inv(factor + shift * torch.eye(7, dtype=torch.float64)) @ x
    torch.testing.assert_close(apply_side(side_tensors(kind, factor, shift), kind, shift, x),
                               expected)


def test_rounding_error_is_the_relative_error_of_the_rounded_product() -> None:
    factor, shift = spd(9, 20, seed=1), 0.1
    inverse = torch.linalg.inv(factor + shift * torch.eye(9, dtype=torch.float64))
    x = torch.randn(9, 4, dtype=torch.float64)
    exact = inverse @ x
    rounded = (inverse.bfloat16() @ x.bfloat16()).double()
    expected = float((rounded - exact).norm() / exact.norm())
    got = rounding_error([inverse], "inverse", shift, x, torch.bfloat16)
    assert got == pytest.approx(expected, rel=1e-6)
    assert 0 < got < 2**-6  # a well-conditioned factor: a few roundings' worth
    assert rounding_error([inverse], "inverse", shift, torch.zeros(9, 2, dtype=torch.float64),
                          torch.bfloat16) == 0.0


def test_rounding_loses_the_product_of_a_rank_deficient_factor_under_small_damping() -> None:
    """Fewer rows than the width: the gradient lives in the rows' span, where the inverse is
    moderate, but the inverse holds ``1/λ`` entries in the other directions, and rounding
    noise in the operand excites them."""
    n, rows, shift = 48, 6, 1e-4
    x = torch.randn(n, rows, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    factor = x @ x.T / rows
    grad_rows = x @ torch.randn(rows, 5, dtype=torch.float64)  # in the span of the inputs
    for kind in ("inverse", "eigen"):
        error = rounding_error(side_tensors(kind, factor, shift), kind, shift, grad_rows,
                               torch.bfloat16)
        assert error > 0.5, kind


def test_probe_vectors_are_evenly_spaced_gradient_rows_or_columns() -> None:
    grad = torch.arange(5 * 200, dtype=torch.float32).reshape(5, 200)
    g_probe = probe_vectors(grad, "g")  # columns, multiplied by G⁻¹ on the left
    assert g_probe.shape == (5, PROBE_VECTORS)
    torch.testing.assert_close(g_probe, grad[:, ::200 // PROBE_VECTORS][:, :PROBE_VECTORS])
    a_probe = probe_vectors(grad, "a")  # rows, multiplied by A⁻¹ on the right
    torch.testing.assert_close(a_probe, grad.T)  # 5 rows: all of them


def test_kept_dtype_rounds_within_the_tolerance_and_keeps_the_rest() -> None:
    factor, shift = spd(48, 6, seed=3), 1e-4
    inverse = side_tensors("inverse", factor, shift)
    grad = torch.randn(3, 6, dtype=torch.float64) @ torch.randn(6, 48, dtype=torch.float64)
    error = rounding_error(inverse, "inverse", shift, probe_vectors(grad, "a"), torch.bfloat16)
    narrow = torch.bfloat16
    assert kept_dtype(inverse, "inverse", shift, grad, "a", narrow, error * 1.01) == narrow
    assert kept_dtype(inverse, "inverse", shift, grad, "a", narrow, error * 0.99) \
        == torch.float64


@pytest.mark.parametrize("kind", ["inverse", "eigen"])
@pytest.mark.parametrize("wide", ["a", "g"])
def test_a_state_with_sides_of_two_dtypes_applies_the_wide_side_first(kind: str,
                                                                      wide: str) -> None:
    """``P`` with one factor kept in float64 and the other rounded stays within bf16 rounding
    of the dense product, and the wide factor multiplies the unrounded gradient: its
    operand never carries the narrow side's rounding, which it would amplify."""
    a, g, damping = spd(6, 10, seed=4), spd(4, 10, seed=5), 0.2
    grad = torch.randn(4, 6, dtype=torch.float64)
    ta, tg = side_tensors(kind, a, damping), side_tensors(kind, g, damping)
    exact = precondition(grad, make_state(kind, [*ta, *tg]), damping)
    torch.testing.assert_close(exact, dense_inverse_precondition(grad, a, g, damping, damping)
                               if kind == "inverse" else exact)
    state = make_state(kind, [*ta, *tg])
    state.convert_side("g" if wide == "a" else "a", torch.bfloat16)
    p = precondition(grad, state, damping).double()
    assert 0 < float((p - exact).norm() / exact.norm()) < 2**-6
    if kind == "inverse":
        a_inv, g_inv = ta[0], tg[0]
        by_hand = ((g_inv.bfloat16() @ (grad @ a_inv).bfloat16()) if wide == "a"
                   else (g_inv @ grad).bfloat16() @ a_inv.bfloat16())
        torch.testing.assert_close(p, by_hand.double(), rtol=0, atol=0)


@pytest.mark.parametrize(("a_dim", "g_dim"), [(9, 4), (4, 9), (5, 5)])
def test_bf16_inverses_apply_the_wider_a_side_first_and_write_p_row_major(a_dim: int,
                                                                          g_dim: int) -> None:
    """With both sides in bf16, a wider ``A`` goes first, as ``(A⁻¹·∇W̄ᵀ)ᵀ`` (the faster GEMM
    on the CPU), otherwise ``G``; ``P`` stays within bf16 rounding of the dense product and
    comes out row-major, so writing it into ``.grad`` is a plain copy."""
    a, g, damping = spd(a_dim, 12, seed=6), spd(g_dim, 12, seed=7), 0.2
    grad = torch.randn(g_dim, a_dim, dtype=torch.float64)
    ta, tg = side_tensors("inverse", a, damping), side_tensors("inverse", g, damping)
    exact = dense_inverse_precondition(grad, a, g, damping, damping)
    state = make_state("inverse", [*ta, *tg])
    for side in SIDES:
        state.convert_side(side, torch.bfloat16)
    p = precondition(grad, state, damping)
    assert p.dtype == torch.bfloat16 and p.is_contiguous()
    assert 0 < float((p.double() - exact).norm() / exact.norm()) < 2**-6
    a_inv, g_inv, rounded = ta[0].bfloat16(), tg[0].bfloat16(), grad.bfloat16()
    by_hand = (g_inv @ (a_inv @ rounded.T).T if a_dim > g_dim else (g_inv @ rounded) @ a_inv)
    torch.testing.assert_close(p, by_hand, rtol=0, atol=0)


def rank_deficient_classifier() -> nn.Module:
    """A convolution, then a classifier whose 65-wide input factor sees 4 rows per batch
    (and whose 3-wide output factor has softmax's null vector)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 3))


def guarded_step(tolerance: float | None, precondition_dtype: str | None = "bfloat16"
                 ) -> tuple[KFACPreconditioner, dict[str, Tensor], dict[str, Tensor]]:
    """One step with bf16 states (or ``precondition_dtype``'s); returns the preconditioner, and
    per layer ``P`` and the exact ``P`` (float64, dense, from the same factors)."""
    model = rank_deficient_classifier()
    options = {"inverse_method": "inverse", "damping": 1e-4, "kl_clip": None}
    precond = KFACPreconditioner(model, precondition_dtype=precondition_dtype,
                                 precondition_dtype_tolerance=tolerance, **options)
    x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0])
    nn.functional.cross_entropy(model(x), y).backward()
    raw = {layer.name: layer.helper.grad_matrix().clone() for layer in precond.layers}
    precond.step()
    exact = {}
    for layer in precond.layers:
        assert layer.a.value is not None and layer.g.value is not None
        exact[layer.name] = dense_inverse_precondition(
            raw[layer.name].double(), layer.a.value.double(), layer.g.value.double(), 1e-4,
            1e-4)
    new = {layer.name: layer.helper.grad_matrix().double() for layer in precond.layers}
    return precond, new, exact


def relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_tolerance_keeps_the_rank_deficient_factor_in_fp32_and_its_product_accurate() -> None:
    rounded, new_rounded, exact = guarded_step(None)
    guarded, new_guarded, _ = guarded_step(0.05)
    _, new_fp32, exact_fp32 = guarded_step(None, precondition_dtype=None)
    assert relative(new_rounded["3"], exact["3"]) > 0.3  # every factor rounded: digits lost
    # kept: the fp32 state's product, as accurate as fp32 is at this conditioning (the damped
    # factor's is about 1e5: 6% from float64 with MKL on an AMD EPYC, under 5% on an Intel Xeon)
    torch.testing.assert_close(new_guarded["3"], new_fp32["3"], rtol=1e-6, atol=0)
    assert relative(new_fp32["3"], exact_fp32["3"]) < 0.15
    dtypes = {layer.name: [layer.state.side_dtype(s) for s in SIDES]  # type: ignore[union-attr]
              for layer in guarded.layers}
    assert dtypes == {"0": [torch.bfloat16, torch.bfloat16],
                      "3": [torch.float32, torch.float32]}
    assert guarded.metrics()["wide_state_sides"] == 2
    assert rounded.metrics()["wide_state_sides"] == 0
    assert relative(new_guarded["0"], exact["0"]) < 0.05  # the convolution stays rounded
    # the kept factor costs its fp32 bytes
    usage = guarded.memory_usage()["inverses"] - rounded.memory_usage()["inverses"]
    assert usage == (65 * 65 + 3 * 3) * 2


def test_a_checkpoint_keeps_each_factor_in_the_dtype_it_was_kept_in() -> None:
    saved, _, _ = guarded_step(0.05)
    loaded = KFACPreconditioner(rank_deficient_classifier(), inverse_method="inverse",
                                precondition_dtype="bfloat16")
    loaded.load_state_dict(saved.state_dict())
    for before, after in zip(saved.layers, loaded.layers, strict=True):
        for a, b in zip(before.state.tensors(), after.state.tensors(),  # type: ignore[union-attr]
                        strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    # without the state dtype recorded (an older checkpoint), every side is converted
    old = {k: v for k, v in saved.state_dict().items() if k != "state_dtype"}
    loaded.load_state_dict(old)
    assert all(t.dtype == torch.bfloat16 for layer in loaded.layers
               for t in layer.state.tensors())  # type: ignore[union-attr]


def test_the_tolerance_must_be_a_non_negative_number() -> None:
    for bad in (-0.1, "0.05", float("nan")):
        with pytest.raises(ConfigError, match="precondition_dtype_tolerance"):
            KFACPreconditioner(rank_deficient_classifier(), precondition_dtype="bfloat16",
                               precondition_dtype_tolerance=bad)


def test_rounded_side_rounds_into_the_states_own_narrow_tensors() -> None:
    """A rounding the tolerance check reads becomes the state without a second copy: it is
    written over the side's own tensors when they are kept narrow; a side kept wider is left
    as it is (its rounding goes to new tensors) until :meth:`set_side` decides."""
    a, g = spd(5, 9, seed=8).float(), spd(3, 9, seed=9).float()
    state = make_state("inverse", [a, g])
    state.convert_side("a", torch.bfloat16)
    own = state.side_tensors("a")[0]
    fresh = [torch.randn(5, 5)]
    rounded = state.rounded_side("a", fresh, torch.bfloat16)
    assert rounded[0] is own and torch.equal(own, fresh[0].bfloat16())
    state.set_side("a", rounded, torch.bfloat16)
    assert state.side_tensors("a")[0] is own
    before = state.side_tensors("g")[0].clone()
    new = state.rounded_side("g", [torch.randn(3, 3)], torch.bfloat16)
    assert new[0].dtype == torch.bfloat16 and new[0] is not state.side_tensors("g")[0]
    assert torch.equal(state.side_tensors("g")[0], before)
    shift, grad = 1e-4, torch.randn(2, 5)
    for tolerance in (0.0, 1.0):  # the same verdict from the rounding given as made anew
        assert kept_dtype([fresh[0]], "inverse", shift, grad, "a", torch.bfloat16, tolerance,
                          rounded) == kept_dtype([fresh[0]], "inverse", shift, grad, "a",
                                                 torch.bfloat16, tolerance)


def singular_layer() -> KFACLayer:
    """A layer whose ``A`` is singular (two inputs always zero): with a tiny damping its damped
    inverse has entries of ``1/λ``, beyond fp32's range, while ``G``'s is the identity."""
    layer = KFACLayer("fc", helper_for(nn.Linear(4, 3, bias=False)),  # type: ignore[arg-type]
                      scaling="kaisa", factor_dtype=torch.float64, grad_multiplier=lambda: 1.0)
    layer.a.value = torch.diag(torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64))
    layer.g.value = torch.eye(3, dtype=torch.float64)
    return layer


@pytest.mark.parametrize("tolerance", [None, 0.05])
@pytest.mark.parametrize("narrow", [torch.float32, torch.bfloat16])
def test_a_rounding_out_of_the_narrow_range_keeps_the_side_wide(
        tolerance: float | None, narrow: torch.dtype) -> None:
    """An fp64 inverse with entries beyond the state dtype's range would round to infinities:
    that side stays in fp64 (finite, the exact inverse), with or without the tolerance check,
    and the side that fits is rounded."""
    layer, damping = singular_layer(), 1e-45
    layer.compute_inverse(method="inverse", damping=damping, split="full",
                          dtype=torch.float64, state_dtype=narrow,
                          grad=torch.randn(3, 4, dtype=torch.float64), tolerance=tolerance)
    assert layer.has_state and layer.decomposition_failures == 0
    state = layer.state
    assert state is not None
    assert state.side_dtype("a") == torch.float64 and state.side_dtype("g") == narrow
    (a_inv,) = state.side_tensors("a")
    assert bool(a_inv.isfinite().all())
    eye = torch.eye(4, dtype=torch.float64)
    torch.testing.assert_close(a_inv, torch.linalg.inv(layer.a.value + damping * eye))


@pytest.mark.parametrize("narrow", [torch.float32, torch.bfloat16])
def test_pre_divided_ratios_beyond_the_narrow_range_stay_wide_under_the_tolerance_check(
        narrow: torch.dtype) -> None:
    """The tolerance check tries ``eigen``'s eigenvalues, which fit the narrow dtype; the
    pre-divided ratios ``1/(d_G d_A + λ)`` of the zero eigenvalues (``1/λ``) do not, and
    would round to infinities: that side is kept in fp64, and the product is the exact one."""
    layer, damping = singular_layer(), 1e-45
    grad = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layer.compute_inverse(method="eigen_prediv", damping=damping, split="full",
                          dtype=torch.float64, state_dtype=narrow, grad=grad, tolerance=0.05)
    state = layer.state
    assert state is not None and layer.has_state
    assert all(bool(t.isfinite().all()) for t in state.tensors())
    d_a, q_a = torch.linalg.eigh(layer.a.value)
    d_g, q_g = torch.linalg.eigh(layer.g.value)
    exact = q_g @ ((q_g.T @ grad @ q_a) / (torch.outer(d_g, d_a) + damping)) @ q_a.T
    torch.testing.assert_close(layer.precondition(grad, damping), exact, rtol=1e-10, atol=0)


def test_set_side_takes_over_a_fresh_rounding_of_another_dtype() -> None:
    """A side kept wide whose next rounding is kept narrow: :meth:`rounded_side` rounds into
    new tensors, which :meth:`set_side` takes over instead of copying them again; a fresh
    row-major decomposition in the side's own dtype is taken over too, one of another layout
    or dtype copied row-major into it."""
    state = make_state("inverse", [spd(5, 9, seed=10).float(), spd(3, 9, seed=11).float()])
    fresh = [torch.randn(5, 5)]
    rounded = state.rounded_side("a", fresh, torch.bfloat16)
    state.set_side("a", rounded, torch.bfloat16)
    assert state.side_tensors("a")[0] is rounded[0]
    assert torch.equal(state.side_tensors("a")[0], fresh[0].bfloat16())
    state.set_side("a", [fresh[0].T], torch.float32)  # not contiguous: copied
    (kept,) = state.side_tensors("a")
    assert kept.is_contiguous() and torch.equal(kept, fresh[0].T)
    same = torch.randn(5, 5)
    state.set_side("a", [same])  # the side's own dtype (fp32 now), row-major: taken over
    assert state.side_tensors("a")[0] is same
    state.set_side("g", [torch.randn(3, 3, dtype=torch.float64)])
    assert state.side_dtype("g") == torch.float32 and state.side_tensors("g")[0].is_contiguous()


@pytest.mark.parametrize("prediv", [False, True])
@pytest.mark.parametrize(("scaling", "x_scale", "damping"), [("kaisa", 3.0, 1e-3),
                                                             ("kfc", 10.0, 1e-2)])
def test_the_eigen_rounding_check_damps_each_side_as_the_product_does(
        scaling: str, x_scale: float, damping: float, prediv: bool) -> None:
    """The eigen product divides by ``d_G d_Aᵀ + λ``: a side is damped by ``λ / d`` of the
    other side's eigenvalue, not ``λ``. Checked with ``λ``, a bf16 ``G`` passed next to a
    large ``A`` and the written gradient moved by 16% and 120% (tolerance 5%); now it stays
    within twice the tolerance of the fp32 state's."""
    written = {}
    for dtype in (None, "bfloat16"):
        torch.manual_seed(0)
        layer = nn.Linear(256, 10)
        precond = KFACPreconditioner(layer, damping=damping, kl_clip=None,
                                     inverse_method="eigen", factor_scaling=scaling,
                                     precondition_dtype=dtype, prediv_eigenvalues=prediv)
        x = torch.randn(8, 256) * x_scale
        F.cross_entropy(layer(x), torch.randint(0, 10, (8,))).backward()
        precond.step()
        written[dtype] = torch.cat([layer.weight.grad, layer.bias.grad.unsqueeze(1)], dim=1)
    error = (written["bfloat16"] - written[None]).norm() / written[None].norm()
    assert error <= 0.1


def test_pre_divided_eigenvalues_keep_wide_the_sides_eigen_keeps_wide() -> None:
    """The rounding check of a pre-divided state tries each side as ``eigen`` applies it, so
    both keep the same sides in fp32 (the classifier's rank-deficient ones here) and write
    gradients equal to within the bf16 rounding of the ratios."""
    kept, written = {}, {}
    for prediv in (False, True):
        model = rank_deficient_classifier()
        precond = KFACPreconditioner(model, damping=1e-4, kl_clip=None,
                                     precondition_dtype="bfloat16", prediv_eigenvalues=prediv)
        x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
        nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 0])).backward()
        precond.step()
        kept[prediv] = {layer.name: [layer.state.side_dtype(s)  # type: ignore[union-attr]
                                     for s in SIDES] for layer in precond.layers}
        written[prediv] = model[3].weight.grad
    assert kept[True] == kept[False]
    assert torch.float32 in kept[True]["3"] and torch.bfloat16 in kept[True]["0"]
    assert relative(written[True], written[False]) < 2**-6
