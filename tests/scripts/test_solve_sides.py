"""scripts/solve_sides.py times both ways of applying ``A``'s side and names the library's."""

from __future__ import annotations

import pytest
import torch

from core import inverse
from scripts import bench, solve_sides


@pytest.mark.parametrize(("threshold", "choices"), [(None, ["right side", "right side"]),
                                                    (16, ["right side", "transposed"])])
def test_both_ways_are_timed_and_the_choice_follows_the_threshold(
        threshold: int | None, choices: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inverse, "TRANSPOSED_SOLVE_MIN_ROWS", threshold)
    printed: list[str] = []
    lines = solve_sides.main(["--shapes", "40x8", "30x20", "--repeats", "1"],
                             out=printed.append)
    assert [line[0] for line in lines] == ["40 x 8", "30 x 20"]
    assert [line[4] for line in lines] == choices
    assert all(float(cell) > 0 for line in lines for cell in line[1:4])
    assert "| A dim x rows | right side (ms) | transposed copy (ms) |" in printed[-1]


@pytest.mark.parametrize("transposed", [False, True])
def test_solve_from_right_is_the_dense_product_written_into_the_working_copy(
        transposed: bool) -> None:
    chol = torch.linalg.cholesky(bench.well_conditioned_spd(12, torch.device("cpu")).double())
    grad = torch.randn(7, 12, dtype=torch.float64)
    work = grad.clone()
    out = inverse.solve_from_right(work, chol, transposed=transposed)
    expected = grad @ torch.linalg.inv(chol @ chol.T)
    torch.testing.assert_close(out, expected)
    assert out.data_ptr() == work.data_ptr() and out.is_contiguous()
