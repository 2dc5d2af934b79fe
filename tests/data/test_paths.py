"""Cache directory resolution and the shared --data-dir option."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from data.paths import (
    DATA_DIR_ENV,
    REPO_ROOT,
    add_data_dir_argument,
    data_root,
    directory_problem,
)


def test_env_var_sets_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "from-env"))
    assert data_root() == tmp_path / "from-env"


def test_override_beats_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "from-env"))
    assert data_root(tmp_path / "flag") == tmp_path / "flag"
    assert data_root(str(tmp_path / "flag")) == tmp_path / "flag"


def test_default_is_repo_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert data_root() == REPO_ROOT / ".cache" / "data"
    assert (REPO_ROOT / "data" / "paths.py").is_file()


def test_data_dir_argument(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_data_dir_argument(parser)
    assert parser.parse_args([]).data_dir is None
    args = parser.parse_args(["--data-dir", str(tmp_path)])
    assert data_root(args.data_dir) == tmp_path


def test_symlink_loop_is_refused_naming_it(tmp_path: Path) -> None:
    from data.errors import DataUnavailableError

    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    with pytest.raises(DataUnavailableError, match=r"loop_a.*--data-dir"):
        data_root(tmp_path / "loop_a")


def test_a_directory_is_created_or_refused_naming_why(tmp_path: Path) -> None:
    assert directory_problem(tmp_path / "new" / "sub") is None
    assert (tmp_path / "new" / "sub").is_dir()
    blocked = tmp_path / "afile"
    blocked.write_text("")
    assert directory_problem(blocked / "sub") == f"{blocked} is not a directory"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_place_that_takes_no_directories_is_refused_also_for_root() -> None:
    """The check asked os.access, which allows root everything: ``/proc/foo`` passed and the
    run failed later with a traceback from mkdir."""
    from data.errors import DataUnavailableError

    assert directory_problem(Path("/proc/kfac-repro-test")) == (
        "cannot create /proc/kfac-repro-test: No such file or directory")
    with pytest.raises(DataUnavailableError, match=r"cannot create /proc/kfac-repro-test.*--data"):
        data_root("/proc/kfac-repro-test")
