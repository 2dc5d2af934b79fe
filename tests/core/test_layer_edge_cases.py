"""Layers the preconditioners meet in real models: a frozen bias, a layer called with its input
as a keyword, a convolution whose padding cannot be supported, an unbatched input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner
from core.batchnorm import BatchNormPreconditioner


def test_a_frozen_bias_is_left_out_of_the_curvature_and_keeps_no_gradient() -> None:
    """Its column would couple the weight to a zero gradient and write one into the bias: the
    weight is preconditioned exactly as the same layer's without a bias (a zero bias, so both
    compute the same outputs)."""
    torch.manual_seed(0)
    frozen, plain = nn.Linear(4, 3).double(), nn.Linear(4, 3, bias=False).double()
    with torch.no_grad():
        frozen.bias.zero_()
        plain.weight.copy_(frozen.weight)
    frozen.bias.requires_grad_(False)
    x = torch.randn(16, 4, dtype=torch.float64)
    for layer in (frozen, plain):
        precond = KFACPreconditioner(layer, inverse_method="inverse", factor_dtype="float64",
                                     inverse_dtype="float64")
        layer(x).pow(2).mean().backward()
        precond.step()
        assert precond.layers[0].a_dim == 4
    assert frozen.bias.grad is None
    torch.testing.assert_close(frozen.weight.grad, plain.weight.grad, rtol=0, atol=0)


def test_a_layer_called_with_its_input_as_a_keyword_is_captured() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    precond = KFACPreconditioner(layer, kl_clip=None)
    x = torch.randn(8, 4)
    layer(input=x).pow(2).mean().backward()
    raw = layer.weight.grad.clone()
    precond.step()
    assert precond.layers[0].has_state and not torch.equal(layer.weight.grad, raw)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
def test_a_convolution_whose_padding_is_unsupported_is_left_first_order_when_found() -> None:
    """``padding='same'`` with an even kernel pads asymmetrically: a warning when the
    preconditioner is built (not an error at its first step), and the layer stays first-order."""
    model = nn.Sequential(nn.Conv2d(2, 3, 2, padding="same"), nn.Flatten(), nn.Linear(75, 2))
    with pytest.warns(UserWarning, match="padding='same' and an even effective kernel"):
        precond = KFACPreconditioner(model)
    assert [layer.name for layer in precond.layers] == ["2"]
    F.cross_entropy(model(torch.randn(4, 2, 5, 5)), torch.tensor([0, 1, 0, 1])).backward()
    precond.step()


@pytest.mark.parametrize("make", [KFACPreconditioner, MKORPreconditioner, EvaPreconditioner])
def test_an_unbatched_input_is_refused_naming_the_layer(make: type) -> None:
    model = nn.Sequential(nn.Linear(5, 3))
    make(model)
    with pytest.raises(ValueError, match=r"^0: Linear got a 1-D input of shape \(5,\); its "
                                         r"curvature needs at least 2 dimensions"):
        model(torch.randn(5))
    conv = nn.Sequential(nn.Conv2d(2, 3, 3))
    make(conv)
    with pytest.raises(ValueError, match="Conv2d got a 3-D input .* needs 4 dimensions"):
        conv(torch.randn(2, 6, 6))


def test_one_idle_batchnorm_leaves_the_others_preconditioned() -> None:
    """A BatchNorm in ``eval()`` captures nothing; the others still update their blocks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3),
                          nn.BatchNorm1d(3))
    model[4].eval()
    precond = BatchNormPreconditioner(model, mode="diagonal")
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
    precond.step()
    assert precond.last_preconditioned == 1
    assert precond.blocks[0].inverse is not None and precond.blocks[1].inverse is None


@pytest.mark.parametrize("make", [KFACPreconditioner, MKORPreconditioner, EvaPreconditioner])
@pytest.mark.parametrize("frozen_first", [False, True])
def test_freezing_or_unfreezing_a_bias_later_keeps_training(make: type,
                                                           frozen_first: bool) -> None:
    """The curvature's bias column is decided when the preconditioner is built: a bias frozen
    later keeps its column but is written no gradient; one unfrozen later stays first-order."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    layer.bias.requires_grad_(not frozen_first)
    precond = make(layer)
    x = torch.randn(8, 4)
    for step in range(3):
        if step == 1:
            layer.bias.requires_grad_(frozen_first)  # toggled mid-training
        layer.zero_grad(set_to_none=True)
        layer(x).pow(2).mean().backward()
        precond.step()
        assert bool(layer.weight.grad.isfinite().all())
        if not layer.bias.requires_grad:
            assert layer.bias.grad is None


@pytest.mark.parametrize("make", [KFACPreconditioner, MKORPreconditioner, EvaPreconditioner,
                                  BatchNormPreconditioner])
def test_a_lazy_layer_is_refused_until_its_first_forward_pass(make: type) -> None:
    """A ``LazyLinear`` or ``LazyBatchNorm2d`` has no shapes before its first forward pass: the
    subclass warning advised registering it, which then failed inside PyTorch, and BatchNorm's
    preconditioner failed the same way. Refused naming the layer and the fix; after one
    forward pass (it becomes a plain ``Linear``) it is preconditioned."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.LazyBatchNorm2d(), nn.Flatten(),
                          nn.LazyLinear(2))
    lazy = "1 \\(LazyBatchNorm2d\\)" if make is BatchNormPreconditioner else "3 \\(LazyLinear\\)"
    with pytest.raises(TypeError, match=f"{lazy} has uninitialized parameters: run one "
                                        "forward pass"):
        make(model)
    model(torch.randn(1, 2, 5, 5))
    names = [x.name for x in (make(model).blocks if make is BatchNormPreconditioner
                              else make(model).layers)]
    assert names == (["1"] if make is BatchNormPreconditioner else ["0", "3"])


def test_an_unsupported_convolution_is_named_in_its_warning() -> None:
    """Two grouped convolutions gave one identical warning that named neither (Python shows a
    repeated text once)."""
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 4, 3, groups=2))
    with pytest.warns(UserWarning) as caught:
        KFACPreconditioner(model)
    texts = [str(w.message) for w in caught if "groups=2" in str(w.message)]
    assert [t.split(":")[0] for t in texts] == ["0", "1"]


def _layer_tensors(precond: object) -> list[torch.Tensor]:
    """The tensors of the first layer's saved state (its factors, vectors or inverses)."""
    state = precond.layers[0].state_dict()  # type: ignore[attr-defined]
    return [value for value in state.values() if isinstance(value, torch.Tensor)]


@pytest.mark.parametrize(("make", "interval"), [(KFACPreconditioner, "factor_update_steps"),
                                                (MKORPreconditioner, "inv_update_steps"),
                                                (EvaPreconditioner, "factor_update_steps")])
def test_an_empty_batch_is_not_captured_and_leaves_the_statistics_as_they_were(
        make: type, interval: str) -> None:
    """A layer that sees no rows in a step (a mixture-of-experts expert no token reached) adds
    nothing to its curvature: the step runs, warning that nothing was captured, the statistics
    are those of the step before, and the next non-empty step is preconditioned as usual."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    precond = make(layer, **{interval: 1})
    layer(torch.randn(8, 4)).pow(2).mean().backward()
    precond.step()
    saved = [t.clone() for t in _layer_tensors(precond)]
    assert saved
    layer.zero_grad()
    layer(torch.randn(0, 4)).sum().backward()
    with pytest.warns(UserWarning, match="non-empty batch"):
        precond.step()
    for old, new in zip(saved, _layer_tensors(precond), strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    assert torch.count_nonzero(layer.weight.grad) == 0
    layer.zero_grad()
    layer(torch.randn(8, 4)).pow(2).mean().backward()
    raw = layer.weight.grad.clone()
    precond.step()
    assert all(torch.isfinite(t).all() for t in _layer_tensors(precond))
    assert torch.isfinite(layer.weight.grad).all() and not torch.equal(layer.weight.grad, raw)


@pytest.mark.parametrize("make", [KFACPreconditioner, MKORPreconditioner, EvaPreconditioner])
def test_layers_on_several_devices_are_refused_naming_them(make: type) -> None:
    """Every method reduces over all layers' tensors at once (the finiteness check of the
    gradients; MKOR's and Eva's statistics are one vector), which PyTorch cannot do across
    devices: refused when built, not at the first step. The meta device stands in for a
    second one here."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, device="meta"))
    with pytest.raises(ValueError, match=r"must be on one device; found cpu \(0, \.\.\.\), "
                                         r"meta \(1, \.\.\.\).*skip_layers"):
        make(model)
    make(model, skip_layers=["1"])  # the fix it names
