"""The tables script on the committed results (M3) and at small shapes (M1, M2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reproductions.common.tables import load_tables
from reproductions.mkor import tables


def test_tables_from_the_committed_results(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tables.json"
    built = tables.main(["--model", "tiny", "--dims", "32,64", "--kfac-ranks", "2",
                         "--out", str(out)])
    paper, written = load_tables(out)
    assert paper == "mkor" and [t.id for t in written] == ["M1", "M2", "M3", "M4"]
    assert [t.rows for t in written] == [t.rows for t in built]
    text = capsys.readouterr().out
    for table in built:
        assert f"### {table.id}:" in text

    m1 = {(row[0], row[1]): row for row in built[0].rows}
    exponent = built[0].columns.index("ours: fitted exponent of d")
    assert m1[("MKOR", "memory (bytes)")][exponent] == pytest.approx(2, abs=0.1)
    assert m1[("MKOR", "communication per update (bytes)")][exponent] == pytest.approx(1, abs=0.1)
    assert m1[("KAISA (K-FAC)", "communication per update (bytes)")][exponent] == pytest.approx(
        2, abs=0.1)
    assert m1[("Eva", "memory (bytes)")][exponent] == pytest.approx(1, abs=0.1)

    m2 = {row[0]: row for row in built[1].rows}
    second = built[1].columns.index("ours: second-order state")
    assert m2["LAMB"][second] == 0 < m2["Eva"][second] < m2["MKOR"][second]
    assert m2["MKOR"][second] < m2["KAISA (K-FAC)"][second]

    m3 = built[2]
    assert m3.column("optimizer") == ["LAMB", "KAISA (K-FAC)", "MKOR", "MKOR-H", "Eva"]
    lamb = m3.rows[0]
    steps_run = m3.columns.index("ours: steps run")
    reached = m3.columns.index("ours: steps to LAMB's final loss")
    assert lamb[reached] is not None and lamb[reached] <= lamb[steps_run]
    assert built[3].kind == "needs data" and set(built[3].column("ours")) == {None}


def test_fitted_exponent() -> None:
    assert tables.fitted_exponent([2, 4, 8], [4, 16, 64]) == pytest.approx(2)
    assert tables.fitted_exponent([2, 4], [0, 1]) is None
