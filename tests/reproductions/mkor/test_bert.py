"""The entry point: a 3-step run of each optimizer, results schema, W&B, resume, --help."""

from __future__ import annotations

import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from reproductions.common.launch import run_local
from reproductions.common.results import load_results
from reproductions.common.tracking import read_offline_history
from reproductions.mkor import bert
from reproductions.mkor.config import field_help
from tests.reliability.test_bad_input import (
    Parsed,
    assert_clear_error,
    assert_data_error,
    invoke,
)

OPTIMIZERS = ["lamb", "kfac", "mkor", "mkor-h", "eva"]


def test_three_steps_of_each_optimizer(run_args: list[str], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    runs = bert.main([*run_args, "--wandb", "auto"])
    assert [r["optimizer"] for r in runs] == OPTIMIZERS
    out = capsys.readouterr().out
    assert "| optimizer | steps | final loss |" in out
    for name in OPTIMIZERS:
        here = tmp_path / "out" / "tiny" / f"{name}-s0"
        results = load_results(here / "results.json")  # validates the schema
        assert [s["step"] for s in results["steps"]] == [0, 1, 2]
        assert all(math.isfinite(s["loss"]) and s["time_s"] > 0 for s in results["steps"])
        assert [e["step"] for e in results["evals"]] == [1, 2]
        assert results["finished"] and results["summary"]["steps"] == 3
        assert results["config"]["optimizer"] == name and results["hardware"]["cuda"] is None
        assert results["optimizer_stage_time_s"]["base_step"] > 0
        assert results["memory"]["first_order_state"] > 0
        assert f"| {name} | 3 |" in out
        assert (here / "model" / "config.json").is_file()
        wandb = results["wandb"]
        assert (wandb["project"], wandb["group"], wandb["name"], wandb["mode"]) == (
            "kfac-repro-mkor", "tiny", f"tiny-{name}-0", "offline")
        run_dir = next((tmp_path / "out" / "tiny" / "wandb").glob(f"offline-run-*-{wandb['id']}"))
        history = read_offline_history(run_dir, wait_s=30)  # W&B may still be writing it
        assert [h["train/loss"] for h in history if "train/loss" in h] == [
            s["loss"] for s in results["steps"]]
    second_order = load_results(tmp_path / "out" / "tiny" / "mkor-s0" / "results.json")
    assert second_order["optimizer_stage_time_s"]["precondition"] > 0
    assert second_order["memory"]["preconditioner_state"] > 0
    hybrid = load_results(tmp_path / "out" / "tiny" / "mkor-h-s0" / "results.json")
    assert hybrid["summary"]["switched_to_first_order_at_step"] == 2  # tiny.json's eager rule
    assert [s["second_order"] for s in hybrid["steps"]] == [1.0, 0.0, 0.0]


def test_resume_gives_the_same_losses(run_args: list[str], tmp_path: Path) -> None:
    common = [*run_args, "--steps", "4", "--wandb", "disabled"]
    whole = bert.main([*common, "--out", str(tmp_path / "whole")])
    split = [*common, "--out", str(tmp_path / "split")]
    interrupted = bert.main([*split, "--stop-after", "2"])
    assert all(len(r["steps"]) == 2 and not r["finished"] for r in interrupted)
    resumed = bert.main([*split, "--resume"])
    for a, b in zip(whole, resumed, strict=True):
        assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]], a["optimizer"]
        assert [e["loss"] for e in a["evals"]] == [e["loss"] for e in b["evals"]]
        assert len(b["steps"]) == 4 and b["finished"]


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_finished_runs_lost_results_file_is_rebuilt_from_its_checkpoint_on_resume(
        run_args: list[str], tmp_path: Path, damage: str) -> None:
    """A finished run whose results file was cut short stopped ``--resume`` with a fix that
    could not work (restore it from git: runs/ is not kept there; rerun: that drops the
    checkpoints), and one resumed without the file ran no step and never wrote it again. Its
    final checkpoint holds the results: the file is written again, as it was."""
    common = [*run_args, "--optimizers", "lamb", "--steps", "2", "--wandb", "disabled"]
    bert.main(common)
    path = tmp_path / "out" / "tiny" / "lamb-s0" / "results.json"
    before = load_results(path)
    if damage == "truncated":
        path.write_text(path.read_text()[:100])
        with pytest.warns(UserWarning, match="not valid JSON.*continues from its newest "
                                             "checkpoint"):
            bert.main([*common, "--resume"])
    else:
        path.unlink()
        bert.main([*common, "--resume"])
    assert load_results(path) == before


def test_resume_refuses_a_run_of_other_settings(run_args: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume`` with another learning rate stops in one line naming it, for an unfinished
    run (its checkpoint) and for a finished one (its results file, otherwise returned as is)."""
    common = [*run_args, "--optimizers", "lamb", "--steps", "3", "--wandb", "disabled"]
    bert.main([*common, "--stop-after", "1"])
    for _ in range(2):
        with pytest.raises(SystemExit) as info:
            bert.main([*common, "--resume", "--lr", "0.5"])
        assert info.value.code == 1
        assert "other settings (lr: " in capsys.readouterr().err
        bert.main([*common, "--resume"])  # the same settings: continues, then finds it finished


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bert.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--config", "--optimizers", "--corpus", "--resume", "--stop-after", "--wandb",
                 "--set", "--init-checkpoint", "--precision", "--data-dir"):
        assert flag in text
    for name, _, _ in field_help():
        assert name in text


def test_bad_overrides_name_the_field(run_args: list[str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    for extra, field in ((["--set", "lerning_rate=0.1"], "lerning_rate"),
                         (["--optimizers", "lamb,adam"], "optimizers"),
                         (["--optimizers", "lamb,lamb"], "optimizers"),  # ran LAMB twice
                         (["--set", "eval_fraction=1"], "eval_fraction")):  # no training text
        with pytest.raises(SystemExit) as info:  # argparse's exit: status 2, one line
            bert.main([*run_args, *extra])
        assert info.value.code == 2
        assert f"error: invalid {field}" in capsys.readouterr().err


@pytest.mark.parametrize(("lines", "tokenizer", "says"), [
    (25, "wordpiece", "an example on each side of the train/held-out split"),
    (1, "wordpiece", "a line on each side of the train/held-out split"),
    (25, "empty folder", "in the folder"),
])
def test_an_unusable_corpus_or_tokenizer_ends_in_one_line(
        run_args: list[str], tmp_path: Path, lines: int, tokenizer: str, says: str) -> None:
    """A corpus too small for an example on each side of the split, one of one line, and an
    empty --tokenizer folder each ended in a traceback (ours, datasets', transformers')."""
    small = tmp_path / "small.txt"
    small.write_text("".join(f"fox jumps {i} over\n" for i in range(lines)), encoding="utf-8")
    if tokenizer == "empty folder":
        tokenizer = str(tmp_path / "tokenizer")
        Path(tokenizer).mkdir()
    argv = [*run_args, "--optimizers", "lamb", "--wandb", "disabled", "--corpus", str(small),
            "--tokenizer", tokenizer]
    assert_data_error(*invoke(bert.main, argv), says)


def test_cuda_without_cuda_ends_in_one_line(run_args: list[str], monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``--device cuda`` on a machine without CUDA was a RuntimeError traceback from
    init_distributed; argparse refuses it now."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        bert.main([*run_args, "--device", "cuda"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(
        "error: argument --device: 'cuda': no CUDA device here; use cpu")


def test_an_out_that_cannot_be_created_is_refused_before_training(run_args: list[str],
                                                                    tmp_path: Path) -> None:
    """A regular file in the place of --out ended in a traceback once a run wrote to it."""
    blocked = tmp_path / "afile"
    blocked.write_text("")
    never_run = mock.patch.object(bert, "_compare", side_effect=Parsed)
    outcome, stderr = invoke(bert.main, [*run_args, "--out", str(blocked)], never_run)
    assert_clear_error(outcome, stderr, set())
    assert f"invalid --out='{blocked}'" in stderr and "is not a directory" in stderr


@pytest.mark.distributed
def test_two_processes_like_torchrun(run_args: list[str], tmp_path: Path) -> None:
    args = [*run_args, "--optimizers", "lamb,kfac,mkor", "--wandb", "disabled"]
    per_rank = run_local(bert.main, 2, args, timeout=300)
    assert [[s["loss"] for s in r["steps"]] for r in per_rank[0]] == [
        [s["loss"] for s in r["steps"]] for r in per_rank[1]]  # the loss is the global mean
    for name, stages in (("lamb", set()), ("kfac", {"factor_comm", "inverse_comm"}),
                         ("mkor", {"factor_comm"})):
        results = load_results(tmp_path / "out" / "tiny" / f"{name}-s0" / "results.json")
        assert results["hardware"]["world_size"] == 2
        ledger = results["ledger"]
        assert set(ledger) == stages | {"grad_allreduce"}, name
        assert ledger["grad_allreduce"]["collectives"] == 3
        assert all(totals["traffic_bytes"] > 0 for totals in ledger.values())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision(run_args: list[str], precision: str) -> None:
    """The GPU's autocast paths, exercised with CPU autocast (fp16 with loss scaling)."""
    runs = bert.main([*run_args, "--optimizers", "lamb,kfac,mkor", "--precision", precision,
                      "--wandb", "disabled"])
    for results in runs:
        assert results["finished"] and all(math.isfinite(s["loss"]) for s in results["steps"])


def test_poly_schedule_is_nvidias_decay_from_the_start_of_training() -> None:
    """``lr · p / warmup`` during the warm-up, ``lr · (1 − p)^power`` after it, ``p`` the
    fraction of all steps done counting the current one (NVIDIA's PolyWarmUpScheduler, not
    transformers')."""
    from dataclasses import replace

    import torch

    from core import build_optimizer
    from reproductions.mkor.config import load_config

    cfg = replace(load_config("tiny"), steps=100, warmup=0.1, poly_power=0.5, lr=1.0,
                  schedule="poly")
    optimizer = build_optimizer("lamb", torch.nn.Linear(2, 2), lr=1.0)
    scheduler = bert.make_scheduler(cfg, optimizer)
    seen = {}
    for step in range(100):
        seen[step] = optimizer.param_groups[0]["lr"]
        optimizer.base.step()
        scheduler.step()
    # update k at p = (k + 1) / steps, as NVIDIA's scheduler (stepped before the optimizer)
    # gives it: the first update was at rate 0, one step behind
    assert seen[0] == pytest.approx(0.1) and seen[4] == pytest.approx(0.5)
    assert seen[9] == pytest.approx(0.9**0.5) and seen[54] == pytest.approx(0.45**0.5)
    assert seen[99] == 0.0
