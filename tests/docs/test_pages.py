"""The reproduction-page generator on synthetic results files (scripts/make_docs_pages.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scripts.make_docs_pages import (
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
    TABLE_DEVIATION,
    tables_data,
    write_reproduction,
)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pages generated from one synthetic reproduction (mkor); the others have nothing."""
    root = tmp_path_factory.mktemp("repo")
    write_reproduction(root, "mkor")
    write_pages(root, root / "docs")
    return root / "docs" / "reproductions"


def test_tables_show_the_papers_number_ours_its_kind_and_the_reason(generated: Path) -> None:
    page = (generated / "mkor.md").read_text()
    assert "| what | paper (published) | ours | kind of ours | what differs and why |" in page
    assert "| iterations at B = 131,072 | 978 | 978 | exact | same formula |" in page
    assert "| optimizer memory | 23.34 GB | 0.0469 GB | small | a small model on a CPU |" in page
    # A number the paper does not give is never filled in; a pipe in a note is escaped.
    assert "| top-1 accuracy | not published | 88.25 % | small | Fashion-MNIST \\| one seed |" \
        in page
    assert "| time to 75% | 3.1 h | not run yet | needs data | needs ImageNet |" in page
    assert "Paper's numbers from the paper's Table 1." in page


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
    assert f"### Noted with the tables\n\n- **T1**: {TABLE_DEVIATION}" in deviations


def test_a_reproduction_without_results_says_so_and_shows_no_numbers(generated: Path) -> None:
    page = (generated / "dpkfac.md").read_text()
    assert NO_RESULTS in page
    assert "## Paper vs ours" not in page and "![" not in page
    assert not list((generated / "img").glob("dpkfac-*"))


def test_the_index_lists_what_each_reproduction_has(generated: Path) -> None:
    index = (generated / "index.md").read_text()
    assert "[MKOR](mkor.md)" in index and "2 runs (default), 1 tables" in index
    assert "0 runs (none), 0 tables" in index


def test_stale_figures_are_removed(tmp_path: Path) -> None:
    img = tmp_path / "docs" / "reproductions" / "img"
    img.mkdir(parents=True)
    (img / "osawa2018-gone-loss.png").write_bytes(b"old")
    write_pages(tmp_path, tmp_path / "docs")
    assert not (img / "osawa2018-gone-loss.png").exists()


@pytest.mark.parametrize(("change", "field"), [
    (lambda row: row.pop("kind"), "rows[0]: field 'kind'"),
    (lambda row: row.pop("ours"), "rows[0]: field 'ours' is missing"),
    (lambda row: row.update(kind="guessed"), "field 'kind' must be one of"),
])
def test_a_bad_tables_file_names_the_file_and_field(tmp_path: Path, change, field: str) -> None:
    data = tables_data("mkor")
    change(data["tables"][0]["rows"][0])
    path = tmp_path / "reproductions" / "mkor" / "results" / "tables.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    with pytest.raises(PagesError, match=re.escape(field)) as error:
        read_paper(tmp_path / "reproductions" / "mkor")
    assert str(path) in str(error.value)


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
    assert read_paper(tmp_path).empty
    assert "skipping" in capsys.readouterr().err


def test_readme_section_stops_at_the_next_heading_of_its_level() -> None:
    text = "# Known deviations\na\n## Sub\nb\n# Next\nc\n"
    assert readme_section(text, "deviation") == "a\n### Sub\nb"
    assert readme_section(text, "missing") == ""


@pytest.mark.parametrize(("value", "unit", "text"), [
    (None, "", "—"), (float("nan"), "GB", "—"), (1234567, "", "1,234,567"),
    (0.123456, "s", "0.1235 s"), (98765.4, "", "98,765"), (True, "", "yes"), ("3 h", "", "3 h"),
])
def test_fmt(value: object, unit: str, text: str) -> None:
    assert fmt(value, unit) == text


def test_committed_pages_are_what_the_committed_results_give(tmp_path: Path) -> None:
    write_pages(REPO_ROOT, tmp_path)
    for name in ["index.md", *(f"{paper.slug}.md" for paper in PAPERS)]:
        assert (tmp_path / "reproductions" / name).read_text() == \
            (REPO_ROOT / "docs" / "reproductions" / name).read_text(), \
            f"docs/reproductions/{name} is stale: run `make docs` and commit it"
