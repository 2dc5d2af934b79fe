"""The rank-1 step on several layers at once: layers of different shapes, with and without a
bias, and a layer that was not called (not captured) on the update step, against per-layer
references in fp64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core import EvaPreconditioner, MKORPreconditioner
from core.eva import eva_precondition
from core.layers import helper_for
from core.rank1 import gradient_vector

torch.set_num_threads(1)
F64 = torch.float64


class Branches(nn.Module):
    """Linear layers of three shapes, one without a bias, and one only called when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 6, bias=False)
        self.third = nn.Linear(6, 3)
        self.spare = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, spare: bool) -> torch.Tensor:
        h = self.second(torch.tanh(self.first(x)))
        out = self.third(h)
        return out + self.spare(h) if spare else out


def _backward(model: Branches, spare: bool, seed: int) -> dict[str, torch.Tensor]:
    """One backward pass; returns each layer's raw gradient matrix ``[∇W | ∇b]``."""
    gen = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)
    x = torch.randn(5, 7, 4, generator=gen, dtype=F64)
    (model(x, spare).sin() ** 2).mean().backward()
    return {name: helper_for(module).grad_matrix().clone()  # type: ignore[union-attr]
            for name, module in model.named_children() if module.weight.grad is not None}


def _written(model: Branches, name: str) -> torch.Tensor:
    return helper_for(getattr(model, name)).grad_matrix()  # type: ignore[union-attr]


@pytest.mark.parametrize("kl_clip", [None, 1e-6])
def test_eva_writes_each_layer_as_its_closed_form_with_one_kl_scale(kl_clip: float | None
                                                                     ) -> None:
    torch.manual_seed(0)
    model = Branches().to(F64)
    damping, lr = 0.05, 0.3
    eva = EvaPreconditioner(model, dtype="float64", damping=damping, kl_clip=kl_clip, lr=lr,
                            factor_decay=0.5)
    _backward(model, spare=False, seed=1)
    with pytest.warns(UserWarning, match="spare: no statistics"):
        eva.step()  # spare was not called: it is not updated
    assert eva.layers[3].a.value is None
    raw = _backward(model, spare=True, seed=2)
    eva.step()
    expected = {layer.name: eva_precondition(raw[layer.name], layer.a.value, layer.g.value,
                                             damping) for layer in eva.layers}
    scale = 1.0
    if kl_clip is not None:
        products = sum((p * raw[name]).sum().item() for name, p in expected.items())
        scale = min(1.0, math.sqrt(kl_clip / abs(lr**2 * products)))
        assert scale < 1.0
    assert eva.last_kl_scale == pytest.approx(scale, rel=1e-12)
    for name, p in expected.items():
        torch.testing.assert_close(_written(model, name), scale * p, rtol=1e-12, atol=1e-14)


def test_mkor_rescales_each_layer_and_updates_only_captured_layers() -> None:
    torch.manual_seed(0)
    model = Branches().to(F64)
    mkor = MKORPreconditioner(model, dtype="float64", inv_update_steps=1, stat_decay=0.8)
    _backward(model, spare=False, seed=1)
    with pytest.warns(UserWarning, match="spare: no statistics"):
        mkor.step()
    spare = mkor.layers[3]
    assert spare.a_vec is None
    torch.testing.assert_close(spare.a_inv, torch.eye(7, dtype=F64), rtol=0, atol=0)
    raw = _backward(model, spare=True, seed=2)
    mkor.step()
    for layer in mkor.layers:
        p = layer.g_inv @ raw[layer.name] @ layer.a_inv
        expected = p * raw[layer.name].norm() / p.norm()
        torch.testing.assert_close(_written(model, layer.name.split(".")[-1]), expected,
                                   rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 4), (2, 5, 4)])
def test_linear_mean_row_equals_the_mean_of_its_rows(bias: bool, shape: tuple[int, ...]) -> None:
    helper = helper_for(nn.Linear(4, 3, bias=bias))
    x = torch.randn(*shape, dtype=torch.float32)
    rows = helper.a_rows(x.to(F64)).rows  # type: ignore[union-attr]
    torch.testing.assert_close(helper.mean_a_row(x, F64),  # type: ignore[union-attr]
                               rows.mean(dim=(0, 1)), rtol=1e-15, atol=1e-15)
    # what the rank-1 methods capture: the same without the bias entry
    torch.testing.assert_close(helper.mean_input_row(x, F64),  # type: ignore[union-attr]
                               rows.mean(dim=(0, 1))[:4], rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 4, 3, padding=1),
    nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False),
    nn.Conv2d(3, 4, (2, 3), stride=(2, 1), padding=(0, 2), dilation=(1, 2)),
    nn.Conv2d(3, 4, 3, padding="same", dilation=2),
    nn.Conv2d(3, 4, 1, stride=2),
    nn.Conv2d(3, 4, 5, stride=3, padding="valid"),
])
@pytest.mark.parametrize("input_dtype", [F64, torch.bfloat16])
def test_conv_mean_row_equals_the_mean_of_its_patch_rows(conv: nn.Conv2d,
                                                         input_dtype: torch.dtype) -> None:
    """``ā`` from the window sums of each tap is the mean of the im2col rows, with stride,
    padding, dilation and bias; a bf16 input is averaged in float64 (no rounding on the way)."""
    helper = helper_for(conv)
    x = torch.randn(3, 3, 9, 11, dtype=F64).to(input_dtype)
    rows = helper.a_rows(x.to(F64)).rows  # type: ignore[union-attr]
    torch.testing.assert_close(helper.mean_a_row(x, F64),  # type: ignore[union-attr]
                               rows.mean(dim=(0, 1)), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced", "expanded",
                                    "one example, one channel, one row"])
@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 4, (2, 3), stride=(2, 1), padding=(1, 2), dilation=(1, 2), bias=False),
    nn.Conv2d(3, 4, 2, stride=3, padding=(6, 4), dilation=5),  # windows wholly in the padding
    nn.Conv2d(3, 4, (4, 5)),  # one output position
])
def test_conv_mean_row_reads_any_input_layout(conv: nn.Conv2d, layout: str) -> None:
    """The strided window sums follow the batch mean's own strides: channels-last, transposed,
    sliced and expanded inputs, single sizes, float32 statistics."""
    base = torch.randn(2, 3, 4, 10, dtype=F64)
    x = {"channels_last": base.contiguous(memory_format=torch.channels_last),
         "transposed": torch.randn(2, 3, 10, 4, dtype=F64).transpose(2, 3),
         "sliced": torch.randn(2, 3, 4, 20, dtype=F64)[..., ::2],
         "expanded": base[:1].expand(3, -1, -1, -1),
         "one example, one channel, one row": base[:1]}[layout]
    if layout.startswith("one example"):
        conv = nn.Conv2d(1, 4, (1, 3), padding=(0, 1))
        x = base[:1, :1, :1]
    helper = helper_for(conv)
    rows = helper.a_rows(x.contiguous()).rows  # type: ignore[union-attr]
    expected = rows.mean(dim=(0, 1))
    torch.testing.assert_close(helper.mean_a_row(x, F64), expected,  # type: ignore[union-attr]
                               rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(helper.mean_a_row(x.float(), torch.float32),  # type: ignore[union-attr]
                               expected.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("module", "shape"), [(nn.Conv2d(3, 4, 3), (2, 4, 5, 6)),
                                             (nn.Linear(3, 4), (2, 5, 4)),
                                             (nn.Linear(3, 4), (6, 4))])
@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("factor", [1.0, 0.375])
def test_gradient_vector_of_a_bf16_gradient_is_its_exact_mean_in_the_statistics_dtype(
        module: nn.Module, shape: tuple[int, ...], per_example: bool, factor: float) -> None:
    """Eva's plain mean and MKOR's ``R``-scaled one of a bf16 output gradient, accumulated in
    float64: the exact mean of the bf16 values (times ``B`` for a convolution, ``B·T`` for a
    Linear under MKOR), times the given further ``scale``."""
    gy = torch.randn(*shape, dtype=F64).bfloat16()
    conv = gy.dim() == 4
    if conv:
        gy = gy.contiguous(memory_format=torch.channels_last)
    exact = (gy.double().movedim(1, -1) if conv else gy.double()).reshape(-1, 4).mean(dim=0)
    scale = 1 if not per_example else shape[0] if conv else gy[..., 0].numel()
    torch.testing.assert_close(
        gradient_vector(helper_for(module), gy, F64, per_example=per_example,  # type: ignore[arg-type]
                        scale=factor),
        exact * scale * factor, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("module", [nn.Conv2d(2, 3, 2), nn.Linear(4, 3, bias=False),
                                    nn.Linear(4, 3)])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "float32 copy"])
def test_outer_is_added_to_the_grad_in_place_or_written_fresh(module: nn.Module,
                                                              layout: str) -> None:
    """``β·[∇W | ∇b] + α·u vᵀ`` lands in ``.grad``: in place, into the very tensors, when the
    parts are the contiguous gradients themselves; else computed apart and copied into the
    contiguous ``.grad`` in its dtype (parts copied into another dtype), or set as a fresh
    contiguous tensor (a strided gradient)."""
    torch.manual_seed(3)
    module = module.to(F64)
    helper = helper_for(module)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
        if layout == "strided":  # a gradient DDP or a hook left non-contiguous
            p.grad = torch.randn(*p.shape, 2, dtype=F64)[..., 0]
    before = helper.grad_matrix().clone()
    grads_before = [p.grad for p in module.parameters()]
    parts = helper.grad_parts()
    if layout == "float32 copy":
        parts = tuple(None if t is None else t.float() for t in parts)
    u = torch.randn(helper.g_dim, dtype=parts[0].dtype)
    v = torch.randn(helper.a_dim, dtype=parts[0].dtype)
    helper.add_outer_to_grad(parts, u, v, beta=0.5, alpha=-2.0)
    expected = 0.5 * before - 2.0 * torch.outer(u, v).to(F64)
    tolerance = 1e-6 if layout == "float32 copy" else 1e-14
    torch.testing.assert_close(helper.grad_matrix(), expected, rtol=tolerance, atol=tolerance)
    for p, grad in zip(module.parameters(), grads_before, strict=True):
        assert p.grad.dtype == F64 and p.grad.is_contiguous()
        assert (p.grad is grad) == (layout != "strided")


@pytest.mark.parametrize("method", ["mkor", "eva"])
def test_a_preconditioned_gradient_beyond_a_float16_weights_range_keeps_the_raw_gradient(
        method: str) -> None:
    """``P`` is finite in the fp32 statistics but far above 65,504: written into an fp16
    weight's ``.grad`` it became infinities that the optimizer applied. Now that layer keeps its
    raw gradient, with a warning and a count (saved with the state); the other layer, in range,
    is preconditioned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2, bias=False)).half()
    if method == "mkor":  # inverses of a state that magnify the first layer's gradient 10¹²x
        precond = MKORPreconditioner(model, rescale=False, inv_update_steps=100)
        precond.layers[0].a_inv.mul_(1e6)
        precond.layers[0].g_inv.mul_(1e6)
    else:  # a damping of 10⁻⁶ magnifies every gradient about 10⁶x: scale only the first layer's
        precond = EvaPreconditioner(model, damping=1e-6, kl_clip=None)
    x = torch.randn(16, 8).half()
    model(x).float().pow(2).mean().backward()
    if method == "eva":
        model[1].weight.grad.mul_(1e-6)  # its P, about 10⁶ times this, stays in range
    raw = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="preconditioned gradient of 0 exceeds float16's range"):
        precond.step()
    first = [p.grad for p in model[0].parameters()]
    assert all(torch.equal(g, r) for g, r in zip(first, raw[:2], strict=True))
    assert torch.isfinite(model[1].weight.grad).all()
    assert not torch.equal(model[1].weight.grad, raw[2])
    assert precond.metrics()["nonfinite_preconditioned"] == 1.0
    state = precond.state_dict()
    assert state["layers"]["0"]["nonfinite_preconditioned"] == 1
