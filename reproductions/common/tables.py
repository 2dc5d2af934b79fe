"""Rebuilt paper tables as data, in one schema for every reproduction (``kfac-repro/tables/v1``).

A reproduction's ``tables.py`` builds :class:`Table` objects, writes them with
:func:`write_tables` under its ``results/`` folder (the docs site renders that file) and prints
:meth:`Table.markdown`. One file::

    {"schema": "kfac-repro/tables/v1", "paper": "dpkfac",
     "tables": [{"id": "D1", "title": "Communication per worker ...",
                 "kind": "exact",              # one of KINDS (TABLES.md)
                 "columns": ["model", "scheme", "paper", "ours (MB)", ...],
                 "rows": [["ResNet-50", "DP-KFAC", null, 100.4, ...], ...],
                 "notes": "how the numbers were made, the paper's source, deviations"}]}

Cells are strings, numbers or null (NaN and infinities are written as null: strict JSON). Every
results table shows the paper's number, ours, and what differs and why: a column whose name starts
with "paper" (the published numbers, null where the paper gives none), one whose name starts with
"ours", and ``notes`` citing the paper's source and the deviations. The docs generator
(``scripts/make_docs_pages.py``) refuses a table without them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data.atomic import atomic_path

SCHEMA = "kfac-repro/tables/v1"
"""The ``schema`` field's value; changes whenever a field's meaning changes."""

KINDS = ("exact", "small", "modelled", "needs data")
"""What a table's numbers are (TABLES.md): hardware-independent at the paper's scale; a real run
at small scale; measured parts combined by a documented model; a script that needs the user's
data."""

Cell = str | int | float | None


class TablesError(ValueError):
    """A tables file or object does not follow the schema (the message names the field)."""


def _json_cell(value: Any, where: str) -> Cell:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TablesError(f"{where} must be a string, a number or null, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass
class Table:
    """One rebuilt table.

    Attributes:
        id: The table's id in TABLES.md (``"D1"``).
        title: What the table shows.
        kind: One of :data:`KINDS`.
        columns: Column names.
        rows: One list of cells per row, as long as ``columns``.
        notes: How the numbers were made, sources, deviations (Markdown).

    Raises:
        TablesError: a bad kind, a row of the wrong length or a cell that is not a string, a
            number or None.
    """

    id: str
    title: str
    kind: str
    columns: list[str]
    rows: list[list[Cell]]
    notes: str = ""

    def __post_init__(self) -> None:
        where = f"table {self.id!r}"
        if not self.id or not isinstance(self.id, str):
            raise TablesError(f"a table's id must be a non-empty string, got {self.id!r}")
        if self.kind not in KINDS:
            raise TablesError(f"{where}: kind must be one of {', '.join(KINDS)}, "
                              f"got {self.kind!r}")
        if not self.columns or not all(isinstance(c, str) for c in self.columns):
            raise TablesError(f"{where}: columns must be a non-empty list of strings")
        if not isinstance(self.notes, str):
            raise TablesError(f"{where}: notes must be a string, got {self.notes!r}")
        width = len(self.columns)
        self.rows = [list(row) for row in self.rows]
        for r, row in enumerate(self.rows):
            if len(row) != width:
                raise TablesError(f"{where}: rows[{r}] has {len(row)} cells for {width} columns")
            row[:] = [_json_cell(cell, f"{where}: rows[{r}][{c}]") for c, cell in enumerate(row)]

    def column(self, name: str) -> list[Cell]:
        """The cells of column ``name``."""
        index = self.columns.index(name)
        return [row[index] for row in self.rows]

    def markdown(self) -> str:
        """The table as Markdown: a heading with id, title and kind, the grid, the notes."""
        grid = markdown_grid(self.columns, ([format_cell(c) for c in row] for row in self.rows))
        text = f"### {self.id}: {one_line(self.title)} ({self.kind})\n\n{grid}"
        return f"{text}\n\n{self.notes}" if self.notes else text

    @classmethod
    def from_json(cls, data: Any, where: str = "table") -> Table:
        """A table from its JSON object.

        Raises:
            TablesError: a field is missing or of the wrong type (named with ``where``).
        """
        if not isinstance(data, dict):
            raise TablesError(f"{where} must be an object")
        for key, kind in (("id", str), ("title", str), ("kind", str), ("columns", list),
                          ("rows", list)):
            if not isinstance(data.get(key), kind):
                raise TablesError(f"{where}: field '{key}' must be a {kind.__name__}, "
                                  f"got {data.get(key)!r}")
        if not all(isinstance(row, list) for row in data["rows"]):
            raise TablesError(f"{where}: every row must be a list of cells")
        try:
            return cls(data["id"], data["title"], data["kind"], data["columns"], data["rows"],
                       data.get("notes") or "")
        except TablesError as err:
            raise TablesError(f"{where}: {err}") from None


def format_cell(value: Cell) -> str:
    """A cell for reading: integers with thousands separators, floats with one decimal from 10
    up, two from 1 to 10 and three significant digits below 1; ``—`` for null."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    # The range is chosen by the value as it will be shown (0.9996 shows as 1.00, not 1).
    if abs(float(f"{value:.3g}")) < 1:
        return f"{value:.3g}"
    if abs(round(value, 2)) < 10:
        return f"{value:.2f}"
    return f"{value:,.1f}"


def one_line(text: str) -> str:
    """``text`` with every line break (``\\n``, ``\\r\\n``, ``\\r`` ...) turned into a space."""
    return " ".join(text.splitlines())


def markdown_grid(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table of text cells, each escaped to stay in its cell: ``|`` as its HTML
    entity (a backslash escape breaks where the text has a backslash before it), every kind
    of line break as a space.

    Args:
        columns: The header.
        rows: One sequence of texts per row.

    Returns:
        The header line, the separator line and one line per row.
    """
    def line(cells: Iterable[str]) -> str:
        return "| " + " | ".join(one_line(c).replace("|", "&#124;") for c in cells) + " |"

    return "\n".join([line(columns), "|" + "---|" * len(columns), *map(line, rows)])


def write_tables(path: Path, paper: str, tables: Sequence[Table]) -> Path:
    """Write ``tables`` of ``paper`` as one ``kfac-repro/tables/v1`` file, atomically.

    Returns:
        ``path``.
    """
    ids = [t.id for t in tables]
    if len(set(ids)) != len(ids):
        raise TablesError(f"table ids repeat: {ids}")
    data = {"schema": SCHEMA, "paper": paper, "tables": [asdict(t) for t in tables]}
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def update_tables(path: Path, paper: str, tables: Sequence[Table]) -> Path:
    """Write ``tables`` into ``path``, keeping the file's other tables (rebuilding a few
    sections must not drop the rest). A table replaces the one with its id, in place; new ids
    go last.

    Raises:
        TablesError: the existing file is unreadable or belongs to another paper.
    """
    path = Path(path)
    if not path.exists():
        return write_tables(path, paper, tables)
    owner, kept = load_tables(path)
    if owner != paper:
        raise TablesError(f"{path}: holds the tables of {owner!r}, not {paper!r}")
    fresh = {t.id: t for t in tables}
    merged = [fresh.pop(t.id, t) for t in kept]
    return write_tables(path, paper, merged + list(fresh.values()))


def read_schema_file(path: Path, schema: str, error: type[Exception], fix: str = ""
                     ) -> dict[str, Any]:
    """A JSON object from ``path`` whose ``schema`` field is ``schema``.

    Args:
        path: The file.
        schema: The ``schema`` it must declare.
        error: The exception type raised (a user error that the command lines report in one
            line).
        fix: What to do when the file cannot be read (appended to that message).

    Raises:
        Exception: ``error``, starting with the path, when the file is missing, not JSON, or
            not an object of ``schema``.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise error(f"{path}: cannot be read as JSON ({err}){fix}") from None
    if not isinstance(data, dict) or data.get("schema") != schema:
        raise error(f"{path}: field 'schema' must be {schema!r}")
    return data


def load_tables(path: Path) -> tuple[str, list[Table]]:
    """Read and validate a tables file.

    Returns:
        The paper's name and its tables, in file order.

    Raises:
        TablesError: the file is missing, not JSON or not in the schema; the message starts
            with the path.
    """
    path = Path(path)
    data = read_schema_file(path, SCHEMA, TablesError)
    if not isinstance(data.get("paper"), str) or not isinstance(data.get("tables"), list):
        raise TablesError(f"{path}: needs a 'paper' string and a 'tables' list")
    tables = [Table.from_json(t, f"{path}: tables[{i}]") for i, t in enumerate(data["tables"])]
    return data["paper"], tables


def tables_destination(args: argparse.Namespace, parser: argparse.ArgumentParser, *,
                       output: str, committed: Path, paper: str,
                       selectors: Sequence[str] = ()) -> Path:
    """Where a ``tables`` command writes: the file the user chose; else the committed tables
    (which the docs site is built from) when every option that changes what the tables hold
    is at its default; else ``runs/<paper>/tables.json``, so that a quick or partial variant
    never writes over the paper-scale tables.

    Args:
        args: The parsed command line.
        parser: Its parser (for the defaults).
        output: The destination of the output option, whose default must be None.
        committed: The committed tables file.
        paper: The reproduction's name (``runs/<paper>/``).
        selectors: Options that choose which tables to rebuild, not what they hold (such as
            ``sections``, where the others are kept), and options that change nothing in them.
    """
    chosen = getattr(args, output)
    if chosen is not None:
        return Path(chosen)
    variant = any(value != parser.get_default(name) for name, value in vars(args).items()
                  if name not in {*selectors, output})
    return Path("runs") / paper / "tables.json" if variant else committed
