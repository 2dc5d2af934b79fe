"""Sharded parameters are refused with a message naming the fix, not preconditioned from one
rank's shard: FSDP2 (``fully_shard``: DTensor parameters) and FSDP1
(``FullyShardedDataParallel``: flat parameters), 2 gloo processes. Before, FSDP2's layers drew
the advice to register them as Linear layers, and FSDP1 hung (``use_orig_params=True``) or
failed deep in autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner
from core.batchnorm import BatchNormPreconditioner
from core.layers import UnsupportedLayerError
from reproductions.common.launch import run_local

pytestmark = pytest.mark.distributed

PRECONDITIONERS = {"kfac": KFACPreconditioner, "mkor": MKORPreconditioner,
                   "eva": EvaPreconditioner, "batchnorm": BatchNormPreconditioner}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _fully_sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear | nn.BatchNorm1d):
            fully_shard(layer)
    return fully_shard(model)


def _flat_sharded(use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(_model(), use_orig_params=use_orig_params,
                                    device_id=torch.device("cpu"))


def _built(build: type, model: nn.Module) -> str:
    try:
        build(model)
    except UnsupportedLayerError as err:
        return str(err)
    return "built"


def refusals() -> dict[str, str]:
    """Per sharding and preconditioner, the error when built on the sharded model; for K-FAC
    also the error when the model is sharded after the preconditioner was built (at the first
    step)."""
    out = {}
    for name, build in PRECONDITIONERS.items():
        out[f"fully_shard/{name}"] = _built(build, _fully_sharded())
        for orig in (True, False):
            out[f"FSDP(use_orig_params={orig})/{name}"] = _built(build, _flat_sharded(orig))
    from torch.distributed.fsdp import fully_shard

    model = _model()
    precond = KFACPreconditioner(model)
    fully_shard(model)
    model(torch.randn(6, 8)).pow(2).mean().backward()
    try:
        precond.step()
        out["fully_shard after building/kfac"] = "stepped"
    except UnsupportedLayerError as err:
        out["fully_shard after building/kfac"] = str(err)
    return out


def test_sharded_parameters_are_refused_naming_ddp() -> None:
    for result in run_local(refusals, 2, timeout=120):
        assert len(result) == 13
        for case, message in result.items():
            assert "shard" in message and "DistributedDataParallel" in message, (case, message)
        for name in ("kfac", "mkor", "eva"):
            assert result[f"fully_shard/{name}"].startswith(
                "0 (FSDPLinear) has sharded parameters"), result[f"fully_shard/{name}"]
        assert result["fully_shard/batchnorm"].startswith("1 (FSDPBatchNorm1d) has sharded")
        assert result["fully_shard after building/kfac"].startswith(
            "a Linear layer's gradient is sharded")
