"""IDX parsing and its validation of damaged files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from data.errors import CorruptDataError
from data.idx import read_idx
from tests.data.helpers import write_idx


@pytest.mark.parametrize("name", ["images-idx3-ubyte", "images-idx3-ubyte.gz"])
def test_roundtrip(tmp_path: Path, name: str) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    result = read_idx(write_idx(tmp_path / name, array))
    assert result.dtype == np.uint8
    np.testing.assert_array_equal(result, array)


def test_big_endian_int32(tmp_path: Path) -> None:
    values = np.array([1, -2, 70000], dtype=">i4")
    path = tmp_path / "ints-idx1"
    path.write_bytes(bytes([0, 0, 0x0C, 1]) + np.array([3], ">u4").tobytes() + values.tobytes())
    np.testing.assert_array_equal(read_idx(path), [1, -2, 70000])


def test_bad_magic_names_file(tmp_path: Path) -> None:
    path = tmp_path / "bad-magic"
    path.write_bytes(b"\x1f\x8b\x08\x00" + bytes(16))
    with pytest.raises(CorruptDataError, match="bad-magic.*magic number"):
        read_idx(path)


def test_truncated_data_names_file(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "short", np.zeros((4, 5), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CorruptDataError, match=r"short: header promises shape \(4, 5\)") as info:
        read_idx(path, fix="get a new copy")
    assert info.value.path == path
    assert "Fix: get a new copy" in str(info.value)


def test_damaged_gzip_names_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + bytes(100))[:-10])
    with pytest.raises(CorruptDataError, match="broken.gz: cannot be read or decompressed"):
        read_idx(path)


def test_header_dims_that_overflow_int64_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "huge"
    path.write_bytes(bytes([0, 0, 0x08, 4]) + np.asarray([65536] * 4, dtype=">u4").tobytes())
    with pytest.raises(CorruptDataError, match=r"huge.*header promises shape \(65536"):
        read_idx(path)
