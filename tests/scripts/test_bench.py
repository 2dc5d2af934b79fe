"""scripts/bench.py runs its quick mode on tiny models and prints and writes its tables.

A smoke test, not a timed one: it checks every method runs through the benchmark and that the
report has its parts, not what the numbers are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import bench


def test_quick_run_prints_every_table_and_writes_json(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    result = bench.main(["--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    for title in ("environment", "rates", "results", "bounds", "targets"):
        assert f"### {title}" in printed
    assert "torch_threads: 1" in printed and "load average" in printed
    written = json.loads(out.read_text())
    assert written["tables"] == result["tables"]
    rows = {(r["workload"], r["method"], r["interval"]) for r in written["rows"]}
    assert rows == {(w, m.name, n) for w in bench.QUICK for m in bench.METHODS
                    for n in bench.INTERVALS}
    for row in written["rows"]:
        assert row["step_s"] > 0 and row["ratio"] > 0
        assert set(row["stages_s"]) == set(bench.COLUMNS)
        assert row["failures"] == 0
    for workload in bench.QUICK:
        assert f"| {workload} | kfac-inverse | 10 |" in printed


def test_amortized_step_and_update_schedule() -> None:
    assert bench.amortize(10.0, 1.0, 1) == 10.0
    assert bench.amortize(10.0, 1.0, 10) == pytest.approx(1.9)
    interval = bench.update_schedule(frozenset({0, 2, 5}))
    due = [step for step in range(8) if step % interval(step) == 0]
    assert due == [0, 2, 5]
