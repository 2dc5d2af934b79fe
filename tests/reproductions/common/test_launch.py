"""torchrun environment handling, seeding, and a real two-process gloo group."""

from __future__ import annotations

import os
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.config import ConfigError
from reproductions.common.checkpoint import CheckpointError
from reproductions.common.errors import WorkerError
from reproductions.common.launch import cleanup, init_distributed, seed_everything

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_single_process_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    ctx = init_distributed(device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.device.type) == (0, 1, True, "cpu")
    assert not dist.is_initialized()
    cleanup()  # nothing to leave: no error


def test_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="device"):
        init_distributed(device="tpu")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        init_distributed(device="cpu")


def test_seed_everything_repeats() -> None:
    seed_everything(7)
    first = (random.random(), torch.rand(2).tolist())
    seed_everything(7)
    assert (random.random(), torch.rand(2).tolist()) == first


def _worker(rank: int, port: int, results: dict) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_distributed(device="cpu")
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    results[rank] = (ctx.is_main, value.item(), torch.get_num_threads(),
                     os.environ["OMP_NUM_THREADS"])
    cleanup()


@pytest.mark.distributed
def test_two_processes_join_a_gloo_group() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, results), nprocs=2, join=True)
        assert dict(results) == {0: (True, 3.0, 1, "1"), 1: (False, 3.0, 1, "1")}


def _rank_sum(offset: float) -> tuple[int, float, int]:
    value = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(value)
    return dist.get_rank(), value.item(), torch.get_num_threads()


@pytest.mark.distributed
def test_run_local_returns_each_rank_result() -> None:
    from reproductions.common.launch import run_local

    assert run_local(_rank_sum, 2, 1.0, timeout=120) == [(0, 3.0, 1), (1, 3.0, 1)]


def _bad_setting(rank: int) -> None:
    if rank == 1:
        raise CheckpointError("the checkpoint in runs/x was saved by a run with other settings")
    raise ConfigError("lr", -1, "a number >= 0")


def test_a_user_error_in_a_worker_reaches_the_launcher_as_one_line() -> None:
    """A worker's configuration or file error comes back as a :class:`WorkerError` carrying the
    lowest rank's message (which the entry points print in one line), not a traceback."""
    from reproductions.common.launch import run_local

    with pytest.raises(WorkerError, match=r"^rank 0: invalid lr=-1: expected a number >= 0$"):
        run_local(_bad_setting_by_rank, 2, timeout=120)


def _bad_setting_by_rank() -> None:
    _bad_setting(int(os.environ["RANK"]))


def _finish_late() -> float:
    """Rank 1 reaches the end half a second later; the seconds rank 0 waited in finished()."""
    import time

    from reproductions.common.launch import finished

    if int(os.environ["RANK"]) == 1:
        time.sleep(0.5)
    start = time.monotonic()
    finished()
    return time.monotonic() - start


def test_finished_waits_for_every_rank_and_is_free_alone() -> None:
    from reproductions.common.launch import finished, run_local

    waited = run_local(_finish_late, 2, timeout=120)
    assert waited[0] >= 0.4 > waited[1]
    finished()  # no process group: nothing to wait for
