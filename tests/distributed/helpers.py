"""Spawning gloo worker processes for tests, and the tiny model and data they train on."""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

#: Global batch shared by every test; rank ``r`` of ``P`` trains on rows ``r·8/P … (r+1)·8/P``.
GLOBAL_BATCH = 8


class TinyNet(nn.Module):
    """Conv (bias) → Linear (bias) → Linear (no bias); optionally a layer that is never used.

    Factor dimensions ``(a, g)``: conv ``(19, 3)``, fc1 ``(49, 6)``, fc2 ``(6, 4)``; unused
    ``(4, 3)``. Trainable parameters used in the forward pass: 375.
    """

    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc1 = nn.Linear(48, 6)
        self.fc2 = nn.Linear(6, 4, bias=False)
        self.unused = nn.Linear(3, 3) if with_unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(x)))


LAYER_DIMS = {"conv": (19, 3), "fc1": (49, 6), "fc2": (6, 4)}
USED_PARAMS = 375


def make_model(with_unused: bool = False) -> TinyNet:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return TinyNet(with_unused)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, labels), identical in every process."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=generator)
    y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)
    return x, y


def local_rows(rank: int, world_size: int) -> slice:
    """This rank's rows of the global batch."""
    b = GLOBAL_BATCH // world_size
    return slice(rank * b, (rank + 1) * b)


def _entry(rank: int, fn: Callable[..., Any], world_size: int, tmp: str,
           args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args, **kwargs)
        with open(os.path.join(tmp, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # every rank done with its collectives before the groups go
        gc.collect()  # and the objects holding them collected (as launch.cleanup() does)
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0,
                **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` gloo processes and
    return their results (picklable), by rank.

    Workers run with one OpenMP thread (``eigh`` slows down hundreds of times when threads
    oversubscribe the cores). A worker's exception fails the call with its traceback; a hang
    fails it after ``timeout`` seconds, killing the workers.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_entry, args=(fn, world_size, tmp, args, kwargs),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=5.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} processes hung for "
                                   f"{timeout} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
