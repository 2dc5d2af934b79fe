"""What differs on a GPU host, emulated on the CPU: device errors in the decompositions, and
which device a process picks where CUDA is available.

A CUDA out-of-memory error is a ``RuntimeError`` like LAPACK's failures, and a worker that
:func:`~reproductions.common.launch.run_local` joined to a gloo group, or a CPU-only
reproduction under ``torchrun``, still finds CUDA available; the CPU never shows either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core import KFACPreconditioner
from core.batchnorm import BatchNormPreconditioner
from core.config import KFACConfig
from core.distributed import Communicator
from core.distributed.strategies import make_strategy
from reproductions.common.launch import DistContext, init_distributed
from reproductions.dpkfac import train as dpkfac_train

#: The torch kernel a GPU's decomposition of each inverse method calls first.
GPU_KERNELS = {"eigen": "eigh", "inverse": "cholesky_ex", "cholesky": "cholesky_ex",
               "cholesky_solve": "cholesky_ex"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Tensor methods that bring a value to the host: on a GPU each waits for the device.
HOST_READS = ("__bool__", "__float__", "__int__", "item", "tolist")


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record every host read of a tensor's values in the block (what
    ``torch.cuda.set_sync_debug_mode`` reports on a GPU)."""
    reads: list[str] = []
    with monkeypatch.context() as patch:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def read(self: torch.Tensor, *args: Any, _name: str = name,
                     _original: Any = original) -> Any:
                reads.append(_name)
                return _original(self, *args)

            patch.setattr(torch.Tensor, name, read)
        yield reads


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, torch.AcceleratorError])
@pytest.mark.parametrize("method", sorted(GPU_KERNELS))
def test_a_device_error_in_a_decomposition_is_raised_not_taken_for_a_failure(
        monkeypatch: pytest.MonkeyPatch, method: str, error: type[RuntimeError]) -> None:
    """It was caught as a failure of the matrix: retried in fp64 (twice the memory), then the
    layer was left first-order with a warning, at every inversion, and the run went on."""
    monkeypatch.setattr("core.inverse.HOST_IN_PLACE", False)  # the GPU's kernels

    def device_error(*args: Any, **kwargs: Any) -> Any:
        raise error("CUDA out of memory. Tried to allocate 2.00 GiB" if error is
                    torch.OutOfMemoryError else "CUDA error: an illegal memory access")

    monkeypatch.setattr(torch.linalg, GPU_KERNELS[method], device_error)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    precond = KFACPreconditioner(model, inverse_method=method, damping=0.03)
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    with pytest.raises(error, match="CUDA"):
        precond.step()


def test_auto_device_of_a_worker_joined_to_gloo_is_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_local(fn, 2)`` joins gloo workers on the CPU; ``fn`` calling
    ``init_distributed()`` again (``reproductions.osawa2018.train.run``) picked
    ``cuda:<local rank>`` wherever CUDA was available: on a host with one GPU, rank 1's
    ``torch.cuda.set_device(1)`` failed (invalid device ordinal); with more, the model went to
    the GPU under a gloo group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def one_gpu(index: int) -> None:
        if index:
            raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", one_gpu)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = init_distributed()
    finally:
        dist.destroy_process_group()
    assert ctx.device == torch.device("cpu")


def test_dpkfac_training_stays_on_the_cpu_where_cuda_is_available(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Its model, data and sums over workers are CPU tensors; ``init_distributed()`` chose
    CUDA, and so NCCL under ``torchrun``, whose collectives refuse CPU tensors."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    contexts: list[DistContext] = []

    def train_one(name: str, config: Any, ctx: DistContext, **options: Any) -> dict[str, Any]:
        contexts.append(ctx)
        return {}

    monkeypatch.setattr(dpkfac_train, "train_one", train_one)
    dpkfac_train.run(["sgd"], None, tmp_path, tmp_path, None, "disabled")  # type: ignore[arg-type]
    assert [ctx.device for ctx in contexts] == [torch.device("cpu")]


def test_batchnorm_preconditioning_reads_the_device_once_per_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer's finiteness check was a host read of its own: on a GPU, a wait for the
    device at every BatchNorm layer (53 in a ResNet-50), every step."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1), *(nn.BatchNorm2d(4) for _ in range(4))]
    model = nn.Sequential(*layers)
    bn = BatchNormPreconditioner(model, update_steps=2)
    x = torch.randn(4, 3, 5, 5)
    for _ in range(2):
        model.zero_grad()
        model(x).square().mean().backward()
        with host_reads(monkeypatch) as reads:
            bn.step()
    assert bn.last_preconditioned == 4
    assert len(reads) == 1  # the step without an update: the check of all four at once


def test_reduced_factors_are_checked_in_one_host_read_per_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the batch factors are reduced across ranks (rank 0 of a simulated world of two),
    every layer's are alive when they are blended, and their finiteness checks are read for
    all layers at once: one read per layer was a wait for a GPU at every layer, every step."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(4)))
    config = KFACConfig(strategy="comm-opt", inv_update_steps=10)
    precond = KFACPreconditioner(model, config, strategy_impl=make_strategy(
        config, Communicator.simulated(0, 2)))
    blends = []
    original = precond._update_running_factors

    def counted(decay: float) -> None:
        with host_reads(monkeypatch) as reads:
            original(decay)
        blends.append(len(reads))

    monkeypatch.setattr(precond, "_update_running_factors", counted)
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        precond.step()
    assert blends == [1, 1]
    assert all(layer.has_factors for layer in precond.layers)
