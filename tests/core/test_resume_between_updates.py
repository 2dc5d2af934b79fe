"""A checkpoint taken at a step where no statistics update is due, loaded into a fresh
preconditioner (a resumed run) or into the one that took it after it has stepped on (an
in-memory rollback), continues exactly as the uninterrupted run: what the next steps reuse
(inverses, whether the next step captures, cached bounds) comes from the checkpoint."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner
from core.batchnorm import BatchNormPreconditioner

#: Every preconditioner updates every 2 steps (MKOR: its stabiliser's cached bounds matter).
PRECONDITIONERS: dict[str, Callable[[nn.Module], Any]] = {
    "kfac": lambda m: KFACPreconditioner(m, factor_update_steps=2, inv_update_steps=2,
                                         skip_layers=[nn.BatchNorm1d]),
    "batchnorm": lambda m: BatchNormPreconditioner(m, update_steps=2),
    "eva": lambda m: EvaPreconditioner(m, dtype="float64", kl_clip=None,
                                       factor_update_steps=2),
    "mkor": lambda m: MKORPreconditioner(m, dtype="float64", inv_update_steps=1, epsilon=2.0,
                                         zeta=0.7, stat_decay=0.8),
}
SAVE_AT, STEPS = 3, 6


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()


def train_step(net: nn.Module, precond: Any, step: int, scale: float = 1.0) -> list[Tensor]:
    """One SGD step on batch ``step`` (inputs times ``scale``); the preconditioned gradients."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=generator, dtype=torch.float64) * scale
    y = torch.randint(0, 3, (16,), generator=generator)
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    precond.step()
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    with torch.no_grad():
        for p, g in zip(net.parameters(), grads, strict=True):
            p.sub_(0.1 * g)
    return grads


def continued(name: str, how: str) -> list[list[Tensor]]:
    """Gradients of steps ``SAVE_AT …`` after saving at ``SAVE_AT``: run on, loaded into a
    fresh preconditioner, or loaded back into the same one after 4 steps on tiny inputs."""
    net = model()
    precond = PRECONDITIONERS[name](net)
    for step in range(SAVE_AT):
        train_step(net, precond, step)
    saved = copy.deepcopy((net.state_dict(), precond.state_dict()))
    if how == "fresh":
        net = model()
        precond = PRECONDITIONERS[name](net)
    elif how == "rolled back":
        for step in range(100, 104):
            train_step(net, precond, step, scale=0.01)
    if how != "uninterrupted":
        net.load_state_dict(saved[0])
        precond.load_state_dict(saved[1])
    return [train_step(net, precond, step) for step in range(SAVE_AT, STEPS)]


@pytest.mark.parametrize("how", ["fresh", "rolled back"])
@pytest.mark.parametrize("name", sorted(PRECONDITIONERS))
def test_loading_a_checkpoint_between_updates_continues_as_the_uninterrupted_run(
        name: str, how: str) -> None:
    expected = continued(name, "uninterrupted")
    for step, (got, want) in enumerate(zip(continued(name, how), expected, strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=0, msg=f"step {SAVE_AT + step}")


@pytest.mark.parametrize("name", ["kfac", "batchnorm"])
def test_a_resumed_run_reports_the_checkpoints_failure_and_skip_counters(name: str) -> None:
    net = model()
    precond = PRECONDITIONERS[name](net)
    train_step(net, precond, 0)
    counters: tuple[str, ...]
    if name == "kfac":
        precond.skipped_overflow_steps, precond.nonfinite_preconditioned = 2, 3
        precond.layers[0].decomposition_failures = 4
        precond.layers[1].nonfinite_factor_skips = 5
        counters = ("skipped_overflow_steps", "nonfinite_preconditioned",
                    "decomposition_failures", "nonfinite_factor_skips")
    else:
        precond.blocks[0].failures, precond.blocks[0].nonfinite_skips = 2, 3
        counters = ("bn/decomposition_failures", "bn/nonfinite_skips")
    saved = precond.metrics()
    assert all(saved[key] > 0 for key in counters)
    resumed = PRECONDITIONERS[name](model())
    resumed.load_state_dict(copy.deepcopy(precond.state_dict()))
    assert {key: resumed.metrics()[key] for key in counters} == {
        key: saved[key] for key in counters}
