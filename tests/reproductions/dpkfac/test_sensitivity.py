"""D6: the quick damping × interval grid on 2 gloo workers, and the table's marking of missing,
failed, interrupted and diverged runs (from results files written here, no training)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from reproductions.common.results import RunRecorder, load_results
from reproductions.common.tables import Table, load_tables
from reproductions.dpkfac.sensitivity import (
    BASE,
    GRID_FILE,
    PAPER_CELL,
    SCHEMES,
    cell_config,
    final_train_loss,
    loss_spikes,
    main,
    reference_config,
    run_grid,
    sensitivity_table,
)


def _row(table: Table, damping: float, interval: int) -> dict[str, Any]:
    rows = [dict(zip(table.columns, r, strict=True)) for r in table.rows
            if r[0] == damping and r[1] == interval]
    assert len(rows) == 1
    return rows[0]


@pytest.mark.distributed
def test_quick_grid_writes_results_and_the_table(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "run"),
          "--wandb", "disabled"])
    grid = json.loads((out / GRID_FILE).read_text())
    assert grid["dampings"] == [0.03] and grid["intervals"] == [1, 2]
    assert [e["error"] for e in grid["launches"]] == [None, None]
    for interval in (1, 2):
        for scheme in SCHEMES:
            run = load_results(out / f"fmnist-d0.03-i{interval}-{scheme}.json")
            assert run["finished"] and len(run["steps"]) == 3
            assert run["config"]["damping"] == 0.03 and run["config"]["world_size"] == 2
            assert run["config"]["factor_update_steps"] == run["config"][
                "inv_update_steps"] == interval
    paper, tables = load_tables(out / "tables.json")
    assert paper == "dpkfac" and [t.id for t in tables] == ["D6"]
    table = tables[0]
    assert table.kind == "small" and "paper" in table.columns and table.notes
    assert "batch-hyper.sh" in table.notes and "ResNet-110" in table.notes
    assert [r[:3] for r in table.rows] == [[0.03, 1, PAPER_CELL], [0.03, 2, PAPER_CELL]]
    row = _row(table, 0.03, 2)
    # three steps stop mid-epoch: no evaluation, but a finite training loss
    assert row["ours: DP-KFAC test accuracy (%)"].startswith("not evaluated")
    assert 0 < row["ours: MPD-KFAC final train loss"] < 10
    assert "### D6: Damping × update-interval" in capsys.readouterr().out

    # again: every run is finished with these settings, so nothing trains, and grid.json keeps
    # the launches that trained them
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("fmnist-*.json")}
    main(["--quick", "--out", str(out), "--run-dir", str(tmp_path / "run"),
          "--wandb", "disabled"])
    assert capsys.readouterr().out.count("done already, skipped") == 2
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("fmnist-*.json")} == written
    assert json.loads((out / GRID_FILE).read_text())["launches"] == grid["launches"]


def _write_run(out: Path, damping: float, interval: int, optimizer: str, *,
               losses: list[float | None], accuracy: float | None = 0.8,
               finished: bool = True) -> None:
    config = cell_config(BASE, damping, interval)
    recorder = RunRecorder(paper="dpkfac", experiment=config.experiment, optimizer=optimizer,
                           config=asdict(config) | {"optimizer": optimizer, "world_size": 2},
                           world_size=2)
    for step, loss in enumerate(losses):
        recorder.log_step(step, loss=loss, time_s=0.1)
    if accuracy is not None:
        recorder.log_eval(len(losses) - 1, epoch=1.0, test_accuracy=accuracy,
                          test_loss=float("nan") if any(v is None for v in losses) else 0.5)
    recorder.update(summary={"train_seconds": 0.1 * len(losses)})
    if finished:
        recorder.finish()
    recorder.write(out / f"{config.experiment}-{optimizer}.json")


def test_table_marks_missing_failed_interrupted_and_diverged_runs(tmp_path: Path) -> None:
    out = tmp_path
    grid = {"schema": "kfac-repro/dpkfac-sensitivity/v1", "dampings": [0.01, 0.1],
            "intervals": [1, 10], "schemes": list(SCHEMES), "workers": 2,
            "base_config": asdict(BASE), "reference": reference_config(BASE).experiment + "-sgd",
            "launches": [{"experiment": cell_config(BASE, 0.1, 10).experiment,
                          "error": "ProcessRaisedException: boom"}]}
    (out / GRID_FILE).write_text(json.dumps(grid))
    _write_run(out, 0.01, 1, "mpd-kfac", losses=[2.0] * 10 + [1.0] * 10, accuracy=0.85)
    _write_run(out, 0.01, 1, "dp-kfac", losses=[2.0] * 18 + [0.5, 0.7], accuracy=0.82)
    _write_run(out, 0.01, 10, "mpd-kfac", losses=[2.0, 3.0, None, None], accuracy=0.1)
    _write_run(out, 0.1, 1, "mpd-kfac", losses=[2.0, 1.5], accuracy=None, finished=False)
    # (0.01, 10) dp-kfac, (0.1, 1) dp-kfac: never run; (0.1, 10): its launch failed
    table = sensitivity_table(out)
    assert [r[:2] for r in table.rows] == [[0.01, 1], [0.01, 10], [0.1, 1], [0.1, 10]]

    ok = _row(table, 0.01, 1)
    assert ok["ours: MPD-KFAC test accuracy (%)"] == pytest.approx(85.0)
    assert ok["ours: DP-KFAC test accuracy (%)"] == pytest.approx(82.0)
    assert ok["ours: DP − MPD (points)"] == pytest.approx(-3.0)
    assert ok["ours: MPD-KFAC final train loss"] == pytest.approx(1.0)  # the last 10 %
    assert ok["ours: DP-KFAC final train loss"] == pytest.approx(0.6)
    assert ok["ours: MPD-KFAC loss spikes (steps)"] == ok["ours: DP-KFAC loss spikes (steps)"] == 0

    diverged = _row(table, 0.01, 10)
    assert diverged["ours: MPD-KFAC test accuracy (%)"] == "diverged (non-finite at step 2)"
    assert diverged["ours: MPD-KFAC final train loss"].startswith("diverged")
    assert diverged["ours: MPD-KFAC loss spikes (steps)"] == 3  # 3.0 and the two non-finite
    assert diverged["ours: DP-KFAC test accuracy (%)"] == "missing (not run)"
    assert diverged["ours: DP − MPD (points)"] is None

    interrupted = _row(table, 0.1, 1)
    assert interrupted["ours: MPD-KFAC test accuracy (%)"].startswith("unfinished after 2 steps")
    failed = _row(table, 0.1, 10)
    assert failed["ours: DP-KFAC test accuracy (%)"] == "failed (ProcessRaisedException: boom)"

    assert "SGD reference under the same settings: missing (not run)" in table.notes
    assert "MPD-KFAC: 85.0–85.0 %" not in table.notes  # one finished cell: no range
    markdown = table.markdown()
    assert "diverged (non-finite at step 2)" in markdown and "—" in markdown


def test_without_grid_file_the_grid_comes_from_the_results_files(tmp_path: Path) -> None:
    _write_run(tmp_path, 0.05, 50, "dp-kfac", losses=[1.0, 0.9], accuracy=0.7)
    table = sensitivity_table(tmp_path)
    assert len(table.rows) == 1
    row = _row(table, 0.05, 50)
    assert row["ours: DP-KFAC test accuracy (%)"] == pytest.approx(70.0)
    assert row["ours: MPD-KFAC test accuracy (%)"] == "missing (not run)"
    assert sensitivity_table(tmp_path / "empty").rows == []


def test_loss_spikes_count_steps_above_chance_after_the_first_tenth() -> None:
    losses = [9.0] * 10 + [1.0] * 80 + [3.0] * 5 + [None] + [0.5] * 4
    assert loss_spikes([{"step": i, "loss": v} for i, v in enumerate(losses)]) == 6
    assert loss_spikes([]) == 0


def test_final_train_loss_is_the_mean_of_the_last_tenth() -> None:
    steps = [{"step": i, "loss": float(i)} for i in range(100)]
    assert final_train_loss(steps) == pytest.approx(94.5)
    assert final_train_loss(steps[:3]) == 2.0
    assert final_train_loss([]) is None
    assert final_train_loss([*steps, {"step": 100, "loss": None}]) is None


def test_tables_only_with_no_results_writes_nothing(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    main(["--tables-only", "--out", str(tmp_path)])
    assert "No results" in capsys.readouterr().out
    assert not (tmp_path / "tables.json").exists()


def test_a_grid_of_the_same_settings_grows_and_finished_runs_are_skipped(
        tmp_path: Path) -> None:
    for damping in (0.01, 0.1):
        for scheme in SCHEMES:
            _write_run(tmp_path, damping, 1, scheme, losses=[1.0], accuracy=0.5)
    trained = []
    kwargs = {"base": BASE, "workers": 2, "out": tmp_path, "run_dir": tmp_path / "run",
              "reference": False, "log": trained.append}
    run_grid([0.01], [1], **kwargs)
    grid = run_grid([0.1], [1], **kwargs)
    assert grid["dampings"] == [0.01, 0.1] and grid["intervals"] == [1]
    assert all("skipped" in line for line in trained)  # nothing was trained
    assert [e["experiment"] for e in grid["launches"]] == ["fmnist-d0.01-i1", "fmnist-d0.1-i1"]
    assert len(sensitivity_table(tmp_path).rows) == 2
