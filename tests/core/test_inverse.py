"""Preconditioned gradients equal dense float64 formulas (explicit Kronecker products, inv)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from core import KFACPreconditioner
from core import inverse as inverse_module
from core.config import ConfigError
from core.inverse import (
    RESCALE_EXPONENT,
    CholeskyState,
    DecompositionError,
    PredividedEigenState,
    _damped,
    all_finite,
    damped_cholesky,
    damped_inverse,
    eigen_decompose,
    factor_shifts,
    inverse_in_place,
    kl_clip_scale,
    pi_split,
)
from tests.core.reference import dense_eigen_precondition, dense_inverse_precondition


def one_step(model: nn.Module, x: torch.Tensor, **options):  # type: ignore[no-untyped-def]
    """Run one step; return (preconditioner, raw grads per layer, preconditioned grads)."""
    precond = KFACPreconditioner(model, factor_dtype="float64", inverse_dtype="float64",
                                 **options)
    model.zero_grad()
    model(x).pow(2).mean().backward()
    raw = {layer.name: layer.helper.grad_matrix().clone() for layer in precond.layers}
    precond.step()
    new = {layer.name: layer.helper.grad_matrix() for layer in precond.layers}
    return precond, raw, new


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(3, 4, 2, dilation=2, bias=False), nn.ReLU(), nn.Flatten(),
        nn.Linear(4, 3),
    ).double()


def test_eigen_equals_inverse_of_kronecker_plus_damping() -> None:
    torch.manual_seed(0)
    model = small_cnn()
    damping = 0.05
    precond, raw, new = one_step(model, torch.randn(5, 2, 6, 6, dtype=torch.float64),
                                 damping=damping, inverse_method="eigen", kl_clip=None)
    for layer in precond.layers:
        expected = dense_eigen_precondition(raw[layer.name], layer.a.value, layer.g.value,
                                            damping)
        torch.testing.assert_close(new[layer.name], expected)


def test_predivided_eigenvalues_give_the_eigen_product_from_the_damped_ratios() -> None:
    """KAISA's pre-divided eigenvalues: the same ``P`` as ``eigen``, from a state of both
    eigenbases and ``1/(d_G d_Aᵀ + λ)`` (no eigenvalue vectors), closed form in float64."""
    torch.manual_seed(0)
    damping = 0.05
    precond, raw, new = one_step(small_cnn(), torch.randn(5, 2, 6, 6, dtype=torch.float64),
                                 damping=damping, inverse_method="eigen",
                                 prediv_eigenvalues=True, kl_clip=None)
    for layer in precond.layers:
        state = layer.state
        assert isinstance(state, PredividedEigenState)
        a, g = layer.a.value, layer.g.value
        da, dg = (torch.linalg.eigvalsh(f).clamp_min(0) for f in (a, g))
        torch.testing.assert_close(state.dgda, 1 / (torch.outer(dg, da) + damping))
        assert [tuple(t.shape) for t in state.side_tensors("a")] == [(layer.a_dim,) * 2]
        assert [tuple(t.shape) for t in state.side_tensors("g")] == [
            (layer.g_dim,) * 2, (layer.g_dim, layer.a_dim)]
        torch.testing.assert_close(
            new[layer.name], dense_eigen_precondition(raw[layer.name], a, g, damping))


def test_predivided_eigenvalues_keep_the_damping_of_their_inversion() -> None:
    """A damping scheduled to change between inversions reaches ``eigen``'s product at once
    and the pre-divided one at the next inversion (as in KAISA)."""
    torch.manual_seed(1)
    x = [torch.randn(5, 2, 6, 6, dtype=torch.float64) for _ in range(2)]
    dampings = {0: 0.05, 1: 0.5}
    written = {}
    for prediv in (False, True):
        model = small_cnn()
        precond = KFACPreconditioner(model, factor_dtype="float64", inverse_dtype="float64",
                                     damping=lambda step: dampings[step], kl_clip=None,
                                     factor_update_steps=10, inv_update_steps=10,
                                     prediv_eigenvalues=prediv)
        for batch in x:
            model.zero_grad()
            model(batch).pow(2).mean().backward()
            raw = {layer.name: layer.helper.grad_matrix().clone() for layer in precond.layers}
            precond.step()
        written[prediv] = {layer.name: layer.helper.grad_matrix() for layer in precond.layers}
        for layer in precond.layers:
            damping = dampings[0] if prediv else dampings[1]
            torch.testing.assert_close(written[prediv][layer.name], dense_eigen_precondition(
                raw[layer.name], layer.a.value, layer.g.value, damping))
    assert not torch.allclose(written[False]["0"], written[True]["0"])


def test_predivided_eigenvalues_hold_the_ratios_instead_of_the_eigenvalues() -> None:
    """State bytes: ``a² + g² + a·g`` per layer instead of ``a² + g² + a + g``."""
    torch.manual_seed(2)
    x = torch.randn(4, 2, 6, 6)
    usage = {}
    for prediv in (False, True):
        model = small_cnn().float()
        precond = KFACPreconditioner(model, prediv_eigenvalues=prediv)
        model(x).pow(2).mean().backward()
        precond.step()
        usage[prediv] = precond.memory_usage()["inverses"]
        dims = [(layer.a_dim, layer.g_dim) for layer in precond.layers]
    assert usage[False] == 4 * sum(a * a + g * g + a + g for a, g in dims)
    assert usage[True] == 4 * sum(a * a + g * g + a * g for a, g in dims)


def test_predivided_eigenvalues_need_eigen_and_colocated_factors() -> None:
    with pytest.raises(ConfigError, match="prediv_eigenvalues.*only 'eigen'"):
        KFACPreconditioner(small_cnn(), inverse_method="inverse", prediv_eigenvalues=True)
    with pytest.raises(ConfigError, match="colocate_factors.*both factors' eigenvalues"):
        KFACPreconditioner(small_cnn(), prediv_eigenvalues=True, colocate_factors=False)
    with pytest.raises(ConfigError, match="prediv_eigenvalues"):
        KFACPreconditioner(small_cnn(), prediv_eigenvalues="yes")


@pytest.mark.parametrize("method", ["inverse", "cholesky", "cholesky_solve"])
@pytest.mark.parametrize("split", ["full", "pi"])
def test_inverse_methods_match_dense_formula(method: str, split: str) -> None:
    torch.manual_seed(1)
    model = small_cnn()
    damping = 0.01
    precond, raw, new = one_step(model, torch.randn(4, 2, 6, 6, dtype=torch.float64),
                                 damping=damping, inverse_method=method, damping_split=split,
                                 kl_clip=None)
    for layer in precond.layers:
        a, g = layer.a.value, layer.g.value
        if split == "full":
            shift_a = shift_g = damping
        else:
            pi = math.sqrt((torch.trace(a) / a.shape[0]) / (torch.trace(g) / g.shape[0]))
            shift_a, shift_g = pi * math.sqrt(damping), math.sqrt(damping) / pi
        expected = dense_inverse_precondition(raw[layer.name], a, g, shift_a, shift_g)
        torch.testing.assert_close(new[layer.name], expected)


def test_pi_split_formula() -> None:
    a = torch.diag(torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64))
    g = torch.diag(torch.tensor([1.0, 0.5], dtype=torch.float64))
    assert pi_split(a, g) == pytest.approx(math.sqrt((6 / 3) / (1.5 / 2)))


def test_pi_split_falls_back_to_an_even_split_for_a_degenerate_factor() -> None:
    """A layer whose output gradient is all zero (or a factor without a positive trace) has
    no trace ratio: π = 1, so each side gets √λ, as under the even split."""
    a = torch.diag(torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64))
    zeros = torch.zeros(2, 2, dtype=torch.float64)
    tiny = torch.full((2, 2), 1e-320, dtype=torch.float64)  # a ratio that overflows
    for left, right in ((a, zeros), (zeros, a), (-a, a), (a, tiny)):
        assert pi_split(left, right) == 1.0
    assert factor_shifts(a, zeros, 0.04, "pi") == pytest.approx((0.2, 0.2))
    assert factor_shifts(a, zeros, 0.04, "full") == (0.04, 0.04)


def test_kl_clip_matches_formula() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    lr, kappa, damping = 0.3, 1e-4, 0.1
    precond, raw, unclipped = one_step(model, torch.randn(8, 6, dtype=torch.float64),
                                       damping=damping, kl_clip=None)
    unclipped = {k: v.clone() for k, v in unclipped.items()}
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    _, _, clipped = one_step(model, torch.randn(8, 6, dtype=torch.float64), damping=damping,
                             kl_clip=kappa, lr=lr)
    vg = sum(float((unclipped[k] * raw[k]).sum()) for k in raw) * lr**2
    nu = min(1.0, math.sqrt(kappa / abs(vg)))
    assert nu < 1.0, "test must exercise the clipping branch"
    for name in raw:
        torch.testing.assert_close(clipped[name], nu * unclipped[name])
    assert kl_clip_scale(0.0, lr, kappa) == 1.0


def test_bias_is_written_back_as_last_column() -> None:
    torch.manual_seed(3)
    model = nn.Linear(3, 2).double()
    precond, raw, new = one_step(model, torch.randn(5, 3, dtype=torch.float64), kl_clip=None)
    name = precond.layers[0].name
    torch.testing.assert_close(model.weight.grad, new[name][:, :3])
    torch.testing.assert_close(model.bias.grad, new[name][:, 3])
    assert not torch.allclose(model.bias.grad, raw[name][:, 3])


def test_eigen_decompose_retries_in_fp64(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_eigh = torch.linalg.eigh

    def flaky_eigh(m: torch.Tensor):  # type: ignore[no-untyped-def]
        calls.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("simulated failure to converge")
        return real_eigh(m)

    monkeypatch.setattr(torch.linalg, "eigh", flaky_eigh)
    q, d = eigen_decompose(torch.eye(3) * 2, torch.float32)
    assert calls == [torch.float32, torch.float64]
    assert q.dtype == torch.float32
    torch.testing.assert_close(d, torch.full((3,), 2.0))


@pytest.fixture(params=["in-place", "out-of-place"])
def inversion_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both paths of :func:`damped_inverse`: the CPU's in-place LAPACK one and the
    out-of-place one other devices take."""
    monkeypatch.setattr("core.inverse.HOST_IN_PLACE", request.param == "in-place")
    return str(request.param)


def test_cholesky_of_indefinite_factor_raises_decomposition_error(inversion_path: str) -> None:
    indefinite = torch.diag(torch.tensor([1.0, -5.0]))
    with pytest.raises(DecompositionError, match="cholesky"):
        damped_inverse(indefinite, 0.1, "cholesky", torch.float32)
    with pytest.raises(DecompositionError, match="non-finite"):
        damped_inverse(torch.full((2, 2), float("nan")), 0.1, "inverse", torch.float32)
    with pytest.raises(DecompositionError, match="eigh failed: the factor has non-finite"):
        eigen_decompose(torch.full((2, 2), float("nan")), torch.float32)


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_inverse_method_falls_back_to_lu_when_not_positive_definite(layout: str,
                                                                    inversion_path: str) -> None:
    indefinite = torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.5], [0.0, 0.5, 3.0]],
                              dtype=torch.float64)
    if layout == "column-major":
        indefinite = indefinite.T.contiguous().T
    inv = damped_inverse(indefinite, 0.1, "inverse", torch.float64)
    expected = torch.linalg.inv(indefinite + 0.1 * torch.eye(3, dtype=torch.float64))
    torch.testing.assert_close(inv, (expected + expected.T) / 2)
    assert torch.equal(inv, inv.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inverse_in_place_overwrites_the_matrix_with_its_inverse(dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    x = torch.randn(30, 12, dtype=torch.float64)
    spd = x.T @ x / 30 + 0.1 * torch.eye(12, dtype=torch.float64)
    matrix = spd.to(dtype, copy=True)
    address = matrix.data_ptr()
    assert inverse_in_place(matrix) == 0 and matrix.data_ptr() == address
    assert torch.equal(matrix, matrix.T)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(matrix.double(), torch.linalg.inv(spd), **tolerance)
    assert inverse_in_place(torch.diag(torch.tensor([2.0, -1.0, 3.0]))) == 2


def test_factor_inverses_are_exactly_symmetric(inversion_path: str) -> None:
    torch.manual_seed(5)
    x = torch.randn(50, 40, dtype=torch.float64)
    factor = x.T @ x / 50
    for method in ("inverse", "cholesky"):
        inv = damped_inverse(factor, 1e-2, method, torch.float32)
        assert torch.equal(inv, inv.T)
        expected = torch.linalg.inv(factor + 1e-2 * torch.eye(40, dtype=torch.float64))
        torch.testing.assert_close(inv.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["cholesky", "cholesky_solve"])
def test_failed_decomposition_keeps_last_good_inverse(method: str) -> None:
    torch.manual_seed(4)
    model = nn.Linear(3, 2).double()
    # factors only at step 0, inverses every step: step 1 re-inverts the (broken) factor
    precond = KFACPreconditioner(model, inverse_method=method, kl_clip=None,
                                 factor_dtype="float64",
                                 factor_update_steps=lambda step: 1 if step == 0 else 1000)
    x = torch.randn(6, 3, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    precond.step()
    layer = precond.layers[0]
    good = [t.clone() for t in layer.state.tensors()]
    layer.a.value = torch.diag(torch.tensor([1.0, -5.0, 1.0, 1.0], dtype=torch.float64))
    model.zero_grad()
    model(x).pow(2).mean().backward()
    with pytest.warns(UserWarning, match="keeping the last good inverse"):
        precond.step()
    assert layer.decomposition_failures == 1
    for kept, before in zip(layer.state.tensors(), good, strict=True):
        torch.testing.assert_close(kept, before)
    assert precond.metrics()["decomposition_failures"] == 1


def test_cholesky_solve_matches_cholesky_in_fp32_over_steps() -> None:
    """Triangular solves with the factors give the formed inverses' result to fp32 accuracy,
    through the preconditioner, with stale states (inverses every 2 steps) and the KL clip."""
    torch.manual_seed(6)
    batches = [torch.randn(16, 2, 6, 6) for _ in range(4)]
    grads = {}
    for method in ("cholesky", "cholesky_solve"):
        torch.manual_seed(7)
        model = small_cnn().float()
        precond = KFACPreconditioner(model, inverse_method=method, damping_split="pi",
                                     damping=1e-2, inv_update_steps=2, kl_clip=1e-2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads[method] = []
        for x in batches:
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            precond.step()
            grads[method].append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
        assert isinstance(precond.layers[0].state, CholeskyState) == (method == "cholesky_solve")
    for solved, formed in zip(grads["cholesky_solve"], grads["cholesky"], strict=True):
        for got, expected in zip(solved, formed, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


def test_damped_cholesky_is_the_lower_factor_and_not_symmetric_state() -> None:
    torch.manual_seed(8)
    x = torch.randn(30, 12, dtype=torch.float64)
    factor = x.T @ x / 30
    chol = damped_cholesky(factor, 0.1, torch.float64)
    assert chol.is_contiguous() and torch.equal(chol, chol.tril())
    eye = torch.eye(12, dtype=torch.float64)
    torch.testing.assert_close(chol, torch.linalg.cholesky(factor + 0.1 * eye))
    assert not CholeskyState.symmetric  # must never travel as a symmetric upper triangle


@pytest.mark.parametrize(("g_dim", "a_dim"), [(5, 7), (9, 70), (70, 9), (80, 66)])
@pytest.mark.parametrize(("a_dtype", "g_dtype"), [(torch.float64, torch.float64),
                                                   (torch.float64, torch.float32),
                                                   (torch.float32, torch.float64)])
@pytest.mark.parametrize("transposed_from_rows", [8, None])
def test_cholesky_solves_equal_the_dense_product_and_come_out_row_major(
        g_dim: int, a_dim: int, a_dtype: torch.dtype, g_dtype: torch.dtype,
        transposed_from_rows: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever way the four triangular solves run (in place from the right, or ``A``'s side
    on a transposed copy from the left when ``G`` is wide, a choice that follows the CPU and is
    forced both ways here), and in either order (a wider ``A`` state goes first)."""
    monkeypatch.setattr(inverse_module, "TRANSPOSED_SOLVE_MIN_ROWS", transposed_from_rows)
    gen = torch.Generator().manual_seed(g_dim * a_dim)
    xa, xg = (torch.randn(n, 2 * n, generator=gen, dtype=torch.float64) for n in (a_dim, g_dim))
    a, g, damping = xa @ xa.T / (2 * a_dim), xg @ xg.T / (2 * g_dim), 0.1
    grad = torch.randn(g_dim, a_dim, generator=gen, dtype=torch.float64)
    state = CholeskyState(damped_cholesky(a, damping, a_dtype),
                          damped_cholesky(g, damping, g_dtype))
    p = inverse_module.precondition(grad, state, damping)
    assert p.is_contiguous() and p.shape == (g_dim, a_dim)
    tolerance = ({} if a_dtype == g_dtype == torch.float64
                 else {"rtol": 1e-4, "atol": 1e-5})
    torch.testing.assert_close(p.double(), dense_inverse_precondition(grad, a, g, damping, damping),
                               **tolerance)


def test_cholesky_solve_of_fp32_defeating_factor_retries_in_fp64() -> None:
    """A rank-one factor of 1e4 entries defeats an fp32 Cholesky; the fp64 factor is kept."""
    factor = torch.full((5, 5), 1e4)
    damped = factor + 1e-4 * torch.eye(5)
    assert int(torch.linalg.cholesky_ex(damped)[1]) != 0, "must defeat an fp32 Cholesky"
    chol = damped_cholesky(factor, 1e-4, torch.float32)
    expected = torch.linalg.cholesky(factor.double() + 1e-4 * torch.eye(5, dtype=torch.float64))
    assert chol.dtype == torch.float32
    torch.testing.assert_close(chol, expected.float())


def test_cholesky_solve_failures_raise_decomposition_error() -> None:
    """No LU fallback: indefinite in fp64 too is a failure; so are non-finite factors and a
    damped inverse beyond fp32 (``A = 0`` with a damping of 1e-40: ``1/L_ii² = 1e40``)."""
    with pytest.raises(DecompositionError, match="cholesky_solve failed.*float64: matrix not "
                                                 "positive definite"):
        damped_cholesky(torch.diag(torch.tensor([1.0, -5.0])), 0.1, torch.float32)
    with pytest.raises(DecompositionError, match="non-finite"):
        damped_cholesky(torch.full((2, 2), float("nan")), 0.1, torch.float32)
    with pytest.raises(DecompositionError, match="exceeds torch.float32's range"):
        damped_cholesky(torch.zeros(3, 3), 1e-40, torch.float32)


# States kept in bf16 (precondition_dtype) ---------------------------------------------------
#: bf16's unit roundoff (8 significant bits).
BF16_U = 2.0**-8


@pytest.mark.parametrize("method", ["inverse", "cholesky", "eigen", "eigen_prediv"])
def test_bf16_state_stays_within_the_rounding_bound_of_the_dense_formula(method: str) -> None:
    """Each rounding (gradient, state entries, each product's output) moves an entry by at
    most ``u`` relative, so ``|P̂ − P|`` is at most a few ``u`` times the product of the
    absolute values: the bound that also says when the error is large (cancellation, as in
    a rank-deficient factor under small damping)."""
    torch.manual_seed(1)
    model = small_cnn()
    damping = 0.01
    precond, raw, new = one_step(model, torch.randn(4, 2, 6, 6, dtype=torch.float64),
                                 damping=damping, inverse_method=method.split("_")[0],
                                 prediv_eigenvalues=method == "eigen_prediv", kl_clip=None,
                                 precondition_dtype="bfloat16",
                                 precondition_dtype_tolerance=None)
    for layer in precond.layers:
        assert layer.state.kind == method.replace("cholesky", "inverse")
        assert all(t.dtype == torch.bfloat16 for t in layer.state.tensors())
        assert new[layer.name].dtype == torch.float64
        a, g, grad = layer.a.value, layer.g.value, raw[layer.name]
        if method.startswith("eigen"):
            da, qa = torch.linalg.eigh(a)
            dg, qg = torch.linalg.eigh(g)
            scale = torch.outer(dg.clamp_min(0), da.clamp_min(0)) + damping
            expected = dense_eigen_precondition(grad, a, g, damping)
            magnitude = qg.abs() @ ((qg.abs().T @ grad.abs() @ qa.abs()) / scale) @ qa.abs().T
            rounding = 10 * BF16_U
        else:
            expected = dense_inverse_precondition(grad, a, g, damping, damping)
            eye_a, eye_g = torch.eye(a.shape[0]), torch.eye(g.shape[0])
            ia = torch.linalg.inv(a + damping * eye_a.double()).abs()
            ig = torch.linalg.inv(g + damping * eye_g.double()).abs()
            magnitude = ig @ grad.abs() @ ia
            rounding = 6 * BF16_U
        error = (new[layer.name] - expected).abs()
        assert bool((error <= rounding * magnitude + 1e-12).all()), layer.name
        assert float(error.max()) > 0  # rounded to bf16, not computed in fp64


def test_bf16_state_halves_the_state_memory_of_fp32() -> None:
    torch.manual_seed(2)
    x = torch.randn(4, 2, 6, 6)
    usage = {}
    for dtype in ("float32", "bfloat16"):
        model = small_cnn().float()
        precond = KFACPreconditioner(model, inverse_method="inverse", precondition_dtype=dtype,
                                     precondition_dtype_tolerance=None)
        model(x).pow(2).mean().backward()
        precond.step()
        usage[dtype] = precond.memory_usage()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert usage["bfloat16"]["inverses"] * 2 == usage["float32"]["inverses"] > 0
    assert usage["bfloat16"]["factors"] == usage["float32"]["factors"]


def test_bf16_state_rejects_cholesky_solve_and_unknown_dtypes() -> None:
    with pytest.raises(ConfigError, match="precondition_dtype.*triangular solves"):
        KFACPreconditioner(small_cnn(), inverse_method="cholesky_solve",
                           precondition_dtype="bfloat16")
    with pytest.raises(ConfigError, match="precondition_dtype"):
        KFACPreconditioner(small_cnn(), precondition_dtype="float16")


def test_a_checkpoint_loads_into_another_precondition_dtype() -> None:
    """A run may switch its state dtype on resume: the saved state is converted."""
    torch.manual_seed(3)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    model = small_cnn()
    saved = KFACPreconditioner(model, inverse_method="inverse")
    model(x).pow(2).mean().backward()
    saved.step()
    loaded = KFACPreconditioner(small_cnn(), inverse_method="inverse",
                                precondition_dtype="bfloat16")
    loaded.load_state_dict(saved.state_dict())
    for before, after in zip(saved.layers, loaded.layers, strict=True):
        for a, b in zip(before.state.tensors(), after.state.tensors(), strict=True):
            assert b.dtype == torch.bfloat16
            torch.testing.assert_close(b, a.to(torch.bfloat16), rtol=0, atol=0)


def test_a_loaded_checkpoint_is_copied_onto_the_layers_dtype() -> None:
    """Loading copies: the steps after it, which update factors and state in place, leave the
    caller's checkpoint as it was; factors saved in fp32 load into an fp64 run in fp64; a
    state of another shape is refused, naming the layer."""
    torch.manual_seed(4)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    model = small_cnn()
    saved = KFACPreconditioner(model.float(), inverse_method="inverse", factor_dtype="float32",
                               inverse_dtype="float32")
    model(x.float()).pow(2).mean().backward()
    saved.step()
    checkpoint = saved.state_dict()
    kept = copy.deepcopy(checkpoint)
    model = model.double()
    loaded = KFACPreconditioner(model, inverse_method="inverse", factor_dtype="float64",
                                inverse_dtype="float64")
    loaded.load_state_dict(checkpoint)
    assert all(layer.a.value.dtype == torch.float64 for layer in loaded.layers)
    for _ in range(2):
        model.zero_grad()
        model(x).pow(2).mean().backward()
        loaded.step()
    for name, layer_state in checkpoint["layers"].items():
        for key in ("A", "G"):
            assert torch.equal(layer_state[key], kept["layers"][name][key])
        for now, then in zip(layer_state["state"], kept["layers"][name]["state"], strict=True):
            assert torch.equal(now, then)
    layer = loaded.layers[0]
    wrong = layer.state_dict()
    wrong["state"] = [t[:-1, :-1] for t in wrong["state"]]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=f"{layer.name}: saved inverse state has shapes"):
        layer.load_state_dict(wrong)
    wrong = dict(layer.state_dict(), A=torch.eye(layer.a_dim + 1, dtype=torch.float64),
                 state_kind=None, state=None)  # factors saved before the first inversion
    with pytest.raises(ValueError, match=f"{layer.name}: saved factor A has shape"):
        layer.load_state_dict(wrong)


@pytest.mark.parametrize("exponent", [-47, -24, 0, 30])
def test_damped_decompositions_hold_at_any_factor_scale(exponent: int,
                                                        inversion_path: str) -> None:
    """A factor far from unit scale (an attention key's output gradients sit near 2⁻⁴⁷) is
    decomposed scaled by an exact power of two: the results match the float64 formulas at
    every scale, and only factors beyond 2^±RESCALE_EXPONENT are scaled."""
    torch.manual_seed(9)
    x = torch.randn(40, 24, dtype=torch.float64)
    scale = 2.0**exponent
    factor, shift = x.T @ x / 40 * scale, 1e-2 * scale
    damped = factor + shift * torch.eye(24, dtype=torch.float64)
    for method in ("inverse", "cholesky"):
        inv = damped_inverse(factor, shift, method, torch.float32)
        torch.testing.assert_close(inv.double() * scale, torch.linalg.inv(damped) * scale,
                                   rtol=1e-4, atol=1e-4)
    chol = damped_cholesky(factor, shift, torch.float32)
    torch.testing.assert_close(chol.double() / math.sqrt(scale),
                               torch.linalg.cholesky(damped) / math.sqrt(scale),
                               rtol=1e-4, atol=1e-5)
    matrix, applied = _damped(factor.float(), shift)
    assert applied % 2 == 0
    assert applied == (0 if abs(exponent) <= RESCALE_EXPONENT else
                       2 * round(math.log2(float(damped.diagonal().mean())) / 2))
    assert float(matrix.diagonal().mean()) == pytest.approx(
        float(damped.diagonal().mean()) * 2.0**-applied, rel=1e-5)


@pytest.mark.parametrize("method", ["inverse", "cholesky", "cholesky_solve"])
def test_a_factor_below_the_normal_range_fails_as_a_decomposition(method: str) -> None:
    """A float64 factor whose damped mean diagonal lies below 2⁻¹⁰²² (a damping the config
    accepts, > 0) raised Python's OverflowError from the rescaling's 2⁻ᵉ, which escaped the
    layer's keep-the-last-inverse handling; its inverse is beyond float64's range: a failed
    decomposition. Scales as far as the dtype allows are exact and still taken."""
    factor = 1e-310 * (torch.ones(3, 3, dtype=torch.float64) + torch.eye(3, dtype=torch.float64))
    with pytest.raises(DecompositionError, match=method):
        if method == "cholesky_solve":
            damped_cholesky(factor, 1e-312, torch.float64)
        else:
            damped_inverse(factor, 1e-312, method, torch.float64)
    matrix, applied = _damped(factor, 1e-312)
    assert applied == -1022
    torch.testing.assert_close(matrix, (factor + 1e-312 * torch.eye(3, dtype=torch.float64))
                               * 2.0**1022, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 7, -1])
def test_all_finite_finds_one_non_finite_entry_anywhere(bad: float, where: int) -> None:
    fine = torch.randn(9, 9, dtype=torch.float64).float()
    spoiled = fine.clone()
    spoiled.view(-1)[where] = bad
    assert all_finite([fine]) and all_finite([fine, fine.bfloat16()])
    assert not all_finite([spoiled])
    assert not all_finite([fine, spoiled.bfloat16()])  # in any tensor of the list


def test_all_finite_tells_an_overflowing_sum_of_finite_entries_from_non_finite_ones() -> None:
    huge = torch.full((4, 4), 3e38)  # finite, but their sum overflows float32
    assert all_finite([huge]) and all_finite([huge, -huge])
    mixed = huge.clone()
    mixed[0, 0], mixed[1, 1] = math.inf, -math.inf  # sums to NaN
    assert not all_finite([mixed])
    assert all_finite([]) and all_finite([torch.empty(0)])


def test_all_finite_decides_from_given_reductions_and_checks_entries_when_they_overflow(
        ) -> None:
    """Reductions the caller took (squared norms) decide without a pass of its own; where
    they overflow, the entries themselves are checked."""
    fine = torch.randn(5, 5)
    spoiled = fine.clone()
    spoiled[2, 3] = math.nan
    squared = [torch.dot(t.reshape(-1), t.reshape(-1)) for t in (fine, spoiled)]
    assert all_finite([fine], squared[:1])
    assert not all_finite([fine, spoiled], squared)
    assert all_finite([spoiled], [torch.tensor(1.0)])  # the caller's finite reduction decides
    huge = torch.full((4, 4), 1e30)  # finite; its squares overflow float32
    huge_squared = torch.dot(huge.reshape(-1), huge.reshape(-1))
    assert not math.isfinite(float(huge_squared))
    assert all_finite([huge], [huge_squared])
    huge[0, 0] = math.inf
    assert not all_finite([huge], [huge_squared])


@pytest.mark.parametrize("kl_clip", [1e-3, None])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_layer_whose_preconditioned_gradient_is_not_finite_stays_first_order(
        kl_clip: float | None, bad: float) -> None:
    """A state that yields a non-finite ``P`` leaves that layer's raw gradient in place for
    the step, with a warning and a count; the other layers are preconditioned as before."""
    results = {}
    for broken in (False, True):
        torch.manual_seed(5)
        x = torch.randn(6, 2, 6, 6)
        model = small_cnn().float()
        precond = KFACPreconditioner(model, inverse_method="inverse", inv_update_steps=10,
                                     factor_update_steps=10, kl_clip=kl_clip, lr=0.1)
        for step in range(2):
            model.zero_grad()
            model(x + step).pow(2).mean().backward()
            if step == 1 and broken:  # the state the first step computed, overflowed
                precond.layers[-1].state.side_tensors("a")[0][0, 0] = bad
            raw = {layer.name: layer.helper.grad_matrix().clone() for layer in precond.layers}
            if step == 1 and broken:
                with pytest.warns(UserWarning, match="non-finite preconditioned gradient in 5"):
                    precond.step()
            else:
                precond.step()
        results[broken] = ({layer.name: layer.helper.grad_matrix() for layer in precond.layers},
                           raw, precond.metrics()["nonfinite_preconditioned"])
    (fine, _, none), (grads, raw, count) = results[False], results[True]
    last = "5"
    assert none == 0 and count == 1
    torch.testing.assert_close(grads[last], raw[last], rtol=0, atol=0)
    assert not torch.equal(fine[last], raw[last])  # it would have been preconditioned
    others = [name for name in grads if name != last]
    if kl_clip is None:  # with the clip, the scale now sums over the other layers only
        for name in others:
            torch.testing.assert_close(grads[name], fine[name])
    assert all(not torch.equal(grads[name], raw[name]) for name in others)


def test_a_kl_product_that_overflows_leaves_its_layer_first_order() -> None:
    """A finite ``P`` whose ``Σ P ⊙ ∇W̄`` overflows could not be scaled by the KL clip: it is
    left out like a non-finite one; without the clip, a finite ``P`` whose plain sum overflows
    is kept."""
    model = small_cnn().float()
    precond = KFACPreconditioner(model)
    huge = torch.full((3, 5), 3e38)
    preconditioned = {"0": torch.ones(3, 19), "5": huge}
    products = {"0": torch.tensor(1.0), "5": torch.tensor(math.inf)}
    with pytest.warns(UserWarning, match="in 5;"):
        precond._leave_nonfinite_first_order(preconditioned, products)
    assert list(preconditioned) == list(products) == ["0"]
    preconditioned = {"0": torch.ones(3, 19), "5": huge}
    precond._leave_nonfinite_first_order(preconditioned, None)  # sums to inf, all finite
    assert list(preconditioned) == ["0", "5"] and precond.nonfinite_preconditioned == 1


@pytest.mark.parametrize("host", [True, False])
def test_an_inverse_that_fails_in_fp32_is_retried_by_cholesky_in_fp64_not_lu(
        host: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damped rank-deficient fp32 factor whose fp32 Cholesky fails: method "inverse" took an
    fp32 LU inverse of the same rounded matrix, finite and off by 230% (so the fp64 retry
    never ran); it now gets fp64's Cholesky, as "cholesky" does."""
    monkeypatch.setattr(inverse_module, "HOST_IN_PLACE", host)
    torch.manual_seed(0)
    x = torch.randn(31, 10, dtype=torch.float64)
    factor = (x @ x.T).float()  # positive semi-definite, rank 10
    shift = 1e-6
    dense = torch.linalg.inv(factor.double() + shift * torch.eye(31, dtype=torch.float64))
    for method in ("cholesky", "inverse"):
        got = damped_inverse(factor, shift, method, torch.float32).double()
        assert ((got - dense).norm() / dense.norm()).item() < 1e-4, method


def test_the_kl_clip_of_an_overflowing_product_is_zero_not_one() -> None:
    """``|Σ P ⊙ ∇W̄|·lr²`` overflowing (or infinite) meant "no clip"; its limit is 0."""
    assert kl_clip_scale(1e300, 1e10, 1e-3) == pytest.approx(math.sqrt(1e-3) / 1e160)
    assert kl_clip_scale(math.inf, 0.1, 1e-3) == 0.0
    assert kl_clip_scale(0.0, 0.1, 1e-3) == 1.0 and kl_clip_scale(4.0, 0.0, 1e-3) == 1.0
    assert kl_clip_scale(4.0, 0.5, 0.25) == pytest.approx(0.5)
    assert kl_clip_scale(1e-300, 1e-200, 1e-3) == 1.0  # the denominator underflows to 0


def test_the_kl_clip_never_enlarges_a_step() -> None:
    """``sqrt(κ) / (lr·sqrt|Σ|)`` above 1 (a small step) leaves the step as it is."""
    assert kl_clip_scale(1e-4, 0.1, 1e-3) == 1.0
    assert kl_clip_scale(-1e-4, 0.1, 1e-3) == 1.0
    assert kl_clip_scale(math.nan, 0.1, 1e-3) == 1.0


def test_a_factor_with_thousands_of_zero_rows_is_decomposed() -> None:
    """The ``A`` of a 3x3 convolution over 1x1-pixel inputs: only the centre tap of each of 256
    channels is ever non-zero, so 2,048 of its 2,304 rows are zero, and LAPACK's divide and
    conquer failed to converge on it in fp32 and in fp64 (the layer was left first-order). The
    damped inverse from the eigenbasis equals the float64 dense one."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1), dtype=torch.float64).abs()
    centre = torch.arange(256) * 9 + 4
    factor = torch.zeros(2304, 2304, dtype=torch.float64)
    factor[centre.unsqueeze(1), centre] = x.T @ x / 4
    q, d = eigen_decompose(factor.float(), torch.float32)
    assert bool((d[1:] >= d[:-1]).all())
    damping = 1e-2
    expected = torch.linalg.inv(factor + damping * torch.eye(2304, dtype=torch.float64))
    got = (q.double() / (d.double() + damping)) @ q.double().T
    assert float((got - expected).norm() / expected.norm()) < 1e-3  # fp32: 1.4e-4


def test_an_all_zero_factor_has_the_identity_as_eigenbasis() -> None:
    q, d = eigen_decompose(torch.zeros(5, 5), torch.float32)
    assert torch.equal(q, torch.eye(5)) and torch.equal(d, torch.zeros(5))
