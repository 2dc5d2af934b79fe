"""torchrun environment handling, seeding, and a real two-process gloo group."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

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


def test_cuda_without_cuda_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a RuntimeError, which the entry points' one-line error handling let through as
    a traceback; a ConfigError names the option and the fix."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"invalid device='cuda': expected cpu or auto: no CUDA"):
        init_distributed(device="cuda")
    with pytest.raises(ConfigError, match="device"):
        init_distributed(device="tpu")


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


def test_a_port_taken_between_choosing_and_binding_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is free when chosen and bound by rank 0 later; a job taking it in between
    made the launch fail with EADDRINUSE."""
    from reproductions.common import launch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        chosen = launch._free_port
        monkeypatch.setattr(launch, "_free_port", lambda: next(ports, None) or chosen())
        assert launch.run_local(_rank_sum, 2, 1.0, timeout=120) == [(0, 3.0, 1), (1, 3.0, 1)]


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


def _user_error_on_rank_one() -> None:
    """Rank 1 cannot read its checkpoint; rank 0 goes on into a collective, which then fails."""
    if int(os.environ["RANK"]) == 1:
        raise CheckpointError("rank 1's checkpoint is damaged")
    dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1))


def test_a_user_error_on_one_rank_is_reported_not_the_others_broken_collective() -> None:
    """The failing rank left its group before writing its message, so the launcher raised the
    other rank's "Connection closed by peer" traceback instead of the one-line error."""
    from reproductions.common.launch import run_local

    with pytest.raises(WorkerError, match=r"^rank 1: rank 1's checkpoint is damaged$"):
        run_local(_user_error_on_rank_one, 2, timeout=120)


def _sleep_forever(pids: str | None = None) -> None:
    """Write this worker's process id into ``pids`` (a folder), then sleep. The file appears
    whole (written aside, then renamed): a reader polling the folder saw an empty one."""
    import time

    if pids is not None:
        partial = Path(pids) / f".{os.environ['RANK']}.partial"
        partial.write_text(str(os.getpid()))
        partial.rename(Path(pids) / os.environ["RANK"])
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(
        f"/proc/{pid}/stat").read_text()


def test_workers_do_not_outlive_the_launcher(tmp_path: Path) -> None:
    """A launcher stopped by a timeout, or killed by a signal, left its workers running on."""
    import signal
    import subprocess
    import sys
    import time

    from reproductions.common.launch import run_local

    with pytest.raises(TimeoutError):
        run_local(_sleep_forever, 2, timeout=3)
    deadline = time.monotonic() + 30  # killed, and gone once the kernel has reaped them
    while [c for c in mp.active_children() if c.is_alive()] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [c for c in mp.active_children() if c.is_alive()]
    if not sys.platform.startswith("linux"):
        return
    # Started as a shell's background job is: SIGINT ignored, which the workers inherit, so
    # the SIGINT PyTorch's spawn asks the kernel to send them at their parent's death is lost.
    launcher = subprocess.Popen(
        [sys.executable, "-c", "from reproductions.common.launch import run_local; "
         "from tests.reproductions.common.test_launch import _sleep_forever; "
         f"run_local(_sleep_forever, 2, {str(tmp_path)!r})"],
        cwd=Path(__file__).resolve().parents[3],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    def written() -> list[Path]:
        return [f for f in tmp_path.iterdir() if not f.name.startswith(".")]

    deadline = time.monotonic() + 120
    while len(written()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(f.read_text()) for f in written()]
    assert len(pids) == 2, "the workers did not start"
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


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
