"""Fashion-MNIST as normalised tensors, from the Debian package or a download.

The Debian package ``dataset-fashion-mnist`` installs the original IDX files, so the data set is
available without internet access. They are parsed once and cached as a ``.pt`` file of uint8
images and int64 labels under ``data_root()/fashion-mnist``; later loads read the cache. Only if
the Debian files are missing and the network works does this fall back to torchvision's download.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
from torch.utils.data import TensorDataset

from data.atomic import atomic_path
from data.errors import CorruptDataError, DataUnavailableError
from data.idx import read_idx
from data.paths import data_root

FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where ``apt-get install dataset-fashion-mnist`` puts the IDX files."""

SOURCE_DIR_ENV = "KFAC_FASHION_MNIST_DIR"
"""Environment variable that replaces :data:`FASHION_MNIST_DEBIAN_DIR` (used by tests)."""

MEAN = 0.2860
STD = 0.3530
"""Pixel mean and standard deviation of the training set, after scaling to [0, 1]."""

APT_FIX = "apt-get install -y dataset-fashion-mnist (as root; or run `make data`)"

_STEMS = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def fashion_mnist_source_dir() -> Path:
    """Return the directory searched for the IDX files: ``$KFAC_FASHION_MNIST_DIR`` or Debian's."""
    return Path(os.environ.get(SOURCE_DIR_ENV) or FASHION_MNIST_DEBIAN_DIR)


def fashion_mnist(train: bool, root: str | Path | None = None) -> TensorDataset:
    """Load the Fashion-MNIST training or test split.

    Args:
        train: True for the 60,000 training images, False for the 10,000 test images.
        root: Cache directory override, passed to :func:`data.paths.data_root`.

    Returns:
        A dataset of ``(image, label)`` pairs: images float32 of shape ``(N, 1, 28, 28)``
        normalised as ``(x / 255 - 0.2860) / 0.3530``; labels int64 in ``[0, 10)``.

    Raises:
        DataUnavailableError: The IDX files are not installed and cannot be downloaded.
        CorruptDataError: A source file or the cache is damaged or has the wrong shape.
    """
    cache = data_root(root) / "fashion-mnist" / f"{'train' if train else 'test'}.pt"
    source = _provenance(train)
    blob = _load_cache(cache) if cache.exists() else None
    # Rebuilt when absent, or built from other files than the source now holds (without
    # source files, as on a machine the cache was copied to, it is used as it is)
    if blob is None or (source != "download" and blob.get("source") != source):
        images, labels = _read_split(train, cache.parent)
        blob = {"images": images, "labels": labels, "source": source}
        with atomic_path(cache) as tmp:
            torch.save(blob, tmp)
    images, labels = blob["images"], blob["labels"]
    images = images.to(torch.float32).div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    return TensorDataset(images, labels)


def _provenance(train: bool) -> str:
    """The IDX files a split's cache must have been built from: their paths, sizes and
    modification times in the source directory (``$KFAC_FASHION_MNIST_DIR`` or Debian's), or
    ``"download"`` where that directory has none."""
    files = _idx_files(fashion_mnist_source_dir(), train)
    if files is None:
        return "download"
    return ";".join(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}"
                    for path in files)


def _load_cache(cache: Path) -> dict[str, Any]:
    """A split's cache as saved, checked to hold what :func:`_read_split` writes.

    A cache is trusted without its source files (it may have been copied to a machine without
    them), so its contents are checked here: otherwise a damaged or foreign one fails later as a
    bare AssertionError in ``TensorDataset`` or an AttributeError, naming no file.

    Args:
        cache: The ``.pt`` file of one split.

    Returns:
        The saved dict, with uint8 ``images`` of shape ``(N, 28, 28)`` and ``N`` int64 ``labels``.

    Raises:
        CorruptDataError: it cannot be read or its contents are wrong (named, with the fix).
    """
    fix = f"delete {cache}; the next load rebuilds it from the IDX files"
    try:
        blob = torch.load(cache, weights_only=True)
        if not isinstance(blob, dict) or not {"images", "labels"} <= blob.keys():
            raise KeyError("images and labels")
    except Exception as exc:  # whatever torch.load raises on damaged bytes (struct.error, ...)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CorruptDataError(cache, f"is not a readable Fashion-MNIST cache ({first_line})",
                               fix) from None
    problem = _cache_problem(blob["images"], blob["labels"])
    if problem is not None:
        raise CorruptDataError(cache, f"is not a valid Fashion-MNIST cache ({problem})", fix)
    return blob


def _describe(value: object) -> str:
    """A tensor's dtype and shape, or the type of anything else, for an error message."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def _cache_problem(images: object, labels: object) -> str | None:
    """Why a cache's ``images`` and ``labels`` are not what :func:`_read_split` saves, or None.

    Args:
        images: The cached images, expected uint8 of shape ``(N, 28, 28)``.
        labels: The cached labels, expected int64 of shape ``(N,)``.

    Returns:
        The reason, naming the field at fault, or None when both are as expected.
    """
    if (not isinstance(images, torch.Tensor) or images.dtype != torch.uint8
            or images.ndim != 3 or tuple(images.shape[1:]) != (28, 28)):
        return f"images are {_describe(images)}, not uint8 of shape (N, 28, 28)"
    if (not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64
            or tuple(labels.shape) != (images.shape[0],)):
        return f"labels are {_describe(labels)}, not {images.shape[0]} int64 labels"
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) > 9):
        return (f"labels run from {int(labels.min())} to {int(labels.max())}, outside the "
                "classes 0-9")
    return None


def _read_split(train: bool, cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Find the IDX files of one split, parse and validate them."""
    source = fashion_mnist_source_dir()
    files = _idx_files(source, train)
    fix = f"apt-get install --reinstall -y dataset-fashion-mnist (files in {source})"
    missing_fix = APT_FIX
    if os.environ.get(SOURCE_DIR_ENV):
        fix = missing_fix = (f"put the IDX files there, or unset ${SOURCE_DIR_ENV} to read "
                             f"Debian's ({FASHION_MNIST_DEBIAN_DIR}: {APT_FIX})")
    if files is None:
        if not _network_available():
            raise DataUnavailableError(f"Fashion-MNIST IDX files in {source}", missing_fix)
        source = _download(cache_dir / "download", train)
        files = _idx_files(source, train)
        fix = f"delete {source} and run again"
        if files is None:
            raise DataUnavailableError(f"Fashion-MNIST IDX files in {source}", APT_FIX)
    images_path, labels_path = files
    images = read_idx(images_path, fix)
    labels = read_idx(labels_path, fix)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise CorruptDataError(
            images_path,
            f"holds {images.dtype} {images.shape}, not uint8 images of shape (N, 28, 28)",
            fix,
        )
    if labels.shape != (images.shape[0],) or labels.dtype != np.uint8 or labels.max(initial=0) > 9:
        raise CorruptDataError(
            labels_path,
            f"holds {labels.dtype} {labels.shape}, not {images.shape[0]} uint8 labels in [0, 10)",
            fix,
        )
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def _idx_files(directory: Path, train: bool) -> tuple[Path, Path] | None:
    """Return the images and labels files of a split (``.gz`` preferred), or None if absent."""
    found = []
    for stem in _STEMS[train]:
        candidates = [directory / f"{stem}.gz", directory / stem]
        existing = [p for p in candidates if p.is_file()]
        if not existing:
            return None
        found.append(existing[0])
    return found[0], found[1]


def _network_available(timeout: float = 3.0) -> bool:
    """Say whether torchvision's first Fashion-MNIST mirror accepts a TCP connection."""
    from torchvision.datasets import FashionMNIST

    url = urlsplit(FashionMNIST.mirrors[0])
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _download(directory: Path, train: bool) -> Path:
    """Download one split with torchvision and return the folder holding its IDX files."""
    from torchvision.datasets import FashionMNIST

    dataset = FashionMNIST(str(directory), train=train, download=True)
    return Path(dataset.raw_folder)
