"""A checkpoint held in memory (an in-place rollback) stays as it was: every preconditioner's
``state_dict`` copies its tensors, and ``load_state_dict`` copies them again, so the in-place
updates of later steps touch neither the saved dictionary nor the one loaded from it."""

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


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


PRECONDITIONERS: dict[str, Callable[[nn.Module], Any]] = {
    "kfac": lambda m: KFACPreconditioner(m, inverse_method="inverse"),
    "mkor": lambda m: MKORPreconditioner(m, inv_update_steps=1),
    "eva": lambda m: EvaPreconditioner(m),
    "batchnorm": lambda m: BatchNormPreconditioner(m, mode="diagonal", update_steps=1),
}


def tensors(tree: object) -> list[Tensor]:
    """Every tensor in a nested state dictionary, in a fixed order."""
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in tensors(tree[key])]
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in tensors(item)]
    return []


@pytest.mark.parametrize("name", sorted(PRECONDITIONERS))
def test_steps_after_saving_and_loading_leave_the_checkpoint_unchanged(name: str) -> None:
    net = model()
    precond = PRECONDITIONERS[name](net)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def step(offset: float) -> None:
        net.zero_grad()
        F.cross_entropy(net(x + offset), y).backward()
        precond.step()

    step(0.0)
    saved = precond.state_dict()
    kept = copy.deepcopy(saved)
    assert tensors(saved), "the checkpoint holds the method's statistics"
    step(1.0)
    precond.load_state_dict(saved)
    step(2.0)
    step(3.0)
    for now, then in zip(tensors(saved), tensors(kept), strict=True):
        assert torch.equal(now, then)
