"""scripts/cold_operands.py times each product hot and after each flush, against its bound."""

from __future__ import annotations

from scripts import cold_operands


def test_every_shape_and_dtype_is_timed_hot_and_after_each_flush() -> None:
    printed: list[str] = []
    lines = cold_operands.main(["--shapes", "64x48x40", "--flush-mb", "1", "2",
                                "--repeats", "1"], out=printed.append)
    assert [line[:2] for line in lines] == [["64 x 48 x 40", "float32"],
                                            ["64 x 48 x 40", "bfloat16"]]
    # the bound, then hot and one column per flush size, each a positive multiple of it
    assert all(len(line) == 6 and all(float(cell) > 0 for cell in line[2:]) for line in lines)
    assert ("| m x k x n | dtype | bound (µs) | hot / bound | after 1 MB written / bound "
            "| after 2 MB written / bound |") in printed[-1]
