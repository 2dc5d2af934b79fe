"""M5 and M6 in small (reproductions/mkor/cnn_study.py): a quick grid, divergence, the tables."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from core.config import ConfigError
from data.errors import DataUnavailableError
from data.fashion_mnist import fashion_mnist
from reproductions.common.results import ResultsError, RunRecorder, load_results
from reproductions.common.tables import Table
from reproductions.mkor import cnn_study
from reproductions.mkor.cnn_study import (
    QUICK,
    StudyConfig,
    epochs_cell,
    first_reached,
    load_data,
    lr_at,
    results_path,
    study_tables,
    train_run,
)


@pytest.fixture(scope="module")
def fashion_available() -> None:
    try:
        fashion_mnist(train=False)
    except DataUnavailableError as err:
        pytest.skip(str(err))


def check_table_structure(m5: Table, m6: Table, lrs: tuple[float, ...]) -> None:
    assert (m5.id, m5.kind, m6.id, m6.kind) == ("M5", "small", "M6", "small")
    for table in (m5, m6):
        assert any(c.startswith("paper") for c in table.columns)
        assert any(c.startswith("ours") for c in table.columns)
        assert table.notes and "Fashion-MNIST" in table.notes
    assert m5.column("optimizer") == ["MKOR", "KAISA (K-FAC)", "SGD"]
    assert m5.columns[1].startswith("paper: epochs") and m5.column(m5.columns[1]) == [
        "57", "54", "88"]
    assert m5.column(m5.columns[2]) == ["22,002", "22,978", "32,815"]
    assert m6.column("optimizer") == ["MKOR", "KAISA (K-FAC)", "HyLo", "SGD"]
    assert len(m6.columns) == 1 + 2 * len(lrs)
    for lr in lrs:
        assert m6.column(f"ours: LR {lr:g}")[2] == "not implemented"  # HyLo
    assert "HyLo" in m6.notes and "not implemented" in m6.notes
    assert "*" in m6.notes and "cannot be told apart" in m6.notes


def test_quick_grid_writes_valid_results_and_both_tables(fashion_available: None,
                                                         tmp_path: Path) -> None:
    tables = cnn_study.main(["--quick", "--results-dir", str(tmp_path)])
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files == sorted(f"{o}_lr{lr:g}.json" for o in cnn_study.OPTIMIZERS
                           for lr in cnn_study.LRS)
    for name in files:
        run = load_results(tmp_path / name)
        assert (run["paper"], run["experiment"]) == ("mkor", "cnn_study")
        assert run["finished"] is not None
        assert run["config"]["train_examples_used"] == QUICK.train_examples
        assert run["config"]["preconditioner"] == cnn_study.PRECONDITIONER_OPTIONS[
            run["optimizer"]]
        steps = run["summary"]["steps"]
        assert [s["step"] for s in run["steps"]] == list(range(1, steps + 1))
        if not run["summary"]["diverged"]:
            assert steps == 8  # 512 images / 64 per step, one epoch
            assert [e["step"] for e in run["evals"]] == [4, 8]  # every half epoch
            assert all(0.0 <= e["test_accuracy"] <= 1.0 for e in run["evals"])
    m5, m6 = tables
    check_table_structure(m5, m6, cnn_study.LRS)
    # Paper cells of Table A.2 beside ours
    assert m6.column("paper: LR 10") == ["94", "112", "D", "D"]
    assert m6.column("paper: LR 0.01") == ["76", "89*", "150*", "145*"]
    # Rebuilt from the files alone, the same tables
    assert [t.rows for t in study_tables(tmp_path)] == [m5.rows, m6.rows]


def test_divergence_is_recorded_and_marked_d(fashion_available: None, tmp_path: Path) -> None:
    data = load_data(QUICK)
    out = results_path(tmp_path, "sgd", 1e6)
    run = train_run("sgd", 1e6, QUICK, data, out, log=lambda line: None)
    assert out.name == "sgd_lr1e+06.json"
    saved = load_results(out)
    assert saved["summary"]["diverged"] is True and saved["summary"]["diverged_reason"]
    assert saved["summary"]["steps"] < 8  # stopped early
    assert saved["summary"]["epochs_to_target"] is None
    assert epochs_cell(run, 0.0) == "D"  # even a target of 0 is not "reached" by a diverged run
    m5, m6 = study_tables(tmp_path, lrs=(1e6,), base_lr=1e6)
    assert m6.column("ours: LR 1e+06") == ["not run", "not run", "not implemented", "D"]
    assert m5.rows[2][3:5] == ["D", "D"]
    assert m5.rows[0][3] == "not run"


def fake_run(optimizer: str, lr: float, accuracies: list[float | None], *,
             step_seconds: float = 0.5, diverge_at: int | None = None,
             target: float = 0.89) -> RunRecorder:
    """A hand-made results object: 10 steps per epoch, an evaluation every 5 steps with the
    given accuracies, every step taking ``step_seconds``."""
    config = StudyConfig(epochs=3.0, target_accuracy=target)  # one configuration for all
    recorder = RunRecorder(paper="mkor", experiment="cnn_study", optimizer=optimizer, config={
        **asdict(config), "optimizer": optimizer, "lr": lr, "steps_per_epoch": 10,
        "train_examples_used": 60000, "test_examples_used": 10000})
    step = 0
    for accuracy in accuracies:
        for _ in range(5):
            step += 1
            loss = math.nan if step == diverge_at else 1.0
            recorder.log_step(step, loss=loss, time_s=step_seconds)
            if step == diverge_at:
                break
        if step == diverge_at:
            break
        recorder.log_eval(step, epoch=step / 10, test_accuracy=accuracy)
    recorder.update(summary={"steps": step, "diverged": diverge_at is not None,
                             "train_time_s": step * step_seconds})
    recorder.finish()
    return recorder


def test_epochs_to_target_from_hand_made_results(tmp_path: Path) -> None:
    slow = fake_run("sgd", 0.1, [0.5, 0.7, 0.85, 0.88, 0.891, 0.9]).data
    assert first_reached(slow, 0.89) == {"step": 25, "epoch": 2.5, "seconds": 12.5}
    assert first_reached(slow, 0.88) == {"step": 20, "epoch": 2.0, "seconds": 10.0}
    assert first_reached(slow, 0.95) is None
    assert epochs_cell(slow, 0.89) == 2.5 and epochs_cell(slow, 0.95) is None
    assert epochs_cell(None, 0.89) == "not run"
    # Without the evaluation's epoch and train-time fields: from the config and the steps
    bare: dict[str, Any] = {**slow, "evals": [{"step": e["step"],
                                               "test_accuracy": e["test_accuracy"]}
                                              for e in slow["evals"]]}
    assert first_reached(bare, 0.89) == {"step": 25, "epoch": 2.5, "seconds": 12.5}
    fast = fake_run("mkor", 0.1, [0.8, 0.9, 0.91, 0.92], step_seconds=1.0)
    kfac = fake_run("kfac", 0.1, [0.6, 0.7, 0.8, 0.85])
    gone = fake_run("sgd", 10.0, [0.9, 0.95], diverge_at=7)  # reached 0.9 first, then NaN
    assert epochs_cell(gone.data, 0.89) == "D"
    for name, recorder in (("sgd_lr0.1", fake_run("sgd", 0.1, [0.5, 0.7, 0.85, 0.88, 0.891,
                                                                 0.9])),
                           ("mkor_lr0.1", fast), ("kfac_lr0.1", kfac), ("sgd_lr10", gone)):
        recorder.write(tmp_path / f"{name}.json")
    m5, m6 = study_tables(tmp_path)
    check_table_structure(m5, m6, cnn_study.LRS)
    assert "89%" in m5.title and "89%" in m6.title  # the recorded target
    assert m6.column("ours: LR 0.1") == [1.0, None, "not implemented", 2.5]
    assert m6.column("ours: LR 10") == ["not run", "not run", "not implemented", "D"]
    assert m6.column("ours: LR 1") == ["not run"] * 2 + ["not implemented", "not run"]
    by_optimizer = {row[0]: row for row in m5.rows}
    assert by_optimizer["MKOR"][3:] == [1.0, 10.0, 92.0, 20.0, 1000.0]
    assert by_optimizer["KAISA (K-FAC)"][3:6] == [None, None, 85.0]
    assert by_optimizer["SGD"][3:6] == [2.5, 12.5, 90.0]
    # Another target, read from the same evaluations
    m5, m6 = study_tables(tmp_path, target=0.8)
    assert m6.column("ours: LR 0.1") == [0.5, 1.5, "not implemented", 1.5]


def test_schedule_warms_up_then_decays_to_zero() -> None:
    total, peak = 100, 2.0
    rates = [lr_at(step, total, peak, 0.1) for step in range(total)]
    assert rates[0] == pytest.approx(0.2) and rates[9] == pytest.approx(peak)
    assert max(rates) == pytest.approx(peak)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:], strict=False))
    assert rates[-1] < 1e-3 * peak


def test_the_tables_refuse_runs_of_another_configuration(tmp_path: Path) -> None:
    """A width-4, 1-epoch SGD run beside a width-8, 3-epoch MKOR run was one comparison whose
    notes described a single configuration; runs made for other targets are fine, and
    without --target the tables ask for one in one line."""
    fake_run("sgd", 0.1, [0.5, 0.9]).write(tmp_path / "sgd_lr0.1.json")
    other = fake_run("mkor", 0.1, [0.8, 0.9])
    other.data["config"]["target_accuracy"] = 0.5
    other.write(tmp_path / "mkor_lr0.1.json")
    with pytest.raises(ConfigError, match="--target"):
        study_tables(tmp_path)
    assert len(study_tables(tmp_path, target=0.8)) == 2
    other.data["config"]["width"] += 4
    other.write(tmp_path / "mkor_lr0.1.json")
    with pytest.raises(ResultsError, match="made with width=8, .*mkor_lr0.1.json with 12"):
        study_tables(tmp_path, target=0.8)
