"""A step that is captured but never taken (rolled back by ``load_state_dict``, dropped by
``discard_pending`` as MKOR-H's switch does, or skipped on an AMP overflow) leaves nothing
behind: neither its statistics nor the AMP loss scale read for them, which the scaler may have
moved before the next step."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner
from core.batchnorm import BatchNormPreconditioner


class _Scaler:
    """The part of an AMP ``GradScaler`` the preconditioners read, with a scale to move."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(27, 2)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 2, 5, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 2, (6,), generator=g)) for _ in range(3)]


def _scaled_backward(model: nn.Module, scaler: _Scaler, x: torch.Tensor, y: torch.Tensor
                     ) -> None:
    """Backward of the loss times the scale, then the gradients unscaled (``unscale_``)."""
    model.zero_grad()
    (F.cross_entropy(model(x), y) * scaler.scale).backward()
    for p in model.parameters():
        p.grad.div_(scaler.scale)


Factory = Callable[[nn.Module, _Scaler], Any]
PRECONDITIONERS: dict[str, Factory] = {
    "kfac": lambda m, s: KFACPreconditioner(m, factor_dtype="float64", grad_scaler=s),
    "mkor": lambda m, s: MKORPreconditioner(m, inv_update_steps=1, dtype="float64",
                                            grad_scaler=s),
    "eva": lambda m, s: EvaPreconditioner(m, dtype="float64", grad_scaler=s),
    "batchnorm": lambda m, s: BatchNormPreconditioner(m, mode="full", grad_scaler=s),
}


def _abandon(how: str, precond: Any, saved: dict[str, Any]) -> None:
    if how == "load_state_dict":
        precond.load_state_dict(saved)
    else:
        precond.discard_pending()


@pytest.mark.parametrize("how", ["load_state_dict", "discard_pending"])
@pytest.mark.parametrize("name", sorted(PRECONDITIONERS))
def test_an_abandoned_step_leaves_no_statistics_and_no_loss_scale(name: str, how: str) -> None:
    """Captured under scale 1024, abandoned, then the scaler backs off to 128: the next step
    equals a fresh preconditioner's on that batch. The scale read at the abandoned capture
    was kept until a ``step()`` that never came (captured gradients then divided by 1024
    instead of 128), and BatchNorm's ``load_state_dict`` kept the abandoned blocks."""
    make = PRECONDITIONERS[name]
    (x0, y0), (x1, y1), (x2, y2) = _batches()
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, scaler = _model(), _Scaler(1024.0)
        precond = make(model, scaler)
        _scaled_backward(model, scaler, x0, y0)
        precond.step()
        saved = precond.state_dict()
        _scaled_backward(model, scaler, x1, y1)  # never stepped
        _abandon(how, precond, saved)
        scaler.scale = 128.0
        _scaled_backward(model, scaler, x2, y2)
        precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])

        fresh_model, fresh_scaler = _model(), _Scaler(1024.0)
        fresh = make(fresh_model, fresh_scaler)
        _scaled_backward(fresh_model, fresh_scaler, x0, y0)
        fresh.step()
        fresh_scaler.scale = 128.0
        _scaled_backward(fresh_model, fresh_scaler, x2, y2)
        fresh.step()
        grads.append([p.grad.clone() for p in fresh_model.parameters()])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_batchnorm_skip_step_drops_the_overflowed_steps_blocks_and_counts_it() -> None:
    """A step the ``GradScaler`` skipped: its blocks do not enter the next update, and the
    step is counted (the update schedule stays aligned with K-FAC's)."""
    (x0, y0), (x1, y1), _ = _batches()
    model, scaler = _model(), _Scaler(1.0)
    precond = BatchNormPreconditioner(model, mode="full", update_steps=2, grad_scaler=scaler)
    _scaled_backward(model, scaler, x0, y0)
    precond.skip_step()
    assert precond.steps == 1 and precond.blocks[0].fisher.pending is None
    _scaled_backward(model, scaler, x1, y1)  # step 1: no update due, nothing captured
    assert precond.blocks[0].fisher.pending is None
    precond.step()
    assert precond.blocks[0].fisher.value is None
