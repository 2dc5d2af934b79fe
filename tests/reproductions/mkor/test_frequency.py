"""M7 (time per iteration against the inversion interval): the amortisation, the table, a tiny
measurement through the training code and the committed results file."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch

from reproductions.common.launch import DistContext
from reproductions.common.tables import Table
from reproductions.mkor import frequency
from reproductions.mkor.bert import prepare_examples
from reproductions.mkor.config import load_config
from tests.reliability.test_bad_input import Parsed, assert_clear_error, invoke


def fake_results(lamb: float = 1.0, kfac: tuple[float, float] = (3.0, 1.1),
                 mkor: tuple[float, float] = (1.2, 1.15)) -> dict:
    """A measurement's data as a results file holds it, with chosen medians."""
    times = {"lamb": {"update": lamb, "plain": lamb},
             "kfac": {"update": kfac[0], "plain": kfac[1]},
             "mkor": {"update": mkor[0], "plain": mkor[1]}}
    return {"schema": frequency.SCHEMA, "experiment": "default", "medians": times,
            "config": load_config("default").to_dict(), "repeats": 3, "warmup": 1,
            "parameters": 1_500_000}


def test_amortised_time_is_the_mean_over_one_interval() -> None:
    assert frequency.amortised_time(3.0, 1.0, 1) == 3.0
    assert frequency.amortised_time(3.0, 1.0, 2) == 2.0
    assert frequency.amortised_time(3.0, 1.0, 10) == pytest.approx((3.0 + 9 * 1.0) / 10)
    # an update at f steps costs T_update once and T_plain f - 1 times
    assert frequency.amortised_time(5.0, 2.0, 200) * 200 == pytest.approx(5.0 + 199 * 2.0)
    with pytest.raises(ValueError, match="interval"):
        frequency.amortised_time(1.0, 1.0, 0)


def test_medians_pool_lambs_steps() -> None:
    samples = {"lamb": {"update": [1.0, 3.0], "plain": [2.0]},
               "kfac": {"update": [5.0, 4.0, 9.0], "plain": [1.0, 2.0]}}
    assert frequency.medians(samples) == {"lamb": {"update": 2.0, "plain": 2.0},
                                          "kfac": {"update": 5.0, "plain": 1.5}}


def test_table_rows_and_ratios() -> None:
    table = frequency.frequency_table(fake_results())
    assert isinstance(table, Table) and table.id == "M7" and table.kind == "small"
    assert table.columns[1].startswith("paper") and all(
        c.startswith("ours") for c in table.columns[2:])
    assert table.column(table.columns[0]) == list(frequency.FREQUENCIES)
    kfac_s = table.column("ours: KAISA (K-FAC) s per iteration")
    assert kfac_s[0] == pytest.approx(3.0) and kfac_s[1] == pytest.approx(2.05)
    assert kfac_s[-1] == pytest.approx((3.0 + 199 * 1.1) / 200)
    assert table.column("ours: KAISA / LAMB")[0] == pytest.approx(3.0)
    assert table.column("ours: MKOR / LAMB")[2] == pytest.approx((1.2 + 4 * 1.15) / 5)
    assert table.column("ours: KAISA / MKOR")[0] == pytest.approx(2.5)
    assert "no values printed" in table.rows[0][1] and table.rows[1][1] == "(figure only)"
    assert sorted(kfac_s, reverse=True) == kfac_s  # falls as f grows
    for needle in ("Fig. 3.4a", "CPU", "one process", "(T_update + (f − 1) T_plain) / f"):
        assert needle in table.notes
    table.markdown()


def test_the_notes_name_the_preconditioners_defaults() -> None:
    """A config file holds only the options it changes (tiny.json: K-FAC's damping and
    intervals, MKOR's interval): the notes read "? decomposition, factor decay ?" and
    "? update rule" for the rest; they give the defaults the run used now."""
    results = {**fake_results(), "config": load_config("tiny").to_dict()}
    notes = frequency.frequency_table(results).notes
    assert "damping 0.003, eigen decomposition, factor decay 0.95)" in notes
    assert "MKOR with float32 inverse factors, exact update rule" in notes
    assert "? decomposition" not in notes and "? update rule" not in notes


def test_timing_config_sets_only_the_intervals() -> None:
    cfg = load_config("default")
    timed = frequency.timing_config(cfg, 2)
    assert timed.preconditioner["kfac"] == {**cfg.preconditioner["kfac"],
                                            "factor_update_steps": 2, "inv_update_steps": 2}
    assert timed.preconditioner["mkor"] == {**cfg.preconditioner["mkor"],
                                            "inv_update_steps": 2}
    assert cfg.preconditioner["kfac"]["inv_update_steps"] == 10  # the original is untouched


def test_a_tiny_measurement_through_the_training_code(corpus_file: Path, data_dir: Path
                                                      ) -> None:
    """Two kept rounds on the tiny config: every sample is a positive time; the update steps
    of K-FAC and MKOR ran their inversion stage and their plain steps did not."""
    torch.set_num_threads(1)
    cfg = load_config("tiny")
    cfg = replace(cfg, corpus=[str(corpus_file)])
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                      is_main=True)
    (train, _), tokenizer = prepare_examples(cfg, ctx, argparse.Namespace(data_dir=data_dir))
    lines: list[str] = []
    measured = frequency.measure_step_times(cfg, tokenizer, train, repeats=2, warmup=1,
                                            log=lines.append)
    assert len(lines) == 3
    for method in frequency.METHODS:
        for kind in ("update", "plain"):
            values = measured["samples"][method][kind]
            assert len(values) == 2 and all(v > 0 for v in values)
        assert len(measured["losses"][method]) == 6
        assert all(math.isfinite(x) for x in measured["losses"][method])
    assert measured["preconditioned_layers"]["lamb"] == 0
    assert measured["preconditioned_layers"]["kfac"] == measured["preconditioned_layers"]["mkor"]
    for method in ("kfac", "mkor"):
        inversion = measured["inversion_s"][method]
        assert all(s > 0 for s in inversion["update"]), method
        assert all(s == 0 for s in inversion["plain"]), method
        assert all(s > 0 for s in measured["second_order_s"][method]["plain"]), method
    assert set(measured["inversion_s"]["lamb"]["update"]) == {0.0}
    results = {"schema": frequency.SCHEMA, "config": cfg.to_dict(), **measured}
    table = frequency.frequency_table(results)
    assert len(table.rows) == len(frequency.FREQUENCIES)


def test_load_measurement_refuses_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(frequency.FrequencyError, match="schema"):
        frequency.load_measurement(bad)
    partial = fake_results()
    del partial["medians"]["mkor"]
    bad.write_text(json.dumps(partial))
    with pytest.raises(frequency.FrequencyError, match="medians.mkor"):
        frequency.load_measurement(bad)
    with pytest.raises(frequency.FrequencyError, match="cannot be read"):
        frequency.load_measurement(tmp_path / "missing.json")


def test_the_committed_results_build_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    table = frequency.table_from_results()
    assert [row[0] for row in table.rows] == list(frequency.FREQUENCIES)
    assert all(isinstance(c, float) and c > 0 for row in table.rows for c in row[2:])
    results = frequency.load_measurement(frequency.DEFAULT_RESULTS)
    assert results["experiment"] == "default" and results["config"]["model"] == "small"
    assert results["hardware_start"]["threads"] >= 1
    assert "load_average" in results["hardware_start"]
    frequency.main(["--from-results", str(frequency.DEFAULT_RESULTS)])
    assert "| 200 |" in capsys.readouterr().out


def test_cuda_without_cuda_ends_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cuda`` was accepted and failed in torch ("Found no NVIDIA driver") once the
    data and model were loaded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    never_measured = mock.patch.object(frequency, "run_measurement", side_effect=Parsed)
    outcome, stderr = invoke(frequency.main, ["--config", "tiny", "--device", "cuda"],
                             never_measured)
    assert_clear_error(outcome, stderr, set())
    assert "--device: 'cuda': no CUDA device here" in stderr


def test_a_negative_warmup_ends_in_one_line() -> None:
    """``--warmup -2`` was accepted (rounds discarded: a negative count)."""
    never_measured = mock.patch.object(frequency, "run_measurement", side_effect=Parsed)
    outcome, stderr = invoke(frequency.main, ["--config", "tiny", "--warmup", "-2"],
                             never_measured)
    assert_clear_error(outcome, stderr, set())
    assert "argument --warmup: -2 is not >= 0" in stderr


def test_an_out_whose_folder_cannot_be_made_is_refused_before_measuring(tmp_path: Path) -> None:
    """A file in the place of --out's folder failed only after the measurement, minutes in."""
    blocked = tmp_path / "afile"
    blocked.write_text("")
    never_measured = mock.patch.object(frequency, "run_measurement", side_effect=Parsed)
    outcome, stderr = invoke(frequency.main, ["--config", "tiny", "--out",
                                              str(blocked / "freq.json")], never_measured)
    assert_clear_error(outcome, stderr, set())
    assert "invalid --out=" in stderr and "is not a directory" in stderr
