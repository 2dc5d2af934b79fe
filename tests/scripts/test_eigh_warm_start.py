"""scripts/eigh_warm_start.py: the warm start against a full eigh, and its report."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scripts import eigh_warm_start as warm


def test_warm_start_from_the_exact_basis_reproduces_the_decomposition() -> None:
    torch.manual_seed(0)
    x = torch.randn(12, 40, dtype=torch.float64)
    factor = x @ x.T / 40
    q, d = warm.refresh_full(factor)
    q_warm, d_warm = warm.refresh_warm(factor, q)
    assert torch.allclose(q_warm @ torch.diag(d_warm) @ q_warm.T, factor, atol=1e-10)
    assert torch.allclose(torch.sort(d_warm).values, d, atol=1e-10)


def test_damped_solve_error_is_zero_for_the_exact_inverse_and_large_for_the_identity() -> None:
    torch.manual_seed(1)
    x = torch.randn(10, 30, dtype=torch.float64)
    factor = x @ x.T / 30
    vectors = torch.randn(10, 3, dtype=torch.float64)
    q, d = warm.refresh_full(factor)
    assert warm.damped_solve_error(q, d, factor, 1e-2, vectors) < 1e-10
    identity = torch.eye(10, dtype=torch.float64)
    assert warm.damped_solve_error(identity, torch.zeros(10, dtype=torch.float64), factor, 1e-2,
                                   vectors) > 0.5


def test_run_prints_the_table_and_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "warm.json"
    rows = warm.main(["--sizes", "16", "32", "--trials", "2", "--interval", "3",
                      "--json", str(out)])
    printed = capsys.readouterr().out
    assert "| 16 |" in printed and "| 32 |" in printed
    saved = json.loads(out.read_text())
    assert [r["n"] for r in saved["rows"]] == [16, 32] and saved["interval"] == 3
    for row in rows:  # the fresh decomposition beats the stale one it replaces
        assert row.error_exact < row.error_stale and row.eigh_s > 0 and row.warm_s > 0


def test_benchmarks_page_shows_the_committed_run() -> None:
    root = Path(__file__).resolve().parents[2]
    saved = json.loads((root / "scripts/results/eigh_warm_start_cpu.json").read_text())
    rows = [warm.WarmStartRow(**r) for r in saved["rows"]]
    assert warm.table(rows) in (root / "docs/benchmarks.md").read_text()
