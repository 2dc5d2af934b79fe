"""Fixtures shared by the data tests: an isolated cache directory and tiny IDX sources."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data.paths import DATA_DIR_ENV
from tests.data.helpers import write_idx


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point ``KFAC_DATA_DIR`` at a fresh directory so no test touches the real cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(DATA_DIR_ENV, str(cache))
    return cache


@pytest.fixture
def tiny_fashion_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake Debian Fashion-MNIST directory (5 train, 3 test images), selected via the env."""
    source = tmp_path / "fashion-src"
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 5), ("t10k", 3)):
        write_idx(
            source / f"{prefix}-images-idx3-ubyte.gz",
            rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8),
        )
        write_idx(source / f"{prefix}-labels-idx1-ubyte.gz", np.arange(count, dtype=np.uint8))
    monkeypatch.setenv("KFAC_FASHION_MNIST_DIR", str(source))
    return source
