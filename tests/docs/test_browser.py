"""Headless Chromium opens the built site on 127.0.0.1: every reproduction page renders its tables
and images, and the math renders with the vendored KaTeX.

The site is built from the repository's docs with every reproduction's page regenerated from a
synthetic reproduction (so the pages have tables and figures whatever is committed). Screenshots
are kept as test artefacts in ``$DOCS_TEST_ARTIFACTS`` (default ``.cache/test-artifacts/docs``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from scripts.make_docs_pages import PAPERS, write_pages
from tests.docs.helpers import REPO_ROOT, write_reproduction
from tests.docs.site import build_site, serve

CHROMIUM = Path("/usr/bin/chromium")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="no /usr/bin/chromium (apt-get install -y chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                       reason="mkdocs is not installed (pip install -e '.[docs]')"),
]


def artefacts_dir() -> Path:
    """Where screenshots are kept after the test."""
    path = Path(os.environ.get("DOCS_TEST_ARTIFACTS", REPO_ROOT / ".cache" / "test-artifacts"
                               / "docs"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def render(url: str, screenshot: Path) -> str:
    """Load ``url`` in headless Chromium, save a screenshot, return the DOM after scripts ran."""
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
             "--window-size=1280,2400", "--virtual-time-budget=5000",
             f"--screenshot={screenshot}", "--dump-dom", url],
            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's site, with each reproduction page generated from synthetic results."""
    root = tmp_path_factory.mktemp("repo")
    shutil.copy(REPO_ROOT / "mkdocs.yml", root)
    shutil.copytree(REPO_ROOT / "docs", root / "docs")
    for paper in PAPERS:
        write_reproduction(root, paper.slug)
    for source in ("core", "reproductions/__init__.py", "reproductions/common"):  # the API's
        (root / source).symlink_to(REPO_ROOT / source)
    write_pages(root, root / "docs")
    result = build_site(root / "mkdocs.yml", root / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    return root / "site"


@pytest.mark.parametrize("paper", [p.slug for p in PAPERS])
def test_reproduction_page_renders_its_tables_and_images(site: Path, paper: str) -> None:
    screenshot = artefacts_dir() / f"reproduction-{paper}.png"
    with serve(site) as base:
        page = f"{base}/reproductions/{paper}/"
        dom = render(page, screenshot)
        article = dom.split("<article", 1)[1].split("</article>", 1)[0]
        # the kinds legend, three rebuilt tables, the runs and the summary
        assert article.count("<table") >= 6
        assert "T1: Iterations and memory (exact)" in article
        assert "<th>paper</th>" in article and "<td>—</td>" in article  # unpublished, not run
        images = re.findall(r'<img[^>]+src="([^"]+)"', article)
        assert len(images) == 5, images
        for src in images:
            with urllib.request.urlopen(urllib.parse.urljoin(page, src), timeout=10) as reply:
                assert reply.status == 200 and reply.read(8) == PNG_MAGIC, src
    assert screenshot.read_bytes()[:8] == PNG_MAGIC
    assert screenshot.stat().st_size > 50_000  # a rendered page, not a blank one


def test_math_renders_with_the_vendored_katex(site: Path) -> None:
    with serve(site) as base:
        dom = render(f"{base}/concepts/kfac/", artefacts_dir() / "concepts-kfac.png")
    assert dom.count('class="katex"') > 20
    assert "katex-error" not in dom
