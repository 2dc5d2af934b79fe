"""FSDP2-sharded parameters (DTensor) are refused with a message naming the fix, not
preconditioned from one rank's shard: 2 gloo processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner
from core.layers import UnsupportedLayerError
from reproductions.common.launch import run_local

pytestmark = pytest.mark.distributed

PRECONDITIONERS = {"kfac": KFACPreconditioner, "mkor": MKORPreconditioner,
                   "eva": EvaPreconditioner}


def _sharded_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def refusals() -> dict[str, str]:
    """Per preconditioner, the error when built on a sharded model; for K-FAC also the error
    when the model is sharded after the preconditioner was built (at the first step)."""
    out = {}
    for name, kind in PRECONDITIONERS.items():
        try:
            kind(_sharded_model())
            out[name] = "built"
        except UnsupportedLayerError as err:
            out[name] = str(err)
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    precond = KFACPreconditioner(model)
    fully_shard(model)
    model(torch.randn(6, 8)).pow(2).mean().backward()
    try:
        precond.step()
        out["kfac-after"] = "stepped"
    except UnsupportedLayerError as err:
        out["kfac-after"] = str(err)
    return out


def test_sharded_parameters_are_refused_naming_ddp() -> None:
    for result in run_local(refusals, 2, timeout=120):
        for name, message in result.items():
            assert "sharded" in message and "DistributedDataParallel" in message, (name, message)
        for name in PRECONDITIONERS:
            assert result[name].startswith("0 (FSDPLinear) has sharded parameters"), result[name]
