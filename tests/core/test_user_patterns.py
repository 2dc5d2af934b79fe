"""The preconditioners in a practitioner's own training loop: patterns the papers' models do not
use (channels-last weights under a fused optimizer, weights computed by a parametrization)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner
from core.batchnorm import BatchNormPreconditioner
from core.optim import build_optimizer

PRECONDITIONERS = [KFACPreconditioner, MKORPreconditioner, EvaPreconditioner]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_a_channels_last_weights_gradient_keeps_its_layout_for_a_fused_optimizer(
        make: type, bias: bool) -> None:
    """Autograd lays a gradient out like its weight, and ``Adam(fused=True)`` reads the two in
    step: a preconditioned gradient written contiguous for a channels-last weight was applied
    to the wrong weights. The fused update must equal the unfused one."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    y = torch.randn(4, 3)
    updated = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.Tanh(), nn.Flatten(),
                              nn.Linear(144, 3)).to(memory_format=torch.channels_last)
        precond = make(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused, foreach=False)
        F.mse_loss(model(x), y).backward()
        precond.step()
        weight = model[0].weight
        assert weight.grad.stride() == weight.stride()
        optimizer.step()
        updated.append(weight.detach().clone())
    torch.testing.assert_close(updated[1], updated[0])


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm. is deprecated")
@pytest.mark.parametrize("wrap", [parametrizations.weight_norm, parametrizations.spectral_norm,
                                  nn.utils.weight_norm])
@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_a_layer_whose_weight_is_computed_is_left_first_order_naming_it(make: type,
                                                                         wrap: object) -> None:
    """Under weight_norm or spectral_norm autograd writes the gradient into the
    parametrization's parameters, never into the weight's ``.grad``: such a layer was kept and
    silently never preconditioned (or warned about as a subclass to register, which did the
    same). It is left first-order with a warning naming it, and the rest still steps."""
    torch.manual_seed(0)
    model = nn.Sequential(wrap(nn.Linear(5, 4)), nn.Tanh(), nn.Linear(4, 3))  # type: ignore[operator]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        precond = make(model)
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("0: its weight is computed from other parameters") for m in messages)
    assert [layer.name for layer in precond.layers] == ["2"]
    F.mse_loss(model(torch.randn(8, 5)), torch.randn(8, 3)).backward()
    raw = [p.grad.clone() for p in model[0].parameters()]
    precond.step()
    assert all(torch.equal(r, p.grad) for r, p in zip(raw, model[0].parameters(), strict=True))


@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_a_second_gradient_through_one_forward_call_is_reported_naming_the_layer(
        make: type) -> None:
    """Two backward passes over one forward pass (or ``torch.autograd.grad`` before
    ``backward``) give the optimizer the gradient of the summed losses, while the curvature
    took each pass's output gradient as a call of its own: preconditioned gradients up to
    85% (K-FAC), 32% (Eva) or 4% (MKOR) away from those of one backward of the sum, silently.
    One backward pass, even through a layer called twice, is not reported."""
    torch.manual_seed(0)
    x, y1, y2 = torch.randn(8, 5), torch.randn(8, 3), torch.randn(8, 3)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    precond = make(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hidden = model[:2](x)
        out = model[2](hidden) + model[2](hidden)
        (F.mse_loss(out, y1) + F.mse_loss(out, y2)).backward()
        precond.step()
    precond.remove_hooks()
    precond = make(model)
    out = model(x)
    F.mse_loss(out, y1).backward(retain_graph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.mse_loss(out, y2).backward()
    reported = [str(w.message).split(":")[0] for w in caught
                if "a second gradient reached the output" in str(w.message)]
    assert sorted(reported) == ["0", "2"]
    precond.step()


@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_a_compiled_model_is_preconditioned_as_the_eager_one(make: type) -> None:
    """``torch.compile`` traces the forward pass with the capture hooks in it (dynamo runs
    module hooks and registers the output-tensor hooks): the updates equal the eager ones.
    The ``aot_eager`` backend keeps the test fast; the hooks meet dynamo the same way under
    inductor (checked by hand on ResNet-18 and a CNN)."""
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    updated = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(512, 5))
        precond = make(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(forward(x), y).backward()
            precond.step()
            optimizer.step()
        updated.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch._dynamo.reset()
    assert torch.allclose(updated[0], updated[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attach", ["built after a compiled call", "attached again",
                                    "attached again, compiled with them"])
@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_hooks_attached_after_a_compiled_call_are_seen_by_the_compiled_model(
        make: type, attach: str) -> None:
    """Dynamo does not guard on module hooks: a graph compiled before the capture hooks were
    attached (a first-order warm-up step, or a first call between ``remove_hooks`` and
    ``add_hooks``) ran on without them, and the model trained first order with a warning that
    blamed ``model.train()``. Attaching clears the compiled caches, with a warning naming the
    recompilation; the step then equals the eager one. Where nothing was compiled while the
    hooks were off, attaching them again clears nothing."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    stepped, caught = [], []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if attach == "built after a compiled call":
                F.cross_entropy(forward(x), y).backward()
                model.zero_grad()
                precond = make(model)
            else:
                precond = make(model)
                if attach == "attached again, compiled with them":
                    F.cross_entropy(forward(x), y).backward()
                    precond.discard_pending()
                    model.zero_grad()
                precond.remove_hooks()
                forward(x)
                precond.add_hooks()
        caught.append([str(w.message) for w in seen if "torch.compile" in str(w.message)])
        F.cross_entropy(forward(x), y).backward()
        raw = model[0].weight.grad.clone()
        precond.step()
        assert not torch.equal(model[0].weight.grad, raw)  # preconditioned
        stepped.append(model[0].weight.grad.clone())
    torch._dynamo.reset()
    assert caught[0] == []
    if attach == "attached again, compiled with them":
        assert caught[1] == []
    else:
        assert len(caught[1]) == 1 and "recompil" in caught[1][0]
    torch.testing.assert_close(stepped[1], stepped[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [*PRECONDITIONERS, BatchNormPreconditioner])
def test_hooks_detach_and_attach_again_once(make: type) -> None:
    """``remove_hooks`` leaves the model as if no preconditioner were there (a forward pass
    runs no hook of it), ``add_hooks`` attaches one hook per layer again, and a second
    ``add_hooks`` adds none: a doubled hook would capture every statistic twice."""
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
    precond = make(model)

    def hook_counts() -> list[int]:
        return [len(module._forward_hooks) for module in model]

    attached = [0, 1, 0, 0] if make is BatchNormPreconditioner else [1, 0, 0, 1]
    assert hook_counts() == attached
    precond.remove_hooks()
    assert hook_counts() == [0, 0, 0, 0]
    precond.add_hooks()
    precond.add_hooks()
    assert hook_counts() == attached
    F.mse_loss(model(torch.randn(6, 5)), torch.randn(6, 3)).backward()
    precond.step()


@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_a_forward_pass_without_backward_leaves_the_statistics_alone(make: type) -> None:
    """A forward pass in training mode with gradients enabled whose output never reaches a
    backward pass (a loss logged on another batch without ``torch.no_grad()``) must not enter
    the curvature: only calls whose output receives a gradient are captured. Its inputs
    were averaged into the input statistics, with no gradient to match, changing the step."""
    torch.manual_seed(0)
    x, y, other = torch.randn(8, 5), torch.randn(8, 3), 3 + torch.randn(8, 5)
    grads = []
    for extra_forward in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        precond = make(model)
        if extra_forward:
            F.mse_loss(model(other), y)  # computed, never backpropagated
        F.mse_loss(model(x), y).backward()
        precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, with_extra in zip(*grads, strict=True):
        torch.testing.assert_close(with_extra, plain, rtol=0, atol=0)


@pytest.mark.parametrize("make", [*PRECONDITIONERS, BatchNormPreconditioner])
def test_forward_passes_under_no_capture_stay_out_of_the_statistics(make: type) -> None:
    """An adversarial example's gradient (a forward pass of its own, differentiated for its
    input only) was captured as one more call of every layer, with no warning: K-FAC's step
    moved by up to 43%. Inside ``no_capture()`` it adds nothing, while a training forward pass
    run before the context keeps its capture even when its backward pass runs inside."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    grads = {}
    for variant in ("plain", "paused", "unpaused"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
        precond = make(model)
        for step in range(2):
            model.zero_grad()
            loss = F.mse_loss(model(x + step), y)
            if variant == "plain":
                loss.backward()
            else:
                with precond.no_capture() if variant == "paused" else contextlib.nullcontext():
                    attacked = (3 * x).requires_grad_()
                    torch.autograd.grad(F.mse_loss(model(attacked), y), attacked)
                    loss.backward()
            precond.step()
        grads[variant] = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads["paused"], grads["plain"], rtol=0, atol=0)
    assert not torch.equal(grads["unpaused"], grads["plain"])  # the pass counts when not paused


def test_no_capture_nests_and_holds_across_reattached_hooks() -> None:
    """Hooks attached again inside the context (MKOR-H rolled back by a checkpoint) are
    paused too, and the outer context still pauses after an inner one ends."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    precond = KFACPreconditioner(model)
    with precond.no_capture():
        precond.remove_hooks()
        precond.add_hooks()
        with precond.no_capture():
            pass
        F.mse_loss(model(torch.randn(6, 5)), torch.randn(6, 3)).backward()
    assert all(not layer.captured_inputs for layer in precond.layers)
    F.mse_loss(model(torch.randn(6, 5)), torch.randn(6, 3)).backward()
    assert all(len(layer.captured_inputs) == 1 for layer in precond.layers)


@pytest.mark.parametrize("name", ["sgd", "kfac", "mkor-h"])
def test_the_optimizer_wrapper_pauses_its_preconditioner(name: str) -> None:
    """``build_optimizer``'s optimizer passes ``no_capture()`` on (through MKOR-H's switch);
    a first-order one has nothing to pause."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    optimizer = build_optimizer(name, model, lr=0.1)
    inner = optimizer.preconditioner
    while inner is not None and hasattr(inner, "preconditioner"):  # MKOR-H's switch
        inner = inner.preconditioner
    hooks = [] if inner is None else inner._hooks._hooks
    assert len(hooks) == (0 if name == "sgd" else 2)
    with optimizer.no_capture():
        assert all(hook.paused for hook in hooks)
    assert not any(hook.paused for hook in hooks)


@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_a_model_materialised_after_its_preconditioner_was_built_trains_as_one_built_after(
        make: type) -> None:
    """A large model built on the meta device and materialised (``to_empty``) after its
    preconditioner, or moved to a GPU after it: MKOR had made its identity inverses where the
    weights were when it was built, and its first step failed ("Cannot copy out of meta
    tensor"; on a GPU a device mismatch). Its state now follows the weights, as K-FAC's and
    Eva's, built from the first captures, do: the steps equal those of a model built where it
    trains."""
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    updated = []
    for on_meta in (False, True):
        with torch.device("meta" if on_meta else "cpu"):
            model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        precond = make(model)
        if on_meta:
            model.to_empty(device="cpu")
        torch.manual_seed(0)
        for layer in (model[0], model[2]):
            layer.reset_parameters()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            precond.step()
            optimizer.step()
        assert all(t.device.type == "cpu" for t in precond.state_dict()["layers"]["0"].values()
                   if isinstance(t, torch.Tensor))
        updated.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(updated[1], updated[0], rtol=0, atol=0)


@pytest.mark.parametrize("make", [*PRECONDITIONERS, BatchNormPreconditioner])
def test_a_step_inside_the_autocast_region_is_the_step_outside_it(make: type) -> None:
    """A training loop that calls ``step()`` inside its autocast region: MKOR failed there
    (its ``dot`` of a float32 vector with an autocast bfloat16 product) and K-FAC ran its
    products in bfloat16. The step now runs with autocast off: the same gradients as a step
    called outside the region."""
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    grads = []
    for inside in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
        precond = make(model)
        for _ in range(2):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
                loss.backward()
                if inside:
                    precond.step()
            if not inside:
                precond.step()
        assert not torch.is_autocast_enabled("cpu")
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize(("make", "options"), [
    (KFACPreconditioner, {"inverse_method": "eigen"}),
    (KFACPreconditioner, {"inverse_method": "inverse"}),
    (KFACPreconditioner, {"inverse_method": "cholesky_solve"}),
    (KFACPreconditioner, {"strategy": "dp-kfac"}),
    (MKORPreconditioner, {}),
    (EvaPreconditioner, {}),
])
def test_transformers_conv1d_is_preconditioned_as_the_linear_layer_it_is(
        make: type, options: dict) -> None:
    """GPT-2's attention and MLP projections are transformers' ``Conv1D``, a linear layer
    whose weight is stored ``(in, out)``: they were left first-order (a GPT-2 had only its
    tied LM head preconditioned). Each now gets the preconditioned gradient of the same
    layer written as ``nn.Linear``, transposed."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = nn.Sequential(Conv1D(6, 4), nn.Tanh(), Conv1D(3, 6))
    linear = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for c, lin in ((conv[0], linear[0]), (conv[2], linear[2])):
            lin.weight.copy_(c.weight.t())
            lin.bias.copy_(c.bias)
    preconds = [make(conv, **options), make(linear, **options)]
    assert [layer.name for layer in preconds[0].layers] == ["0", "2"]
    x, y = torch.randn(2, 5, 4), torch.randn(2, 5, 3)
    for _ in range(2):
        for model, precond in zip((conv, linear), preconds, strict=True):
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            precond.step()
        for c, lin in ((conv[0], linear[0]), (conv[2], linear[2])):
            torch.testing.assert_close(c.weight.grad, lin.weight.grad.t())
            torch.testing.assert_close(c.bias.grad, lin.bias.grad)
            assert c.weight.grad.shape == c.weight.shape and c.weight.grad.is_contiguous()


@pytest.mark.parametrize("make", PRECONDITIONERS)
def test_an_output_layer_tied_to_the_input_embedding_stays_first_order_naming_it(
        make: type) -> None:
    """A language model's output layer tied to its embedding (GPT-2's ``lm_head``) was
    preconditioned whole: its gradient, which carries the embedding's too, was rewritten with
    the output layer's factors, and at GPT-2's vocabulary MKOR allocated a 50,257-square
    inverse (9.4 GiB) when built. It stays first-order with a warning naming the other
    module; a weight tied between two preconditioned layers is still preconditioned."""

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 4)
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 11, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(self.embed(tokens))))

    model = TinyLM()
    with pytest.warns(UserWarning, match=r"^head: its weight is also that of embed \(tied\)"):
        precond = make(model)
    assert [layer.name for layer in precond.layers] == ["body"]
    tokens = torch.randint(0, 11, (3, 5))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    raw = model.head.weight.grad.clone()
    precond.step()
    assert torch.equal(model.head.weight.grad, raw)

    shared = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    shared[2].weight = shared[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [layer.name for layer in make(shared).layers] == ["0", "2"]


def test_a_weight_that_is_no_parameter_is_still_preconditioned() -> None:
    """A layer whose weight is a plain tensor attribute (no registered parameter) is found by
    the preconditioner; the tie check looked it up among parameters and raised KeyError."""
    layer = nn.Linear(4, 4)
    del layer.weight
    layer.weight = torch.randn(4, 4, requires_grad=True)
    precond = KFACPreconditioner(layer)
    assert [x.name for x in precond.layers] == [""]
    F.mse_loss(layer(torch.randn(6, 4)), torch.randn(6, 4)).backward()
    precond.step()
