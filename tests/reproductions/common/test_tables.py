"""The tables schema: validation, a write/load round trip, Markdown."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from reproductions.common.tables import (
    SCHEMA,
    Table,
    TablesError,
    format_cell,
    load_tables,
    markdown_grid,
    tables_destination,
    update_tables,
    write_tables,
)


def table() -> Table:
    return Table("D1", "Communication", "exact", ["model", "paper", "ours (MB)"],
                 [["ResNet-50", "2.79–3.15×", 1211.6], ["x | y", None, math.nan]],
                 notes="from the ledger")


def test_round_trip(tmp_path: Path) -> None:
    path = write_tables(tmp_path / "t.json", "dpkfac", [table()])
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["tables"][0]["rows"][1] == ["x | y", None, None]
    paper, (loaded,) = load_tables(path)
    assert paper == "dpkfac"
    assert loaded == Table("D1", "Communication", "exact", ["model", "paper", "ours (MB)"],
                           [["ResNet-50", "2.79–3.15×", 1211.6], ["x | y", None, None]],
                           "from the ledger")
    assert loaded.column("ours (MB)") == [1211.6, None]


def test_update_replaces_in_place_keeps_the_rest_and_appends_new(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    first, second = table(), Table("D2", "Memory", "exact", ["paper", "ours"], [[1, 2]], "n")
    update_tables(path, "dpkfac", [first, second])  # a new file is written as is
    fresh = Table("D1", "Communication", "exact", ["paper", "ours"], [[3, 4]], "again")
    added = Table("D3", "Time", "modelled", ["paper", "ours"], [[5, 6]], "m")
    update_tables(path, "dpkfac", [added, fresh])
    assert [t.id for t in load_tables(path)[1]] == ["D1", "D2", "D3"]
    assert load_tables(path)[1][0] == fresh and load_tables(path)[1][1] == second
    with pytest.raises(TablesError, match="holds the tables of 'dpkfac'"):
        update_tables(path, "mkor", [added])


def test_markdown() -> None:
    text = table().markdown()
    assert text.splitlines()[0] == "### D1: Communication (exact)"
    assert "| ResNet-50 | 2.79–3.15× | 1,211.6 |" in text
    assert "| x &#124; y | — | — |" in text
    assert text.endswith("from the ledger")


def test_markdown_grid_keeps_every_text_in_its_cell() -> None:
    """A literal backslash before a pipe (``x\\|y``) split its cell in two under the
    backslash escape, and a carriage return split the row; the title's line break the
    heading."""
    assert markdown_grid(["a|b", "c"], [["x\ny", "z"], ["x\\|y", "u\r\nv"]]).splitlines() == [
        "| a&#124;b | c |", "|---|---|", "| x y | z |", "| x\\&#124;y | u v |"]
    titled = Table("D9", "two\nlines", "exact", ["paper", "ours"], [[1, 2]], "notes")
    assert titled.markdown().splitlines()[0] == "### D9: two lines (exact)"


@pytest.mark.parametrize("change, message", [
    ({"kind": "guessed"}, "kind must be one of"),
    ({"rows": [["a"]]}, "rows\\[0\\] has 1 cells for 3 columns"),
    ({"rows": [["a", True, 1]]}, "must be a string, a number or null"),
    ({"notes": ["a list"]}, "notes must be a string"),
])
def test_invalid_tables(change: dict, message: str) -> None:
    fields = {"id": "D1", "title": "t", "kind": "exact", "columns": ["a", "b", "c"],
              "rows": [], **change}
    with pytest.raises(TablesError, match=message):
        Table(**fields)


def test_load_names_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"schema": SCHEMA, "paper": "p", "tables": [{"id": "D1"}]}))
    with pytest.raises(TablesError, match=r"bad.json: tables\[0\]: field 'title'"):
        load_tables(path)
    with pytest.raises(TablesError, match="ids repeat"):
        write_tables(tmp_path / "t.json", "p", [table(), table()])


@pytest.mark.parametrize(("value", "text"), [
    (0.5, "0.5"), (0.9996, "1.00"), (-0.9996, "-1.00"), (1.0, "1.00"), (9.99, "9.99"),
    (9.996, "10.0"), (99.96, "100.0"), (12345.67, "12,345.7"), (0.001234, "0.00123"),
    (3, "3"), (None, "—"),
])
def test_format_cell_picks_the_range_of_the_value_as_shown(value: object, text: str) -> None:
    """The number of decimals follows the rounded value, so 0.9996 is not shown as "1"."""
    assert format_cell(value) == text


def test_a_variant_or_partial_tables_run_never_writes_the_committed_file() -> None:
    """Options that choose tables (``--sections``: the others are kept) leave the committed
    file the destination; any option that changes what the tables hold sends them to
    ``runs/<paper>/``; an output the user names always wins."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", nargs="+", default=["A", "B"])
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    committed = Path("reproductions/x/results/tables.json")

    def destination(*argv: str) -> Path:
        return tables_destination(parser.parse_args(argv), parser, output="out",
                                  committed=committed, paper="x", selectors=("sections",))

    assert destination() == committed
    assert destination("--sections", "A") == committed
    assert destination("--world-size", "8") == Path("runs/x/tables.json")
    assert destination("--world-size", "64") == committed
    assert destination("--world-size", "8", "--out", "mine.json") == Path("mine.json")
