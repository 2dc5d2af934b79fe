"""M8 (rank-1 approximation error of the factors): the error on hand-computed examples in
float64, the rows MKOR uses, a tiny run that trains exactly as the entry point does, and the
committed results file."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from core.layers import helper_for
from reproductions.common.launch import DistContext
from reproductions.common.tables import Table
from reproductions.mkor import bert, rank1_error
from reproductions.mkor.config import load_config


def test_identical_rows_have_no_error() -> None:
    rows = torch.tensor([[1.0, -2.0, 3.5, 0.25]] * 7, dtype=torch.float64)
    assert rank1_error.rank1_error(rows) == pytest.approx(0.0, abs=1e-15)
    assert rank1_error.best_rank1_error(rows) == pytest.approx(0.0, abs=1e-7)


def test_two_rows_by_hand() -> None:
    # rows e1, e2: A = I/2, ā = (1/2, 1/2), A − āāᵀ = [[1/4, −1/4], [−1/4, 1/4]]:
    # ‖·‖_F = 1/2, ‖A‖_F = 1/√2, e = 1/√2. The best rank-1 keeps one eigenvalue 1/2 of two.
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # float32 in, float64 inside
    assert rank1_error.rank1_error(rows) == pytest.approx(1 / math.sqrt(2), rel=1e-15)
    assert rank1_error.best_rank1_error(rows) == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    # rows (1, 1), (1, −1): A = I, ā = (1, 0), A − āāᵀ = diag(0, 1): e = 1/√2 again
    other = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    assert rank1_error.rank1_error(other) == pytest.approx(1 / math.sqrt(2), rel=1e-15)
    # scale-free: the per-example scaling of MKOR's gradient vector does not enter
    assert rank1_error.rank1_error(37.5 * other) == pytest.approx(1 / math.sqrt(2), rel=1e-15)
    assert math.isnan(rank1_error.rank1_error(torch.zeros(3, 2)))


def test_layer_errors_of_a_linear_layer_by_hand() -> None:
    """Inputs e1, e2 to a Linear(2, 3) with bias: rows (1, 0, 1), (0, 1, 1); A − āāᵀ has
    four entries ±1/4 (‖·‖_F = 1/2) and ‖A‖_F² = 6/4 + 1 = 5/2, so e = 1/√10. The loss
    Σ y·c gives every row the output gradient c: identical rows, no error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    c = torch.tensor([1.0, 2.0, 3.0])
    errors = rank1_error.layer_errors(model, ["0"], lambda m: (m(x) * c).sum())
    by_side = {e["side"]: e for e in errors}
    assert by_side["activation"]["error"] == pytest.approx(1 / math.sqrt(10), rel=1e-14)
    assert (by_side["activation"]["dim"], by_side["activation"]["rows"]) == (3, 2)
    assert by_side["gradient"]["error"] == pytest.approx(0.0, abs=1e-15)
    assert all(p.grad is None for p in model.parameters())  # the pass's gradients are cleared
    with pytest.raises(ValueError, match="not a Linear or Conv2d"):
        rank1_error.layer_errors(model, ["missing"], lambda m: m(x).sum())


@pytest.mark.parametrize("module,shape", [
    (nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 7, 6)),
    (nn.Linear(5, 4), (2, 6, 5)),
])
def test_the_rows_mean_is_mkors_vector(module: nn.Module, shape: tuple[int, ...]) -> None:
    """The error's ā is the mean of the rows the helpers build, which is MKOR's ā (its
    ``mean_a_row``): conv patches and sequence positions count as rows alike."""
    helper = helper_for(module)
    assert helper is not None
    x = torch.randn(*shape, dtype=torch.float64)
    rows = helper.a_rows(x, torch.float64).rows
    torch.testing.assert_close(rows.reshape(-1, rows.shape[-1]).mean(0),
                               helper.mean_a_row(x, torch.float64))


def test_quantiles() -> None:
    assert rank1_error.quantiles([5.0, 1.0, 4.0, 2.0, 3.0, math.nan]) == {
        "min": 1.0, "q1": 2.0, "median": 3.0, "q3": 4.0, "max": 5.0}
    assert rank1_error.quantiles([0.5]) == dict.fromkeys(("min", "q1", "median", "q3", "max"),
                                                         0.5)
    assert rank1_error.quantiles([])["median"] is None


def test_a_tiny_run_trains_as_the_entry_point(corpus_file: Path, data_dir: Path,
                                              tmp_path: Path) -> None:
    """Measuring at steps 0, 1 and 3 leaves MKOR's training run as it is: its losses are
    those of ``python -m reproductions.mkor.bert`` with the same settings."""
    torch.set_num_threads(1)
    cfg = replace(load_config("tiny"), corpus=[str(corpus_file)])
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                      is_main=True)
    examples, tokenizer = bert.prepare_examples(cfg, ctx, argparse.Namespace(data_dir=data_dir))
    lines: list[str] = []
    measured = rank1_error.measure_during_training(cfg, tokenizer, examples, points=(0, 1, 3),
                                                   log=lines.append)
    assert [p["step"] for p in measured["points"]] == [0, 1, 3] and len(lines) == 3
    names = measured["layers"]
    assert names and not any(n.endswith("cls.predictions.decoder") for n in names)
    for point in measured["points"]:
        assert len(point["layers"]) == 2 * len(names)
        for side in rank1_error.SIDES:
            s = point["summary"][side]
            assert 0.0 <= s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"] <= 1.0
            assert s["best_rank1_median"] <= s["median"] + 1e-12
            assert s["layers"] == len(names)
    runs = bert.main(["--config", "tiny", "--corpus", str(corpus_file), "--data-dir",
                      str(data_dir), "--out", str(tmp_path / "out"), "--device", "cpu",
                      "--optimizers", "mkor", "--wandb", "disabled"])
    assert [s["loss"] for s in runs[0]["steps"]] == measured["train_losses"]
    table = rank1_error.error_table({"schema": rank1_error.SCHEMA, "config": cfg.to_dict(),
                                     "run_steps": cfg.steps, **measured})
    assert len(table.rows) == 2 * 3


def test_load_measurement_refuses_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(rank1_error.Rank1ErrorError, match="schema"):
        rank1_error.load_measurement(bad)
    bad.write_text(json.dumps({"schema": rank1_error.SCHEMA, "points": [{"summary": {}}]}))
    with pytest.raises(rank1_error.Rank1ErrorError, match=r"points\[0\]\.summary"):
        rank1_error.load_measurement(bad)


def test_the_committed_results_build_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    table = rank1_error.table_from_results()
    assert isinstance(table, Table) and table.id == "M8" and table.kind == "small"
    assert table.columns[2].startswith("paper") and all(
        c.startswith("ours") for c in table.columns[3:])
    results = rank1_error.load_measurement(rank1_error.DEFAULT_RESULTS)
    assert results["experiment"] == "default" and results["config"]["model"] == "small"
    steps = [p["step"] for p in results["points"] if p["step"] is not None]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == results["run_steps"]
    assert len(table.rows) == 2 * len(results["points"])
    for row in table.rows:
        assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in row[3:9])
    rank1_error.main(["--from-results", str(rank1_error.DEFAULT_RESULTS)])
    assert "| activation |" in capsys.readouterr().out


@pytest.mark.parametrize(("points", "says"), [
    ("50", "--points '50': no step in 0..3, the run's steps"),  # a traceback after the data
    ("-1,2", "--points '-1,2': steps must be >= 0"),
])
def test_points_outside_the_run_are_refused_before_any_work(
        points: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        rank1_error.main(["--config", "tiny", f"--points={points}"])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_the_error_stays_in_its_range_when_rounding_puts_it_above_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The error is at most 1 (rows of mean zero reach it), but rounding put a CI run's tiny
    BERT layer at 1 + 2e-16, outside the documented [0, 1]: the norms are made to round so."""
    norms = iter([torch.tensor(1.0, dtype=torch.float64),
                  torch.tensor(1.0 + 2.2e-16, dtype=torch.float64)])
    monkeypatch.setattr(torch.linalg, "matrix_norm", lambda _: next(norms))
    assert rank1_error.rank1_error(torch.randn(6, 3, dtype=torch.float64)) == 1.0
