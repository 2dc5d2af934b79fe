"""Eva: closed form against the dense inverse, statistics, running averages and the KL clip."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import ConfigError, EvaPreconditioner, MKORPreconditioner
from core.eva import eva_precondition
from core.layers import helper_for

torch.set_num_threads(1)
F64 = torch.float64


@pytest.mark.parametrize("damping", [1e-3, 0.03, 1.0])
def test_closed_form_equals_the_dense_inverse(damping: float) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, generator=gen, dtype=F64)
    g = torch.randn(3, generator=gen, dtype=F64)
    grad = torch.randn(3, 5, generator=gen, dtype=F64)
    v = torch.kron(g, a)  # vec of the (g_dim, a_dim) matrix g aᵀ, row-major like grad.flatten()
    dense = torch.linalg.inv(torch.outer(v, v) + damping * torch.eye(15, dtype=F64))
    expected = (dense @ grad.flatten()).reshape(3, 5)
    torch.testing.assert_close(eva_precondition(grad, a, g, damping), expected,
                               rtol=1e-10, atol=1e-10)


def _captured(model: nn.Module, x: torch.Tensor, **options: object
              ) -> tuple[EvaPreconditioner, torch.Tensor, torch.Tensor]:
    """One Eva step; returns Eva, the output gradient and the raw gradient matrix."""
    eva = EvaPreconditioner(model, dtype="float64", **options)
    y = model(x)
    y.retain_grad()
    (y.cos().sum(dim=tuple(range(1, y.dim()))) ** 2).mean().backward()
    layer = model[0]
    raw = torch.cat([layer.weight.grad.reshape(layer.weight.shape[0], -1),
                     layer.bias.grad.reshape(-1, 1)], dim=1).clone()
    eva.step()
    return eva, y.grad, raw


def test_statistics_are_plain_means_and_the_step_is_the_clipped_closed_form() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3)).to(F64)
    x = torch.randn(2, 6, 4, dtype=F64)
    damping, kl_clip, lr = 0.05, 1e-3, 0.5
    eva, gy, raw = _captured(model, x, damping=damping, kl_clip=kl_clip, lr=lr)
    layer = eva.layers[0]
    a = torch.cat([x.reshape(12, 4).mean(0), torch.ones(1, dtype=F64)])
    g = gy.reshape(12, 3).mean(0)  # Eva's convention: the plain mean of g
    torch.testing.assert_close(layer.a.value, a)
    torch.testing.assert_close(layer.g.value, g)
    p = eva_precondition(raw, a, g, damping)
    nu = min(1.0, math.sqrt(kl_clip / abs(lr**2 * (p * raw).sum().item())))
    assert eva.last_kl_scale == pytest.approx(nu)
    torch.testing.assert_close(model[0].weight.grad, nu * p[:, :4])
    torch.testing.assert_close(model[0].bias.grad, nu * p[:, 4])


@pytest.mark.parametrize(("model_dtype", "eva_dtype"), [
    (F64, "float64"),  # the gradients themselves, written in place
    (torch.float32, "float64"),  # wider copies; squared norms taken again in float64
    (F64, "float32"),  # narrower copies, written back into the float64 gradients
])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_step_writes_the_clipped_closed_form_whatever_the_gradients_dtype_and_layout(
        model_dtype: torch.dtype, eva_dtype: str, layout: str) -> None:
    """Eva reads the weight and bias gradients apart, in place where it can: the written
    ``.grad`` is the KL-clipped closed form of the joined ``∇W̄`` in every case."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(),
                          nn.Linear(48, 4)).to(model_dtype)
    damping, kl_clip, lr = 0.05, 1e-6, 0.5
    eva = EvaPreconditioner(model, dtype=eva_dtype, damping=damping, kl_clip=kl_clip, lr=lr)
    x = torch.randn(3, 2, 4, 4, dtype=model_dtype)
    for _ in range(2):  # the first step sets the vectors, the second preconditions too
        model.zero_grad()
        (model(x).sin() ** 2).mean().backward()
        if layout == "strided":  # a gradient a hook left non-contiguous
            for p in model.parameters():
                p.grad = torch.stack([p.grad, torch.zeros_like(p.grad)], dim=-1)[..., 0]
        raw = {layer.name: layer.helper.grad_matrix().double().clone() for layer in eva.layers}
        eva.step()
    expected = {layer.name: eva_precondition(raw[layer.name], layer.a.value.double(),
                                             layer.g.value.double(), damping)
                for layer in eva.layers}
    products = sum(float((p * raw[name]).sum()) for name, p in expected.items())
    scale = min(1.0, math.sqrt(kl_clip / abs(lr**2 * products)))
    assert scale < 1.0
    tolerance = 1e-12 if (model_dtype, eva_dtype) == (F64, "float64") else 2e-5
    assert eva.last_kl_scale == pytest.approx(scale, rel=tolerance)
    for layer in eva.layers:
        written = layer.helper.grad_matrix()
        assert written.dtype == model_dtype
        torch.testing.assert_close(written.double(), scale * expected[layer.name],
                                   rtol=tolerance, atol=tolerance * 1e-2)


def test_the_kl_sum_of_a_float32_model_is_taken_in_evas_float64() -> None:
    """A one-example batch makes ``∇W̄ = g aᵀ`` the rank-1 direction itself, so the KL sum
    ``(‖∇W̄‖² − c·s) / λ ≈ n / (n + λ)`` with ``n = ‖ā‖² ‖ḡ‖² ≫ λ`` cancels all but a
    ``λ / n`` part of ``‖∇W̄‖²``: a float32 squared norm (relative error ~1e-7) would move the
    KL scale by ~1e-7 · n / λ, a float64 one by ~1e-16 · n / λ."""
    torch.manual_seed(6)
    model = nn.Linear(40, 30)  # float32
    damping, lr = 10.0, 1.0
    eva = EvaPreconditioner(model, dtype="float64", damping=damping, kl_clip=1e-3, lr=lr,
                            factor_decay=0.0)
    x = 10 * torch.randn(1, 40)
    for _ in range(2):
        model.zero_grad()
        (model(x) ** 2).sum().backward()
        raw = helper_for(model).grad_matrix().double()
        eva.step()
    a, g = eva.layers[0].a.value, eva.layers[0].g.value
    n = float((a @ a) * (g @ g))
    assert n / damping > 1e6
    products = float((eva_precondition(raw, a, g, damping) * raw).sum())
    assert eva.last_kl_scale == pytest.approx(math.sqrt(1e-3 / (lr**2 * products)), rel=1e-8)


def test_a_weight_tied_between_two_layers_gets_the_last_layers_closed_form() -> None:
    """Both layers' sums are taken before either writes, and the shared ``.grad`` is not
    updated twice in place: it ends as the later layer's ``P`` of the raw gradient."""
    torch.manual_seed(7)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second).to(F64)
    damping = 0.1
    eva = EvaPreconditioner(model, dtype="float64", damping=damping, kl_clip=None)
    x = torch.randn(6, 4, dtype=F64)
    for _ in range(2):
        model.zero_grad()
        (model(x).sin() ** 2).mean().backward()
        raw = [layer.helper.grad_matrix().clone() for layer in eva.layers]
        eva.step()
    later = eva.layers[1]
    expected = eva_precondition(raw[1], later.a.value, later.g.value, damping)
    torch.testing.assert_close(first.weight.grad, expected[:, :4], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(second.bias.grad, expected[:, 4], rtol=1e-12, atol=1e-14)


def test_vectors_set_directly_are_used_with_their_norms() -> None:
    """Vectors assigned by hand (not through an update or a checkpoint) still precondition."""
    torch.manual_seed(8)
    model = nn.Linear(3, 2).to(F64)
    eva = EvaPreconditioner(model, dtype="float64", damping=0.2, kl_clip=None,
                            factor_update_steps=1000)
    with pytest.warns(UserWarning, match="no statistics"):
        eva.step()  # step 0 captured nothing: no forward ran
    layer = eva.layers[0]
    layer.a.value = torch.randn(4, dtype=F64)
    layer.g.value = torch.randn(2, dtype=F64)
    F.mse_loss(model(torch.randn(5, 3, dtype=F64)), torch.zeros(5, 2, dtype=F64)).backward()
    raw = layer.helper.grad_matrix().clone()
    eva.step()
    expected = eva_precondition(raw, layer.a.value, layer.g.value, 0.2)
    torch.testing.assert_close(layer.helper.grad_matrix(), expected, rtol=1e-12, atol=1e-14)


def test_conv_statistics_and_running_average() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2)).to(F64)
    decay = 0.3
    eva = EvaPreconditioner(model, dtype="float64", factor_decay=decay, kl_clip=None)
    expected_a = expected_g = None
    for _ in range(3):
        model.zero_grad()
        x = torch.randn(4, 2, 5, 5, dtype=F64)
        y = model(x)
        y.retain_grad()
        (y**2).mean().backward()
        patches = F.unfold(x, 3, padding=1, stride=2).transpose(1, 2)  # (B, L, 18)
        a = torch.cat([patches.mean(dim=(0, 1)), torch.ones(1, dtype=F64)])
        g = y.grad.mean(dim=(0, 2, 3))
        expected_a = a if expected_a is None else decay * expected_a + (1 - decay) * a
        expected_g = g if expected_g is None else decay * expected_g + (1 - decay) * g
        eva.step()
    torch.testing.assert_close(eva.layers[0].a.value, expected_a)
    torch.testing.assert_close(eva.layers[0].g.value, expected_g)


def test_micro_batches_count_as_local_batches_of_their_own() -> None:
    """Under ``accumulation_steps = K`` each micro-batch's ``ḡ`` is the mean for its own mean
    loss (as a rank's is for its local batch): ``K`` times the ``ḡ`` of the same examples in
    one batch, while ``ā`` is the same (module docstring)."""
    torch.manual_seed(4)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    stats = {}
    for k in (1, 2):
        torch.manual_seed(0)
        model = nn.Linear(3, 2, bias=False)
        eva = EvaPreconditioner(model, accumulation_steps=k, factor_decay=0.0)
        for rows in torch.arange(8).chunk(k):
            (F.mse_loss(model(x[rows]), y[rows]) / k).backward()
        eva.step()
        stats[k] = eva.layers[0].a.value, eva.layers[0].g.value
    torch.testing.assert_close(stats[2][0], stats[1][0])
    torch.testing.assert_close(stats[2][1], 2 * stats[1][1])


def test_state_dict_round_trip() -> None:
    torch.manual_seed(3)
    model = nn.Linear(3, 2)
    eva = EvaPreconditioner(model)
    F.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 2)).backward()
    eva.step()
    other = EvaPreconditioner(nn.Linear(3, 2))
    other.load_state_dict(eva.state_dict())
    torch.testing.assert_close(other.layers[0].a.value, eva.layers[0].a.value)
    assert other.steps == 1
    with pytest.raises(ValueError, match="saved vector a has shape"):
        EvaPreconditioner(nn.Linear(3, 2, bias=False)).load_state_dict(eva.state_dict())


@pytest.mark.parametrize("make", [EvaPreconditioner, MKORPreconditioner])
def test_a_resumed_run_keeps_its_counters_and_takes_a_state_saved_in_another_dtype(
        make: type) -> None:
    """The count of skipped non-finite statistics was not saved (a resumed run reported 0),
    and Eva kept a loaded float32 state's vectors in float32 in a float64 run, whose next
    step then failed on the dtypes."""
    torch.manual_seed(4)
    model = nn.Linear(3, 2)
    saver = make(model, dtype="float32")
    F.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 2)).backward()
    saver.step()
    saver.nonfinite_statistics_skips = 2
    wide_model = nn.Linear(3, 2).double()
    resumed = make(wide_model, dtype="float64")
    resumed.load_state_dict(saver.state_dict())
    assert resumed.metrics()["nonfinite_statistics_skips"] == 2
    F.mse_loss(wide_model(torch.randn(4, 3, dtype=torch.float64)),
               torch.randn(4, 2, dtype=torch.float64)).backward()
    resumed.step()
    assert wide_model.weight.grad.dtype == torch.float64
    assert bool(wide_model.weight.grad.isfinite().all())


@pytest.mark.parametrize(("options", "field"), [
    ({"damping": 0.0}, "damping"),
    ({"factor_decay": 1.0}, "factor_decay"),
    ({"kl_clip": -1.0}, "kl_clip"),
    ({"factor_update_steps": 0}, "factor_update_steps"),
    ({"stat_decay": 0.9}, "stat_decay"),
])
def test_config_errors_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        EvaPreconditioner(nn.Linear(2, 2), **options)
    assert err.value.field_name == field


def test_metrics_report_the_damping_the_last_step_used() -> None:
    """With a scheduled damping the logged value is the one the step just taken used (it was
    the next step's, beside that step's KL scale)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 3)).to(F64)
    eva = EvaPreconditioner(model, dtype="float64", damping=lambda step: 0.1 / (step + 1))
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(5, 4, dtype=F64)).square().sum().backward()
        eva.step()
    assert eva.metrics()["damping"] == pytest.approx(0.05)


def test_a_closed_form_beyond_float32_leaves_the_layer_first_order_counted() -> None:
    """Finite gradients of about 1e20 (a diverging step, a loss scaled up) overflow
    ``‖ā‖²‖ḡ‖²`` in float32: the coefficient came out NaN (or 0, dropping the rank-1 term),
    the KL sum NaN, its clip off, and NaN was written into every ``.grad``, nothing counted.
    Such a layer now keeps its raw gradient, with a warning and a count; the step after is
    preconditioned again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    eva = EvaPreconditioner(model)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    for scale in (1.0, 1e21, 1.0):
        model.zero_grad()
        (F.mse_loss(model(x), y) * scale).backward()
        raw = [p.grad.clone() for p in model.parameters()]
        if scale == 1.0:
            eva.step()
            params = model.parameters()
            assert not any(torch.equal(r, p.grad) for r, p in zip(raw, params, strict=True))
            continue
        with pytest.warns(UserWarning, match="Eva's closed form for .* is not finite") as caught:
            eva.step()
        assert caught[0].filename == __file__  # the user's call
        for r, p in zip(raw, model.parameters(), strict=True):
            assert torch.isfinite(r).all()
            assert torch.equal(p.grad, r) or torch.isfinite(p.grad).all()
        out_of_range = [layer for layer in eva.layers if layer.nonfinite_preconditioned]
        assert out_of_range and eva.metrics()["nonfinite_preconditioned"] == len(out_of_range)
        for layer in out_of_range:
            assert torch.equal(layer.helper.module.weight.grad,
                               raw[2 * eva.layers.index(layer)])
