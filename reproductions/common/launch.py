"""Process setup for entry points that run alone or under ``torchrun``.

``torchrun`` (and Slurm launch templates that call it) set ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads them and joins
the process group (NCCL on GPUs, gloo on CPUs). Run without them, it is a single process.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the run.

    Attributes:
        rank: Global rank, 0 .. world_size-1.
        world_size: Number of processes.
        local_rank: Rank on this node (selects the GPU).
        device: The device this process computes on.
        is_main: Whether this is rank 0 (which logs, writes results and checkpoints).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(device: str = "auto") -> DistContext:
    """Join the ``torchrun`` process group if there is one, and pick this process's device.

    With ``WORLD_SIZE`` > 1 the process group is initialised from the environment (NCCL when
    CUDA is available, else gloo), and each process uses one thread (``torch.set_num_threads(1)``
    and ``OMP_NUM_THREADS=1``): several processes with several threads each on shared cores make
    dense linear algebra hundreds of times slower.

    Args:
        device: ``"auto"`` (``cuda:<local_rank>`` when CUDA is available, else CPU), ``"cpu"``
            or ``"cuda"``.

    Returns:
        The :class:`DistContext`.

    Raises:
        ValueError: an unknown ``device`` or a malformed torchrun variable.
        RuntimeError: ``device="cuda"`` on a machine without CUDA.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but CUDA is not available here")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        chosen = torch.device("cuda", local_rank)
    else:
        chosen = torch.device("cpu")
    if world_size > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank,
                                    world_size=world_size)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=chosen,
                       is_main=rank == 0)


@contextmanager
def main_process_first(ctx: DistContext) -> Iterator[None]:
    """Run the enclosed block on rank 0 first, then on the other ranks.

    For building caches (tokenised data sets, vocabularies): rank 0 writes them while the others
    wait at a barrier, then the others find them ready instead of racing to write them too.
    """
    distributed = ctx.world_size > 1 and dist.is_initialized()
    if distributed and not ctx.is_main:
        dist.barrier()
    yield
    if distributed and ctx.is_main:
        dist.barrier()


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch (CPU and all CUDA devices).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cleanup() -> None:
    """Leave the process group, if this process joined one (call at the end of a run)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
