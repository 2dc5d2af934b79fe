"""Fixtures of the MKOR reproduction's tests: a small English corpus and isolated caches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

WORDS = ("the a one every small large quick slow model layer matrix vector gradient step "
         "learns moves reads writes keeps finds sees makes under over with from into "
         "optimizer factor curvature inverse update batch token sentence word data").split()


def english_like_lines(count: int, seed: int = 0) -> list[str]:
    """Deterministic sentences of common words, one per line (enough for a 200-token vocab)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "."
            for _ in range(count)]


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-line text corpus."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(english_like_lines(300)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory shared by the session's runs (vocabulary, tokenised data sets)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def run_args(corpus_file: Path, data_dir: Path, tmp_path: Path) -> list[str]:
    """Arguments of a tiny offline run writing under ``tmp_path/out``."""
    return ["--config", "tiny", "--corpus", str(corpus_file), "--data-dir", str(data_dir),
            "--out", str(tmp_path / "out"), "--device", "cpu"]
