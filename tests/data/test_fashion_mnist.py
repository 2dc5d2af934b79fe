"""Fashion-MNIST loading from IDX files, caching, and the errors when it is unavailable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import data.fashion_mnist as fm
from data.errors import CorruptDataError, DataUnavailableError
from data.idx import read_idx
from tests.data.helpers import write_idx


def test_tiny_source_shapes_and_normalisation(tiny_fashion_dir: Path, isolated_cache: Path) -> None:
    train = fm.fashion_mnist(train=True)
    images, labels = train.tensors
    assert images.shape == (5, 1, 28, 28) and images.dtype == torch.float32
    assert labels.tolist() == [0, 1, 2, 3, 4] and labels.dtype == torch.int64
    raw = read_idx(tiny_fashion_dir / "train-images-idx3-ubyte.gz")
    expected = (torch.from_numpy(raw).float() / 255 - fm.MEAN) / fm.STD
    torch.testing.assert_close(images[:, 0], expected)
    assert len(fm.fashion_mnist(train=False)) == 3
    assert (isolated_cache / "fashion-mnist" / "train.pt").is_file()


def test_cache_is_reused_without_source(tiny_fashion_dir: Path, tmp_path: Path) -> None:
    first = fm.fashion_mnist(train=True, root=tmp_path / "explicit")
    for path in tiny_fashion_dir.iterdir():
        path.unlink()
    again = fm.fashion_mnist(train=True, root=tmp_path / "explicit")
    torch.testing.assert_close(first.tensors[0], again.tensors[0])


def test_missing_and_offline_says_apt_get(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fm.SOURCE_DIR_ENV, str(tmp_path / "nowhere"))
    monkeypatch.setattr(fm, "_network_available", lambda timeout=3.0: False)
    with pytest.raises(DataUnavailableError,
                       match="apt-get install -y dataset-fashion-mnist") as err:
        fm.fashion_mnist(train=True)
    # the variable points elsewhere than Debian's files: the fix says so
    assert f"unset ${fm.SOURCE_DIR_ENV}" in str(err.value)


def test_wrong_label_count_names_file(tiny_fashion_dir: Path) -> None:
    labels = write_idx(tiny_fashion_dir / "t10k-labels-idx1-ubyte.gz", np.zeros(7, np.uint8))
    with pytest.raises(CorruptDataError, match=str(labels)):
        fm.fashion_mnist(train=False)


def test_source_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(fm.SOURCE_DIR_ENV, raising=False)
    assert fm.fashion_mnist_source_dir() == fm.FASHION_MNIST_DEBIAN_DIR
    monkeypatch.setenv(fm.SOURCE_DIR_ENV, str(tmp_path))
    assert fm.fashion_mnist_source_dir() == tmp_path


@pytest.mark.skipif(
    not fm.FASHION_MNIST_DEBIAN_DIR.is_dir(), reason="dataset-fashion-mnist is not installed"
)
def test_real_fashion_mnist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fm.SOURCE_DIR_ENV, raising=False)
    test = fm.fashion_mnist(train=False)
    images, labels = test.tensors
    assert images.shape == (10000, 1, 28, 28)
    assert sorted(labels.unique().tolist()) == list(range(10))
    assert abs(images.mean().item()) < 0.05
    assert len(fm.fashion_mnist(train=True)) == 60000


def test_cache_is_rebuilt_when_the_source_files_change(tiny_fashion_dir: Path,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointing ``$KFAC_FASHION_MNIST_DIR`` at other files (or replacing them) rebuilds the
    split's cache instead of serving the data it was built from."""
    assert len(fm.fashion_mnist(train=False, root=tmp_path / "c")) == 3
    other = tmp_path / "other"
    other.mkdir()
    for path in tiny_fashion_dir.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    write_idx(other / "t10k-images-idx3-ubyte.gz", np.zeros((2, 28, 28), np.uint8))
    write_idx(other / "t10k-labels-idx1-ubyte.gz", np.zeros(2, np.uint8))
    monkeypatch.setenv(fm.SOURCE_DIR_ENV, str(other))
    assert len(fm.fashion_mnist(train=False, root=tmp_path / "c")) == 2


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("labels", lambda blob: blob["labels"][:2]),
        ("labels", lambda blob: "x"),
        ("labels", lambda blob: blob["labels"].to(torch.int32)),
        ("images", lambda blob: blob["images"].to(torch.float32)),
        ("images", lambda blob: blob["images"][:, :27]),
        ("images", lambda blob: None),
        ("labels", lambda blob: torch.full_like(blob["labels"], 99)),  # classes are 0-9
    ],
)
def test_cache_with_wrong_contents_names_file(tiny_fashion_dir: Path, isolated_cache: Path,
                                              field: str, bad: object) -> None:
    fm.fashion_mnist(train=True)
    cache = isolated_cache / "fashion-mnist" / "train.pt"
    blob = torch.load(cache, weights_only=True)
    blob[field] = bad(blob)  # type: ignore[operator]
    torch.save(blob, cache)
    with pytest.raises(CorruptDataError, match=f"{cache}.*{field}.*Fix: delete {cache}"):
        fm.fashion_mnist(train=True)
