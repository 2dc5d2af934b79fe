"""The committed docs site builds offline with ``mkdocs build --strict``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from scripts.make_docs_pages import NO_RESULTS, PAPERS
from tests.docs.helpers import REPO_ROOT
from tests.docs.site import build_site

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs / mkdocs-material are not installed (pip install -e '.[docs]')")

#: Hosts a page may load nothing from: the site must work with no network.
EXTERNAL_LOADS = re.compile(
    r'<(?:script|link|img)[^>]+(?:src|href)="(?:https?:)?//(?!127\.0\.0\.1)[^"]+"')


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build_site(REPO_ROOT / "mkdocs.yml", out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_every_page_is_built(site: Path) -> None:
    for page in ("index.html", "faq/index.html", "tracking/index.html",
                 "concepts/distribution/index.html", "api/kfac/index.html",
                 "reproductions/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "kfac" / "index.html").read_text()
    assert 'id="core.preconditioner.KFACPreconditioner"' in api  # docstrings were rendered


def test_pages_load_nothing_from_the_network(site: Path) -> None:
    for page in site.glob("**/*.html"):
        html = page.read_text(encoding="utf-8")
        assert not EXTERNAL_LOADS.findall(html), page
        assert "fonts.googleapis.com" not in html, page
    assert (site / "vendor" / "katex" / "katex.min.js").is_file()


def test_each_reproduction_page_has_tables_or_says_it_has_no_results(site: Path) -> None:
    for paper in PAPERS:
        html = (site / "reproductions" / paper.slug / "index.html").read_text()
        assert NO_RESULTS in html or "Paper vs ours" in html, paper.slug
