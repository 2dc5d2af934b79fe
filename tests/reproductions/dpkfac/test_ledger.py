"""The tables' simulated ledgers and per-worker work equal a real 4-process run's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from core import KFACPreconditioner
from core.distributed import average_gradients, simulate
from reproductions.common.launch import run_local
from reproductions.dpkfac.train import fashion_cnn
from reproductions.dpkfac.workloads import SCHEMES, Scheme

WORLD = 4


def one_step(schemes: list[Scheme]) -> dict[str, dict[str, Any]]:
    """One K-FAC step per scheme on this rank's 8 images; its ledger and work."""
    rank = dist.get_rank()
    out = {}
    for scheme in schemes:
        torch.manual_seed(0)
        model = fashion_cnn()
        precond = KFACPreconditioner(model, strategy=scheme.strategy, **scheme.options,
                                     factor_scaling="dpkfac")
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(8, 1, 28, 28, generator=generator)
        y = torch.randint(0, 10, (8,), generator=generator)
        F.cross_entropy(model(x), y).backward()
        average_gradients(model.parameters(), precond.strategy.communicator)
        precond.step()
        out[scheme.label] = {
            "ledger": [e.as_tuple() for e in precond.strategy.communicator.ledger.entries],
            "captured": tuple(layer.name for layer in precond.layers if layer.has_factors),
            "memory": precond.memory_usage(),
        }
    return out


@pytest.mark.distributed
def test_simulated_ledger_equals_a_real_four_process_run() -> None:
    real = run_local(one_step, WORLD, list(SCHEMES), timeout=240)
    model = fashion_cnn()
    for scheme in SCHEMES:
        report = simulate(model, scheme.strategy, WORLD, factor_scaling="dpkfac",
                          **scheme.options)
        for rank, simulated in enumerate(report.ranks):
            got = real[rank][scheme.label]
            assert [e.as_tuple() for e in simulated.ledger.entries] == got["ledger"], (
                scheme.label, rank)
            assert simulated.captured == got["captured"], (scheme.label, rank)
            for key in ("factors", "inverses"):
                assert simulated.memory[key] == got["memory"][key], (scheme.label, rank, key)
    dp = simulate(model, "dp-kfac", WORLD, assignment="round-robin")
    assert [r.captured for r in dp.ranks] == [("0",), ("3",), ("6",), ("10",)]
