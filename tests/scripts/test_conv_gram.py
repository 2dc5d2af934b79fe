"""scripts/conv_gram.py times both ways of forming a convolution's A and leaves the switch."""

from __future__ import annotations

import core.layers
from scripts import conv_gram


def test_both_paths_are_timed_agree_and_the_switches_are_restored() -> None:
    printed: list[str] = []
    lines = conv_gram.main(["--shapes", "2x8x6", "2x8x1", "2x8x4", "--repeats", "1"],
                           out=printed.append)
    assert core.layers.SHIFTED_CONV_GRAM is True
    assert core.layers.SHIFTED_FLOP_FRACTION == 0.75
    shifted, costlier, close = lines
    assert shifted[0] == "2 x 8 x 6" and float(shifted[2]) > 0 and float(shifted[3]) > 0
    assert float(shifted[4]) < 0.75 and float(shifted[5]) < 1e-5  # fewer FLOPs, same factor
    assert shifted[6] == "shifted views"
    assert costlier[0] == "2 x 8 x 1" and costlier[2:] == ["", "", "", "", "patch rows"]
    # fewer FLOPs, but not enough of them to be used: timed all the same
    assert 0.75 <= float(close[4]) < 1 and float(close[2]) > 0 and close[6] == "patch rows"
    assert "| batch x channels x size | patch rows (ms) |" in printed[-1]
