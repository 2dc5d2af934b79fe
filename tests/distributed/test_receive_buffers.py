"""The receive buffers of the preconditioned gradients, counted in ``memory_usage()["buffers"]``:
one step's worth, from every other rank, checked by hand on a simulated rank 0."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core import KFACPreconditioner
from core.config import KFACConfig
from core.distributed import Communicator
from core.distributed.strategies import make_strategy

#: Linear layers ``(in, out)``: factor dims ``(in + 1, out)``, gradients ``out × (in + 1)``.
SHAPES = [(5, 4), (4, 6), (6, 3), (3, 2)]


def received_bytes(strategy: str, world_size: int, steps: int) -> tuple[int, int]:
    """Bytes received after ``steps`` steps, and those of the layers rank 0 does not own."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o) for i, o in SHAPES))
    impl = make_strategy(KFACConfig(strategy=strategy), Communicator.simulated(0, world_size))
    precond = KFACPreconditioner(model, strategy_impl=impl, inv_update_steps=1)
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(8, 5)).square().mean().backward()
        precond.step()
    owners = {layer.name: impl.owner(layer)  # type: ignore[attr-defined]
              for layer in precond.layers}
    others = sum(4 * layer.g_dim * layer.a_dim for layer in precond.layers
                 if owners[layer.name] != 0)
    return impl.buffer_bytes() - impl.communicator.peak_buffer_bytes, others


@pytest.mark.parametrize(("strategy", "world_size", "steps"),
                         [(name, 4, steps) for name in ("dp-kfac", "osawa") for steps in (1, 3)]
                         + [("mem-opt", 2, 3)])
def test_a_step_receives_every_other_ranks_gradients_once(strategy: str, world_size: int,
                                                          steps: int) -> None:
    """Several source ranks add up; the next step starts the count again."""
    received, others = received_bytes(strategy, world_size, steps)
    assert others > 0
    assert received == others
