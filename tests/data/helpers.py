"""Test helpers for the data package: writers of small files in the formats it reads."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray) -> Path:
    """Write ``array`` (uint8) as an IDX file, gzip-compressed when ``path`` ends in ``.gz``."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)
    return path
