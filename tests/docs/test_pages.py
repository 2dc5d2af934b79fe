"""The reproduction-page generator on synthetic results files (scripts/make_docs_pages.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reproductions.common.tables import KINDS, TablesError, write_tables
from scripts import make_docs_pages
from scripts.make_docs_pages import (
    KIND_MEANINGS,
    NO_RESULTS,
    PAPERS,
    PagesError,
    fmt,
    read_paper,
    readme_section,
    write_pages,
)
from tests.docs.helpers import (
    DEVIATION,
    OPTIMIZERS,
    REPO_ROOT,
    TABLE_NOTES,
    TABLES_FILE,
    paper_tables,
    write_reproduction,
)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pages generated from one synthetic reproduction (mkor); the others have nothing."""
    root = tmp_path_factory.mktemp("repo")
    write_reproduction(root, "mkor")
    write_pages(root, root / "docs")
    return root / "docs" / "reproductions"


def test_tables_show_the_papers_number_ours_their_kind_and_notes(generated: Path) -> None:
    page = (generated / "mkor.md").read_text()
    for table in paper_tables():  # as Table.markdown() renders it: heading, grid, notes
        assert f"\n{table.markdown()}\n" in page
    assert "### T1: Iterations and memory (exact)\n\n| quantity | paper | ours |" in page
    assert "| iterations at B = 131,072 | 978 | 978 |" in page
    assert "| optimizer memory (GB) | 23.3 | 0.0469 |" in page
    # A number the paper does not give is never filled in; a pipe in a cell is escaped.
    assert "| top-1 accuracy (%) | — | 88.5 | Fashion-MNIST &#124; one seed |" in page
    assert "### T3: Time to accuracy (needs data)" in page and "| time to 75% | 3.1 h | — |" in page
    for kind, meaning in KIND_MEANINGS.items():  # the legend of the kinds in the headings
        assert f"| {kind} | {meaning} |" in page


def test_every_kind_has_a_meaning() -> None:
    assert tuple(KIND_MEANINGS) == KINDS


def test_runs_figures_and_configurations(generated: Path) -> None:
    page = (generated / "mkor.md").read_text()
    figures = sorted(p.name for p in (generated / "img").glob("mkor-*.png"))
    assert figures == [f"mkor-default-{kind}.png"
                       for kind in ("comm", "eval", "loss", "memory", "time")]
    for name in figures:
        assert f"](img/{name})" in page
        assert (generated / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![evaluation curves: accuracy](img/mkor-default-eval.png)" in page  # not the epoch
    for optimizer in OPTIMIZERS:
        assert f'??? note "Configuration of {optimizer} (seed 0)"' in page
        assert f"| {optimizer} (seed 0) | 11 |" in page  # the last step
    assert "| final_loss | 0.4 | 0.5 |" in page  # runs sorted by optimizer: kfac, sgd


def test_deviations_come_from_the_readme_and_the_tables(generated: Path) -> None:
    page = (generated / "mkor.md").read_text()
    deviations = page.split("## Deviations", 1)[1]
    assert DEVIATION in deviations
    assert "\n### Detail\n" in deviations  # the README's subsection, nested under the page's
    assert "python -m x" not in deviations  # the README's next section is left out
    assert f"### Noted with the tables\n\n- **T1**: {TABLE_NOTES}\n" in deviations
    # A note's second line stays in its list item.
    assert "- **T3**: Needs ImageNet; not run yet.\n    The paper's time is on 1,024 GPUs." \
        in deviations


def test_a_reproduction_without_results_says_so_and_shows_no_numbers(generated: Path) -> None:
    page = (generated / "dpkfac.md").read_text()
    assert NO_RESULTS in page
    assert "## Paper vs ours" not in page and "![" not in page
    assert not list((generated / "img").glob("dpkfac-*"))


def test_the_index_lists_what_each_reproduction_has(generated: Path) -> None:
    index = (generated / "index.md").read_text()
    assert "[MKOR](mkor.md)" in index and "2 runs (default), 3 tables" in index
    assert "0 runs (none), 0 tables" in index


def test_stale_figures_are_removed(tmp_path: Path) -> None:
    (tmp_path / "reproductions").mkdir()
    img = tmp_path / "docs" / "reproductions" / "img"
    img.mkdir(parents=True)
    (img / "osawa2018-gone-loss.png").write_bytes(b"old")
    write_pages(tmp_path, tmp_path / "docs")
    assert not (img / "osawa2018-gone-loss.png").exists()


@pytest.mark.parametrize(("change", "error", "field"), [
    (lambda table: table.pop("kind"), TablesError, "field 'kind' must be a str"),
    (lambda table: table.update(kind="guessed"), TablesError, "kind must be one of"),
    (lambda table: table.update(columns=["quantity", "paper", "measured"]), PagesError,
     "field 'columns' has no column named 'ours...'"),
    (lambda table: table.update(columns=["quantity", "published", "ours"]), PagesError,
     "field 'columns' has no column named 'paper...'"),
    (lambda table: table.update(notes=" "), PagesError, "field 'notes' is empty"),
    (lambda table: table.pop("notes"), PagesError, "field 'notes' is empty"),
])
def test_a_bad_tables_file_names_the_file_table_and_field(tmp_path: Path, change,
                                                          error: type[Exception],
                                                          field: str) -> None:
    path = write_tables(tmp_path / "results" / TABLES_FILE, "mkor", paper_tables())
    data = json.loads(path.read_text())
    change(data["tables"][0])
    path.write_text(json.dumps(data))
    with pytest.raises(error, match=re.escape(field)) as raised:
        read_paper(tmp_path)
    assert str(path) in str(raised.value)
    assert "'T1'" in str(raised.value) or "tables[0]" in str(raised.value)


def test_a_bad_file_or_root_ends_in_one_line_and_leaves_the_pages_as_they_were(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A truncated results file gave a traceback after the paper's figures were deleted (its
    page still linking them); a --root without reproductions/ wrote "no results" pages."""
    write_reproduction(tmp_path, "mkor")
    docs = tmp_path / "docs"
    write_pages(tmp_path, docs)
    pages = {p: p.read_bytes() for p in (docs / "reproductions").rglob("*") if p.is_file()}
    assert any(p.suffix == ".png" for p in pages)
    (tmp_path / "reproductions" / "mkor" / "results" / "zz-broken.json").write_text('{"sch')
    for root, says in ((tmp_path, "zz-broken.json: not valid JSON"),
                       (tmp_path / "typo", "holds no reproductions/ folder")):
        with pytest.raises(SystemExit) as info:
            make_docs_pages.main(["--root", str(root), "--docs", str(docs)])
        assert info.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("make_docs_pages: ") and says in err and "Traceback" not in err
        assert {p: p.read_bytes() for p in (docs / "reproductions").rglob("*")
                if p.is_file()} == pages
    # --docs naming a file: NotADirectoryError's traceback
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as info:
        make_docs_pages.main(["--root", str(tmp_path), "--docs", str(tmp_path / "a-file")])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "Traceback" not in err
    assert err.startswith("make_docs_pages: --docs ") and "pass a docs directory" in err


def test_runs_of_a_sweep_get_labels_that_tell_them_apart() -> None:
    """Four K-FAC runs of a learning-rate sweep were all "kfac (seed 0)": one table column
    header, one bar row and one legend entry for four runs."""
    runs = [{"optimizer": o, "experiment": "study", "config": {"seed": 0, "lr": lr, "name": "x"}}
            for o in ("kfac", "sgd") for lr in (10, 1)] + [
        {"optimizer": "mkor", "experiment": "study", "config": {"seed": 0, "lr": 1}}] * 2
    labels = [run[make_docs_pages.LABEL] for run in make_docs_pages.labelled(runs)]
    assert labels == ["kfac (seed 0) lr=10", "kfac (seed 0) lr=1", "sgd (seed 0) lr=10",
                      "sgd (seed 0) lr=1", "mkor (seed 0) #5", "mkor (seed 0) #6"]
    assert [make_docs_pages.run_label(r) for r in make_docs_pages.labelled(runs)] == labels
    # runs that differ only in a fourth setting, or in a value's type, are told apart too
    many = [{"optimizer": "kfac", "experiment": "s",
             "config": {"a": 1, "b": 2, "c": 3, "d": d}} for d in (0.1, "0.1")]
    named = [run[make_docs_pages.LABEL] for run in make_docs_pages.labelled(many)]
    assert named == ['kfac d=0.1', 'kfac d="0.1"']


def test_a_truncated_json_file_fails_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "results" / "run.json"
    path.parent.mkdir()
    path.write_text('{"schema": "kfac-repro/res')
    with pytest.raises(PagesError, match=re.escape(f"{path}: not valid JSON")):
        read_paper(tmp_path)


def test_files_in_another_schema_are_skipped_with_a_note(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "results" / "notes.json"
    path.parent.mkdir()
    path.write_text('{"schema": "something/else"}')
    (tmp_path / "results" / "grid.json").write_text('{"schema": "kfac-repro/some-sweep/v1"}')
    assert read_paper(tmp_path).empty
    err = capsys.readouterr().err
    assert "skipping" in err and "notes.json" in err
    assert "grid.json" not in err  # the project's own measurement files, without a note


def test_readme_section_stops_at_the_next_heading_of_its_level() -> None:
    text = "# Known deviations\na\n## Sub\nb\n# Next\nc\n"
    assert readme_section(text, "deviation") == "a\n### Sub\nb"
    assert readme_section(text, "missing") == ""


def test_readme_section_reads_hashes_in_fenced_code_as_code() -> None:
    """A ``# comment`` in a fenced block of the section ended the section inside the fence,
    which left the page an unclosed code block from there on."""
    text = ("## Deviations\na\n```bash\n# a shell comment\nrun\n```\n~~~\n# more\n~~~\nb\n"
            "## Next\nc\n")
    assert readme_section(text, "deviation") == (
        "a\n```bash\n# a shell comment\nrun\n```\n~~~\n# more\n~~~\nb")
    assert readme_section("```\n# Deviations\n```\n", "deviation") == ""


@pytest.mark.parametrize(("value", "unit", "text"), [
    (None, "", "—"), (float("nan"), "GB", "—"), (1234567, "", "1,234,567"),
    (0.123456, "s", "0.1235 s"), (98765.4, "", "98,765"), (True, "", "yes"), ("3 h", "", "3 h"),
    (9999.7, "s", "10,000 s"), (9999.4, "", "9999"),
])
def test_fmt(value: object, unit: str, text: str) -> None:
    assert fmt(value, unit) == text


def test_committed_pages_are_what_the_committed_results_give(tmp_path: Path) -> None:
    write_pages(REPO_ROOT, tmp_path)
    for name in ["index.md", *(f"{paper.slug}.md" for paper in PAPERS)]:
        assert (tmp_path / "reproductions" / name).read_text() == \
            (REPO_ROOT / "docs" / "reproductions" / name).read_text(), \
            f"docs/reproductions/{name} is stale: run `make docs` and commit it"


def test_a_sweeps_runs_are_counted_and_summarised_not_drawn(tmp_path: Path) -> None:
    """A results folder with a ``grid.json`` holds a sweep (one short run per cell, which a
    table summarises): its runs are validated and counted, and get no section or figures of
    their own (DP-KFAC's 41-run damping x interval grid drew 105 figures)."""
    directory = write_reproduction(tmp_path, "dpkfac")
    sweep = directory / "results" / "grid"
    sweep.mkdir()
    for run in (directory / "results").glob("default-*.json"):
        data = json.loads(run.read_text())
        data["experiment"] = f"cell-{data['optimizer']}"
        (sweep / run.name).write_text(json.dumps(data))
    (sweep / "grid.json").write_text('{"schema": "grid/v1"}')
    found = read_paper(directory)
    assert found.sweeps == {"grid": len(OPTIMIZERS)}
    assert {run["experiment"] for run in found.runs} == {"default"}
    write_pages(tmp_path, tmp_path / "docs")
    page = (tmp_path / "docs" / "reproductions" / "dpkfac.md").read_text()
    count = len(OPTIMIZERS)
    assert f"The {count} runs of the sweep in `reproductions/dpkfac/results/grid/`" in page
    assert "### cell-" not in page
    assert not list((tmp_path / "docs" / "reproductions" / "img").glob("dpkfac-cell-*"))
    index = (tmp_path / "docs" / "reproductions" / "index.md").read_text()
    assert f"{len(OPTIMIZERS)} runs of the grid sweep" in index
