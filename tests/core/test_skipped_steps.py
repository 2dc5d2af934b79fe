"""Steps whose optimizer update a GradScaler skipped on an overflow: the preconditioner's step()
never runs then, so what its hooks captured must not enter the next update."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner, build_optimizer

MAKERS: dict[str, Callable[[nn.Module], Any]] = {
    "kfac": lambda m: KFACPreconditioner(m, inverse_method="inverse"),
    "mkor": lambda m: MKORPreconditioner(m, inv_update_steps=1),
    "eva": lambda m: EvaPreconditioner(m, factor_decay=0.5),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def backward(net: nn.Module, x: torch.Tensor) -> None:
    net.zero_grad()
    F.cross_entropy(net(x), torch.tensor([0, 1, 2, 0])).backward()


def state(precond: Any) -> list[torch.Tensor]:
    sd = precond.state_dict()["layers"]
    return [t for layer in sd.values() for t in layer.values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_skip_step_drops_what_the_skipped_step_captured(name: str) -> None:
    """A skipped step between two steps leaves the same state as if it had not happened, and
    is counted."""
    x1, x_skipped, x2 = (torch.randn(4, 4, generator=torch.Generator().manual_seed(s))
                         for s in (1, 2, 3))
    results = []
    for skip in (False, True):
        net = model()
        precond = MAKERS[name](net)
        backward(net, x1)
        precond.step()
        if skip:
            backward(net, x_skipped)
            precond.skip_step()
        backward(net, x2)
        precond.step()
        results.append((state(precond), [p.grad.clone() for p in net.parameters()],
                        precond.skipped_overflow_steps))
    (clean, grads, none), (after, grads_after, counted) = results
    assert none == 0 and counted == 1
    for a, b in zip(clean, after, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(grads, grads_after, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["mkor", "eva"])
def test_non_finite_statistics_left_pending_are_skipped_not_averaged_in(name: str) -> None:
    """Without skip_step, statistics captured from an overflowed pass (here an infinite input)
    would be averaged into the next update: they are skipped, counted and reported, and the
    running state stays finite."""
    net = model()
    precond = MAKERS[name](net)
    bad = torch.full((4, 4), float("inf"))
    net.zero_grad()
    net(bad).sum().backward()  # the capture hooks ran; step() did not (a skipped update)
    backward(net, torch.randn(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        precond.step()
    assert any("non-finite statistics of 0" in str(w.message) for w in caught)
    assert precond.nonfinite_statistics_skips >= 1
    assert all(bool(t.isfinite().all()) for t in state(precond))


def test_the_optimizer_wrapper_passes_skip_step_on() -> None:
    net = model()
    opt = build_optimizer("mkor", net, lr=0.1, inv_update_steps=1)
    backward(net, torch.randn(4, 4))
    opt.skip_step()
    assert opt.preconditioner.skipped_overflow_steps == 1
    assert opt.preconditioner.steps == 1


@pytest.mark.parametrize("how", ["skip_step", "overflow"])
def test_a_skipped_first_step_does_not_leave_k_fac_first_order_until_the_next_interval(
        how: str) -> None:
    """Inverses were computed only on multiples of ``inv_update_steps``: with step 0 skipped
    (a GradScaler's first steps often overflow) every layer stayed first-order, silently,
    until step 10. Now the first step with factors inverts, as step 0 would have, and the
    schedule then goes on as before; a checkpoint keeps that it has."""
    net = model()
    precond = KFACPreconditioner(net, inv_update_steps=10, factor_decay=0.5)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(4))
    backward(net, x)
    if how == "overflow":
        net[0].weight.grad[0, 0] = float("inf")
        precond.step()
    else:
        precond.skip_step()
    assert not any(layer.has_state for layer in precond.layers)
    backward(net, x)
    raw = [p.grad.clone() for p in net.parameters()]
    precond.step()
    assert all(layer.has_state for layer in precond.layers)
    assert all(not torch.equal(p.grad, r) for p, r in zip(net.parameters(), raw, strict=True))
    first = [layer.state.tensors()[0].clone() for layer in precond.layers]  # type: ignore[union-attr]
    backward(net, torch.randn(4, 4, generator=torch.Generator().manual_seed(5)))
    precond.step()  # step 2: not an inversion step
    for layer, before in zip(precond.layers, first, strict=True):
        assert torch.equal(layer.state.tensors()[0], before)  # type: ignore[union-attr]
    resumed = KFACPreconditioner(model(), inv_update_steps=10, factor_decay=0.5)
    resumed.load_state_dict(precond.state_dict())
    assert resumed.state_dict()["inverted"]
