"""Elastic restart: under ``torchrun --max-restarts=1`` with 2 gloo workers, SIGKILL one worker
mid-run; torchrun restarts the group, the entry point resumes from its checkpoints by itself (no
``--resume``), and the job ends exactly where an uninterrupted 2-worker job ends."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from reproductions.common.results import load_results
from tests.reliability.helpers import (
    STEPS,
    TIMEOUT_S,
    assert_bit_identical,
    child_env,
    final_state,
    kill_group,
    newest_step,
    resumed_steps,
    start,
    train_args,
    wait_until,
)

pytestmark = pytest.mark.distributed

SEED = 20260426
"""Seeds the choice of the step after which a worker is killed."""


def torchrun_args(out: Path, folder: Path) -> list[str]:
    """A 2-worker gloo job on loopback with one restart allowed (no ``--resume``); the
    rendezvous store binds a free port itself (``--standalone``)."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "--max-restarts=1", "--local-addr=127.0.0.1", "-m", "reproductions.osawa2018.train",
            *train_args(out, folder)]


def worker_of_rank(agent: int, rank: int) -> int | None:
    """The pid of the agent's child process whose environment says ``RANK=<rank>``."""
    for children in Path(f"/proc/{agent}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # it just ended
                continue
            if f"RANK={rank}".encode() in environ:
                return int(pid)
    return None


def test_killed_worker_is_restarted_and_the_job_ends_as_an_uninterrupted_one(
        tmp_path: Path, image_folder: Path) -> None:
    env = child_env(LOGLEVEL="INFO")
    reference = start(torchrun_args(tmp_path / "reference", image_folder),
                      tmp_path / "reference.log", env)
    faulted_out = tmp_path / "faulted"
    faulted = start(torchrun_args(faulted_out, image_folder), tmp_path / "faulted.log", env)
    kill_after = random.Random(SEED).randint(2, STEPS - 3)
    try:
        rank1 = faulted_out / "checkpoints" / "rank-1"
        wait_until(lambda: newest_step(rank1) >= kill_after, faulted,
                   f"rank 1's checkpoint of step {kill_after}")
        victim = worker_of_rank(faulted.pid, 1)
        assert victim is not None, "rank 1's worker is not a child of the torchrun agent"
        os.kill(victim, signal.SIGKILL)
        killed_at = newest_step(rank1)
        assert faulted.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "faulted.log").read_text()
        assert reference.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "reference.log").read_text()
    finally:
        kill_group(faulted)
        kill_group(reference)
    assert killed_at < STEPS
    log = (tmp_path / "faulted.log").read_text()
    assert "will restart worker group" in log, log
    assert "restart 1: resuming from the checkpoint of step" in log, log
    (resumed,) = resumed_steps(log)  # without --resume: the restart alone makes it resume
    assert killed_at - 1 <= resumed <= killed_at  # rank 0 may not have saved rank 1's newest yet
    for rank in (0, 1):  # BatchNorm statistics are per rank (DDP broadcasts rank 0's before use)
        assert_bit_identical(final_state(faulted_out, rank),
                             final_state(tmp_path / "reference", rank))
    steps = [(s["step"], s["loss"]) for s in load_results(faulted_out / "results.json")["steps"]]
    reference_steps = [(s["step"], s["loss"])
                       for s in load_results(tmp_path / "reference" / "results.json")["steps"]]
    assert [step for step, _ in steps] == list(range(1, STEPS + 1)), "no step lost or repeated"
    assert steps == reference_steps
