"""Atomic cache writes leave either the complete result or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.atomic import atomic_directory, atomic_path


def test_atomic_path_success_and_failure(tmp_path: Path) -> None:
    final = tmp_path / "sub" / "out.txt"
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert list(final.parent.iterdir()) == []
    with atomic_path(final) as tmp:
        tmp.write_text("whole")
    assert final.read_text() == "whole"
    assert list(final.parent.iterdir()) == [final]


def test_atomic_directory_keeps_existing(tmp_path: Path) -> None:
    final = tmp_path / "vocab"
    with atomic_directory(final) as tmp:
        (tmp / "vocab.txt").write_text("first")
    with atomic_directory(final) as tmp:
        (tmp / "vocab.txt").write_text("second")
    assert (final / "vocab.txt").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["vocab"]


def test_unwritable_parent_says_data_dir() -> None:
    from data.errors import DataUnavailableError

    with pytest.raises(DataUnavailableError, match=r"/proc/self.*--data-dir.*KFAC_DATA_DIR"):
        with atomic_path(Path("/proc/self/kfac-cache/file.pt")):
            pass
    with pytest.raises(DataUnavailableError, match=r"/proc/self.*--data-dir.*KFAC_DATA_DIR"):
        with atomic_path(Path("/proc/self/file.pt")):
            pass
    with pytest.raises(DataUnavailableError, match=r"/proc/self.*--data-dir.*KFAC_DATA_DIR"):
        with atomic_directory(Path("/proc/self/vocab")):
            pass


def test_error_inside_block_is_not_rewrapped(tmp_path: Path) -> None:
    with pytest.raises(PermissionError):
        with atomic_path(tmp_path / "f"):
            raise PermissionError("from the caller")
    with pytest.raises(PermissionError):
        with atomic_directory(tmp_path / "d"):
            raise PermissionError("from the caller")
