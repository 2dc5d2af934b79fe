"""Process setup for entry points that run alone or under ``torchrun``.

``torchrun`` (and Slurm launch templates that call it) set ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads them and joins
the process group (NCCL on GPUs, gloo on CPUs). Run without them, it is a single process.
:func:`run_local` starts such processes on this machine without ``torchrun`` (an entry point's
``--workers N``, tests). Under ``torchrun --max-restarts N`` a failed worker makes the agent
restart the whole group with ``TORCHELASTIC_RESTART_COUNT`` raised by one;
:attr:`DistContext.restarts` reports it, so entry points resume from their checkpoints then.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import random
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.config import ConfigError, check_choice
from reproductions.common.errors import USER_ERRORS, WorkerError


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the run.

    Attributes:
        rank: Global rank, 0 .. world_size-1.
        world_size: Number of processes.
        local_rank: Rank on this node (selects the GPU).
        device: The device this process computes on.
        is_main: Whether this is rank 0 (which logs, writes results and checkpoints).
        restarts: How often ``torchrun`` has restarted the worker group (0 on the first attempt
            and without ``torchrun``); after a restart the run continues from its checkpoints.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    restarts: int = 0


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
    dense linear algebra hundreds of times slower. The group's keys in the rendezvous store are
    prefixed by the ``torchrun`` attempt: the elastic agent keeps one store across restarts, and
    a restarted group reading the failed attempt's addresses would connect to dead workers.

    Args:
        device: ``"auto"`` (``cuda:<local_rank>`` when CUDA is available, else CPU; in a
            process that has joined a group already, such as a :func:`run_local` worker, the
            device of that group's backend: CUDA with NCCL, else CPU), ``"cpu"`` or ``"cuda"``.

    Returns:
        The :class:`DistContext`.

    Raises:
        ConfigError: an unknown ``device``, or ``"cuda"`` on a machine without CUDA (the entry
            points report it in one line).
        ValueError: a malformed torchrun variable.
    """
    check_choice("device", device, ("auto", "cpu", "cuda"))
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if device == "auto" and dist.is_available() and dist.is_initialized():
        device = "cuda" if "nccl" in dist.get_backend() else "cpu"
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device", device, "cpu or auto: no CUDA device here")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        chosen = torch.device("cuda", local_rank)
    else:
        chosen = torch.device("cpu")
    restarts = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if world_size > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        if not dist.is_initialized():
            store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size))
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank,
                                    world_size=world_size,
                                    store=dist.PrefixStore(f"attempt-{restarts}", store))
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=chosen,
                       is_main=rank == 0, restarts=restarts)


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


def finished() -> None:
    """Wait, at the normal end of a run, until every rank has finished with every group, so
    none tears its groups down (:func:`cleanup`) while another's collectives or gloo threads
    still run (a rank could abort at exit: "terminate called without an active exception").
    Not for error paths: a rank that failed would never arrive."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def cleanup() -> None:
    """Leave the process group, if this process joined one (call at the end of a run).

    Objects that hold groups or their work (a strategy's subgroups, DDP's reducer, the frames
    of an exception caught on the way out) are collected first, while the groups still exist:
    left to the interpreter's exit, their destructors met torn-down groups and the process
    aborted ("terminate called without an active exception").
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Have the kernel end this process when its parent dies (Linux; elsewhere nothing): a
    launcher killed by a signal cannot stop its workers itself."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _local_entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out: str,
                 device: str, args: tuple[Any, ...]) -> None:
    _die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    init_distributed(device)
    try:
        result = fn(*args)
    except (ConfigError, *USER_ERRORS) as exc:  # the launcher reports it in one line
        result = WorkerError(f"rank {rank}: {exc}")
        # Written before the group is left: the other ranks then fail in their next
        # collective, and the launcher must find this message rather than theirs.
        _write_result(out, rank, result)
        cleanup()
        return
    except BaseException:
        cleanup()
        raise
    cleanup()
    _write_result(out, rank, result)


def _write_result(out: str, rank: int, result: Any) -> None:
    """This rank's result, written whole or not at all (the launcher may read it while the
    other ranks still run, to find a user error)."""
    final = Path(out) / f"result{rank}.pkl"
    partial = final.with_suffix(".tmp")
    with open(partial, "wb") as handle:
        pickle.dump(result, handle)
    os.replace(partial, final)


def _worker_error(out: str, world_size: int) -> WorkerError | None:
    """The lowest rank's :class:`WorkerError` among the results written so far, if any."""
    for rank in range(world_size):
        path = Path(out) / f"result{rank}.pkl"
        if path.exists():
            with open(path, "rb") as handle:
                result = pickle.load(handle)
            if isinstance(result, WorkerError):
                return result
    return None


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
              timeout: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` local processes joined as ``torchrun`` would join them.

    Each process gets the ``torchrun`` variables, one thread, and the process group of
    :func:`init_distributed` (left again when ``fn`` returns), so code written for ``torchrun``
    runs unchanged. ``fn`` must be importable (a module-level function) and its arguments and
    result picklable.

    Args:
        fn: The function each process runs.
        world_size: Number of processes.
        *args: Passed to ``fn`` in every process.
        device: Passed to :func:`init_distributed` (``"cpu"``: gloo).
        timeout: Seconds before hung processes are killed and TimeoutError is raised.

    Returns:
        ``fn``'s result in each process, by rank.

    Raises:
        WorkerError: a process raised a configuration error or one of
            :data:`~reproductions.common.errors.USER_ERRORS` (the lowest rank's message).
        torch.multiprocessing.ProcessRaisedException: a process raised anything else (with its
            traceback).
        TimeoutError: the processes did not finish within ``timeout``.
    """
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_once(fn, world_size, args, device, timeout)
        except mp.ProcessRaisedException as exc:
            # The port was free when chosen and taken before rank 0 bound it (another job):
            # nothing ran yet, as no rank gets past the rendezvous without rank 0's store.
            if not _port_taken(exc) or attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3
"""Launches :func:`run_local` tries, each on a fresh port, when the port it chose was taken."""


def _port_taken(exc: BaseException) -> bool:
    text = str(exc)
    return "EADDRINUSE" in text or "Address already in use" in text


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], device: str,
              timeout: float | None) -> list[Any]:
    """One launch of :func:`run_local` on a fresh port."""
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _local_entry, args=(fn, world_size, _free_port(), out, device, args),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not context.join(timeout=2.0):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} "
                                       f"processes did not finish in {timeout} s")
        except mp.ProcessRaisedException:
            # A rank with a user error leaves first; the others then fail in a collective.
            error = _worker_error(out, world_size)
            if error is not None:
                raise error from None
            raise
        finally:  # on any way out (an error, a timeout, Ctrl-C) no worker is left running
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
        error = _worker_error(out, world_size)
        if error is not None:
            raise error
        results = []
        for rank in range(world_size):
            with open(Path(out) / f"result{rank}.pkl", "rb") as handle:
                results.append(pickle.load(handle))
        return results
