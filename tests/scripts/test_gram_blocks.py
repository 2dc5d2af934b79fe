"""scripts/gram_blocks.py times every way of forming a factor and leaves the defaults alone."""

from __future__ import annotations

import core.factors
from scripts import gram_blocks


def test_every_path_is_timed_against_the_bound_and_the_defaults_are_restored() -> None:
    printed: list[str] = []
    defaults = core.factors.GRAM_BLOCK, core.factors.HOST_SYRK
    lines = gram_blocks.main(["--shapes", "600x64", "300x32", "--repeats", "1"],
                             out=printed.append)
    assert (core.factors.GRAM_BLOCK, core.factors.HOST_SYRK) == defaults
    assert [line[0] for line in lines] == ["600 x 64", "300 x 32"]
    # 600: blocks of 256 and 512, one GEMM, syrk; 300: blocks of 256 only, one GEMM, syrk
    filled = [[cell != "" for cell in line[2:]] for line in lines]
    assert filled == [[True, True, False, False, True, True],
                      [True, False, False, False, True, True]]
    assert all(float(cell) > 0 for line in lines for cell in line[1:] if cell)
    assert "| factor dim x rows | bound (ms) | blocks of 256 |" in printed[-1]
