"""Resuming a 2-process gloo run of ``reproductions.osawa2018.train``: the results of the resumed
run count the communication and stage times of the whole run, and a run of another world size
refuses the checkpoints instead of starting afresh over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from reproductions.common.launch import run_local
from reproductions.common.results import load_results
from reproductions.osawa2018.train import main
from tests.reliability.helpers import SETTINGS, TIMEOUT_S, train_args

SHORT = {**SETTINGS, "epochs": 2, "lr_decay_end_epoch": 2}
"""The tiny run cut to 4 updates."""


@pytest.mark.distributed
def test_a_resumed_two_process_run_reports_the_whole_run_and_refuses_one_process(
        tmp_path: Path, image_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_local(main, 2, train_args(whole, image_folder, settings=SHORT), timeout=TIMEOUT_S)
    run_local(main, 2, [*train_args(split, image_folder, settings=SHORT), "--max-steps", "2"],
              timeout=TIMEOUT_S)
    first = load_results(split / "results.json")
    saved = {path: path.read_bytes() for path in (split / "checkpoints").rglob("*.pt")}
    with pytest.raises(SystemExit) as info:
        main([*train_args(split, image_folder, settings=SHORT), "--resume"])
    assert info.value.code == 1
    assert ("was saved by a run of world size 2, not 1 like this one"
            in capsys.readouterr().err)
    assert {path: path.read_bytes() for path in (split / "checkpoints").rglob("*.pt")} == saved

    run_local(main, 2, [*train_args(split, image_folder, settings=SHORT), "--resume"],
              timeout=TIMEOUT_S)
    expected, resumed = load_results(whole / "results.json"), load_results(split / "results.json")
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in expected["steps"]]
    assert resumed["ledger"] == expected["ledger"]
    assert 0 < first["ledger"]["factor_comm"]["collectives"] < (
        expected["ledger"]["factor_comm"]["collectives"])
    times = resumed["optimizer_stage_time_s"]
    assert times.keys() == expected["optimizer_stage_time_s"].keys()
    assert all(times[stage] >= seconds
               for stage, seconds in first["optimizer_stage_time_s"].items())
