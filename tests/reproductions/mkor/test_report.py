"""Convergence numbers: smoothing, the LAMB target, steps and time to it, the table."""

from __future__ import annotations

import math

import pytest

from reproductions.mkor.report import compare, comparison_table, smoothed_losses


def run(name: str, losses: list[float | None], step_time: float) -> dict:
    return {"optimizer": name, "evals": [{"step": len(losses) - 1, "loss": losses[-1]}],
            "steps": [{"step": i, "loss": loss, "time_s": step_time, "optimizer_s": 0.1}
                      for i, loss in enumerate(losses)]}


def test_smoothing_skips_missing_losses() -> None:
    assert smoothed_losses([{"loss": 4.0}, {"loss": None}, {"loss": 2.0}], 2) == [4.0, 4.0, 2.0]
    assert math.isnan(smoothed_losses([{"loss": None}], 3)[0])


def test_steps_and_time_to_lambs_final_loss() -> None:
    lamb = run("lamb", [6, 5, 4, 3], step_time=1.0)         # target: mean(4, 3) = 3.5
    fast = run("mkor", [6, 4, 3, 2], step_time=2.0)         # smoothed 5, 3.5 -> reached at step 2
    never = run("kfac", [6, 6, 6, 6], step_time=0.5)
    target, rows = compare([lamb, fast, never], window=2)
    assert target == 3.5
    by_name = {r.optimizer: r for r in rows}
    assert (by_name["lamb"].steps_to_target, by_name["lamb"].time_to_target_s) == (4, 4.0)
    assert (by_name["mkor"].steps_to_target, by_name["mkor"].time_to_target_s) == (3, 6.0)
    assert by_name["kfac"].steps_to_target is None
    assert by_name["mkor"].final_loss == 2.5 and by_name["mkor"].final_eval_loss == 2
    table = comparison_table([lamb, fast, never], window=2)
    assert "| mkor | 4 | 2.5000 | 2.0000 | 8.0 | 0.4 | 3 | 6.0 | 1.33 | 0.67 |" in table
    assert "| kfac | 4 | 6.0000 | 6.0000 | 2.0 | 0.4 | not reached | not reached |" in table


@pytest.mark.parametrize("names", [["mkor"], ["mkor", "eva"]])
def test_without_lamb_nothing_is_reached(names: list[str]) -> None:
    target, rows = compare([run(n, [3, 2], 1.0) for n in names], window=1)
    assert target is None and all(r.steps_to_target is None for r in rows)
    assert "n/a (no LAMB run)" in comparison_table([run(n, [3, 2], 1.0) for n in names], 1)
