"""Resuming the BERT comparison: per-rank checkpoints on 2 processes, a torchrun restart that
resumes by itself, and results of a resumed run that count the steps before the resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reproductions.common.checkpoint import list_checkpoints
from reproductions.common.launch import run_local
from reproductions.mkor import bert


@pytest.mark.distributed
def test_kfac_on_two_processes_resumes_each_rank_from_its_own_checkpoint(
        run_args: list[str], tmp_path: Path) -> None:
    """K-FAC's comm-opt strategy keeps its rank in its state, so rank 1 cannot continue from
    rank 0's: each rank saves its own checkpoint and loads it back, and both continue from the
    newest step both saved (rank 1's newest is removed here, as if it died saving it)."""
    args = [*run_args, "--optimizers", "kfac", "--steps", "4", "--wandb", "disabled"]
    interrupted = run_local(bert.main, 2, [*args, "--stop-after", "3"], timeout=120)
    here = tmp_path / "out" / "tiny" / "kfac-s0" / "checkpoints"
    for rank in (0, 1):  # tiny.json checkpoints every 2 steps, and where a run stops
        assert [p.name for p in list_checkpoints(here / f"rank-{rank}")] == [
            "checkpoint-000000002.pt", "checkpoint-000000003.pt"]
    # Each rank draws its own dropout masks: the torch generators the ranks saved differ (they
    # were seeded alike, so every rank dropped the same units).
    saved = [torch.load(list_checkpoints(here / f"rank-{rank}")[-1], weights_only=True)
             for rank in (0, 1)]
    assert not torch.equal(saved[0]["rng"]["torch"], saved[1]["rng"]["torch"])
    list_checkpoints(here / "rank-1")[-1].unlink()
    resumed = run_local(bert.main, 2, [*args, "--resume"], timeout=120)
    for rank in (0, 1):
        (before,), (after,) = interrupted[rank], resumed[rank]
        assert after["finished"] and [s["step"] for s in after["steps"]] == [0, 1, 2, 3]
        assert after["steps"][:2] == before["steps"][:2]  # continued after step 2, not afresh
        assert after["steps"][2]["time_s"] != before["steps"][2]["time_s"]  # step 2 redone
        assert after["steps"][2]["loss"] == before["steps"][2]["loss"]
        assert after["ledger"]["grad_allreduce"]["collectives"] == 4  # this rank's, all steps
    losses = [[s["loss"] for s in r[0]["steps"]] for r in resumed]
    assert losses[0] == losses[1]  # the global mean, on either rank


def test_a_torchrun_restart_resumes_without_the_flag(
        run_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """After ``torchrun --max-restarts`` restarted the worker group (``restarts`` > 0), the
    command line it reruns has no ``--resume``: the run continues from its checkpoint instead of
    deleting it and starting afresh."""
    args = [*run_args, "--optimizers", "lamb", "--steps", "4", "--wandb", "disabled"]
    (before,) = bert.main([*args, "--stop-after", "2"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    (after,) = bert.main(args)
    assert after["finished"] and [s["step"] for s in after["steps"]] == [0, 1, 2, 3]
    assert after["steps"][:2] == before["steps"]  # the measured times of the first invocation
    assert "restart 1: tiny lamb: resuming from the checkpoint of step 2" in (
        capsys.readouterr().err)


def test_stage_times_of_a_resumed_run_include_the_steps_before_the_resume(
        run_args: list[str], tmp_path: Path) -> None:
    """K-FAC inverts only at step 0 here: an uninterrupted run reports that inversion's time,
    and so must a run resumed at step 2, which inverts nothing itself. The resumed run
    records the settings it was resumed with (a checkpoint interval may change)."""
    args = [*run_args, "--optimizers", "kfac", "--steps", "4", "--wandb", "disabled",
            "--set", "preconditioner.kfac.inv_update_steps=100"]
    bert.main([*args, "--stop-after", "2"])
    (resumed,) = bert.main([*args, "--set", "checkpoint_every=3", "--resume"])
    assert resumed["config"]["checkpoint_every"] == 3  # this invocation's, not the first's
    stages = resumed["optimizer_stage_time_s"]
    assert stages.get("inversion", 0.0) > 0.0
    assert all(stages[name] > 0.0 for name in ("factors", "precondition", "base_step"))


def test_checkpoints_of_the_layout_before_per_rank_ones_are_resumed(
        run_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run checkpointed before checkpoints moved to ``checkpoints/rank-<r>`` kept its files in
    ``checkpoints/``, where --resume no longer looked: it started over at step 0. One process
    adopts them; several refuse in one line (rank 0's state cannot resume the others)."""
    args = [*run_args, "--optimizers", "lamb", "--steps", "4", "--wandb", "disabled"]
    (before,) = bert.main([*args, "--stop-after", "2"])
    checkpoints = tmp_path / "out" / "tiny" / "lamb-s0" / "checkpoints"
    for path in list_checkpoints(checkpoints / "rank-0"):  # as the earlier layout had them
        path.rename(checkpoints / path.name)
    (checkpoints / "rank-0").rmdir()
    (after,) = bert.main([*args, "--resume"])
    assert [s["step"] for s in after["steps"]] == [0, 1, 2, 3]
    assert after["steps"][:2] == before["steps"]  # continued, not started over
    assert "moved 1 checkpoint(s) of the earlier layout" in capsys.readouterr().err
    ctx = bert.DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"),
                           is_main=True)
    (checkpoints / "checkpoint-000000009.pt").write_bytes(b"")
    with pytest.raises(bert.CheckpointError, match="saved by rank 0 alone"):
        bert.adopt_single_process_checkpoints(checkpoints, ctx)
