"""Exact resume and atomic checkpoints, end to end through ``python -m
reproductions.osawa2018.train``: a run SIGKILLed at a random step and resumed, and a run whose
newest checkpoint was truncated, both end bit-identical to the uninterrupted run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from reproductions.common.checkpoint import checkpoint_path
from reproductions.common.results import load_results
from reproductions.osawa2018.train import main
from tests.reliability.helpers import (
    SETTINGS,
    STEPS,
    assert_bit_identical,
    final_state,
    kill_group,
    newest_step,
    resumed_steps,
    start,
    train_args,
    wait_until,
)

SEED = 20260425
"""Seeds the choice of the step at which the run is killed."""


def step_losses(out: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of every logged update in ``out``'s results file."""
    return [(s["step"], s["loss"]) for s in load_results(out / "results.json")["steps"]]


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path: Path,
                                                               image_folder: Path,
                                                               uninterrupted: Path) -> None:
    kill_after = random.Random(SEED).randint(2, STEPS - 3)
    out = tmp_path / "run"
    args = ["-m", "reproductions.osawa2018.train", *train_args(out, image_folder)]
    process = start(args, tmp_path / "killed.log")
    checkpoints = out / "checkpoints" / "rank-0"
    try:
        wait_until(lambda: newest_step(checkpoints) >= kill_after, process,
                   f"a checkpoint of step {kill_after}")
    finally:
        kill_group(process)
    killed_at = newest_step(checkpoints)
    assert killed_at < STEPS, "the run must be killed before its end"

    resumed = start([*args, "--resume"], tmp_path / "resumed.log")
    try:
        assert resumed.wait(timeout=180) == 0, (tmp_path / "resumed.log").read_text()
    finally:
        kill_group(resumed)
    assert resumed_steps((tmp_path / "resumed.log").read_text()) == [killed_at]
    assert_bit_identical(final_state(out), final_state(uninterrupted))
    assert step_losses(out) == step_losses(uninterrupted)  # every step once, same losses
    assert load_results(out / "results.json")["finished"] is not None


def test_truncated_newest_checkpoint_warns_and_resume_uses_the_previous(
        tmp_path: Path, image_folder: Path, uninterrupted: Path) -> None:
    out = tmp_path / "run"
    main([*train_args(out, image_folder), "--max-steps", "6"])
    damaged = checkpoint_path(out / "checkpoints" / "rank-0", 6)
    damaged.write_bytes(damaged.read_bytes()[:1000])  # a crash or a bad copy cut it short
    with pytest.warns(RuntimeWarning, match=f"checkpoint {damaged} cannot be loaded"):
        main([*train_args(out, image_folder), "--resume"])
    assert_bit_identical(final_state(out), final_state(uninterrupted))
    assert step_losses(out) == step_losses(uninterrupted)


def test_resume_with_data_loading_workers_is_bit_identical(tmp_path: Path, image_folder: Path,
                                                           uninterrupted: Path) -> None:
    """Crops and flips run in 2 DataLoader worker processes, whose random streams are not
    checkpointed and which read other batches after a resume: each example's draws are seeded by
    its stream position, so the run stopped mid-epoch and resumed equals the uninterrupted run
    without workers."""
    settings = {**SETTINGS, "num_workers": 2}
    out = tmp_path / "run"
    main([*train_args(out, image_folder, settings=settings), "--max-steps", "5"])
    main([*train_args(out, image_folder, settings=settings), "--resume"])
    assert_bit_identical(final_state(out), final_state(uninterrupted))
    assert step_losses(out) == step_losses(uninterrupted)
