"""Every collective is tagged with the preconditioner step it belongs to, so
``ledger.summary(step=k)`` shows step ``k``'s traffic: BatchNorm's all-reduce when it shares
K-FAC's ledger and steps after it, and the gradient all-reduce that runs before MKOR's
``step()``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core import KFACPreconditioner, MKORPreconditioner
from core.batchnorm import BatchNormPreconditioner
from core.config import KFACConfig
from core.distributed import Communicator, average_gradients
from core.distributed.strategies import make_strategy
from tests.distributed.helpers import run_workers


def _batch(rank: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1 + rank)
    return torch.randn(4, *shape, generator=generator), torch.randint(0, 4, (4,),
                                                                     generator=generator)


def kfac_and_batchnorm(rank: int, world_size: int) -> list[tuple[int, str]]:
    """Four steps of K-FAC and BatchNorm sharing one ledger, both updating every 2 steps, in
    the Osawa trainer's order (K-FAC's step, then BatchNorm's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(48, 4))
    kfac = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2)
    bn = BatchNormPreconditioner(model, update_steps=2, communicator=kfac.strategy.communicator)
    x, y = _batch(rank, (2, 6, 6))
    for _ in range(4):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        kfac.step()
        bn.step()
    return [(e.step, e.stage) for e in kfac.strategy.communicator.ledger.entries
            if e.stage in ("bn_factor_comm", "factor_comm")]


def mkor_with_gradient_average(rank: int, world_size: int) -> list[tuple[int, str]]:
    """Three MKOR steps, each with the documented gradient all-reduce before ``step()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 6), nn.Tanh(), nn.Linear(6, 4))
    mkor = MKORPreconditioner(model, inv_update_steps=1)
    x, y = _batch(rank, (10,))
    for _ in range(3):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        average_gradients(model.parameters(), mkor.communicator)
        mkor.step()
    return [(e.step, e.stage) for e in mkor.communicator.ledger.entries]


def test_collectives_are_tagged_with_their_own_step() -> None:
    """BatchNorm's all-reduce of update step k was tagged k + 1 (K-FAC had moved the shared
    tag on), and MKOR's step k gradient all-reduce k − 1 (its tag moved only inside
    ``step()``)."""
    entries = run_workers(kfac_and_batchnorm, 2)[0]
    assert entries == [(0, "factor_comm"), (0, "bn_factor_comm"),
                       (2, "factor_comm"), (2, "bn_factor_comm")]
    entries = run_workers(mkor_with_gradient_average, 2)[0]
    assert entries == [(step, stage) for step in range(3)
                       for stage in ("grad_allreduce", "factor_comm")]


def test_a_resumed_run_tags_its_collectives_with_the_resumed_step() -> None:
    """After ``load_state_dict`` at step 3, the first step's collectives were tagged 0 (the
    fresh strategy's tag), so a resumed run's per-step ledger read the wrong step."""
    def make() -> tuple[nn.Module, KFACPreconditioner]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        strategy = make_strategy(KFACConfig(), Communicator.simulated(0, 2))
        return model, KFACPreconditioner(model, strategy_impl=strategy)

    def train_step(model: nn.Module, precond: KFACPreconditioner) -> None:
        model.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        precond.step()

    model, precond = make()
    for _ in range(3):
        train_step(model, precond)
    saved = precond.state_dict()
    model, precond = make()
    precond.load_state_dict(saved)
    train_step(model, precond)
    tags = {entry.step for entry in precond.strategy.communicator.ledger.entries}
    assert tags == {3}
