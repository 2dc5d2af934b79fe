"""Numerical faults with a real AMP ``GradScaler``: an overflow step leaves every second-order
preconditioner's statistics untouched, the optimizer skips it, and training continues."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner

PRECONDITIONERS = {
    "kfac": lambda model, scaler: KFACPreconditioner(model, grad_scaler=scaler, kl_clip=None),
    "mkor": lambda model, scaler: MKORPreconditioner(model, grad_scaler=scaler,
                                                     inv_update_steps=1),
    "eva": lambda model, scaler: EvaPreconditioner(model, grad_scaler=scaler),
}


def statistics(precond: object) -> list[torch.Tensor]:
    """Every tensor the preconditioner keeps between steps (factors, inverses, vectors)."""
    found: list[torch.Tensor] = []

    def collect(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value.clone())
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list | tuple):
            for item in value:
                collect(item)

    collect(precond.state_dict()["layers"])  # type: ignore[attr-defined]
    return found


@pytest.mark.parametrize("name", sorted(PRECONDITIONERS))
def test_gradscaler_overflow_step_leaves_statistics_untouched(name: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = PRECONDITIONERS[name](model, scaler)
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def train_step(inputs: torch.Tensor) -> None:
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(inputs), y)).backward()
        scaler.unscale_(optimizer)
        precond.step()
        scaler.step(optimizer)
        scaler.update()

    train_step(x)
    before_stats = statistics(precond)
    assert before_stats, "the first step must have built statistics to protect"
    before_params = copy.deepcopy(model.state_dict())
    scale = scaler.get_scale()
    train_step(x * 1e38)  # overflows in the scaled backward pass, as an fp16 overflow does
    assert scaler.get_scale() < scale, "the scaler saw the overflow"
    for kept, old in zip(statistics(precond), before_stats, strict=True):
        assert torch.equal(kept, old)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before_params[key]), "the optimizer skipped the step"
    assert precond.metrics()["skipped_overflow_steps"] == 1
    train_step(x)  # and training continues with finite gradients and statistics
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(t).all() for t in statistics(precond))
