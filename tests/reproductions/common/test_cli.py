"""Checks the entry points make on their options before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import ConfigError
from reproductions.common.cli import writable_directory


def test_an_output_directory_is_created_before_any_work(tmp_path: Path) -> None:
    assert writable_directory(tmp_path / "out" / "run", "--out") == tmp_path / "out" / "run"
    assert (tmp_path / "out" / "run").is_dir()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_directory_that_cannot_be_created_is_refused_also_for_root() -> None:
    """``--out /proc/foo`` passed the check as root and the run ended in a FileNotFoundError
    traceback from its first write."""
    with pytest.raises(ConfigError) as info:
        writable_directory(Path("/proc/kfac-repro-test"), "--out")
    assert str(info.value) == ("invalid --out='/proc/kfac-repro-test': expected a directory that "
                               "can be created (cannot create /proc/kfac-repro-test: No such file "
                               "or directory)")
