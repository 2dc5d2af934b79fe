"""The data.prepare command line: package checks, sudo advice, and cache building."""

from __future__ import annotations

from pathlib import Path

import pytest

import data.prepare as prepare


def test_non_root_prints_sudo_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare, "missing_packages", lambda packages: list(packages))
    monkeypatch.setattr(prepare.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as info:
        prepare.main(["--only", "text"])
    message = str(info.value.code)
    assert "sudo apt-get install -y -qq bible-kjv python3.11-doc" in message


def test_builds_fashion_mnist_cache(
    tiny_fashion_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(prepare, "missing_packages", lambda packages: [])
    assert prepare.main(["--only", "fashion-mnist", "--data-dir", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "fashion-mnist" / "test.pt").is_file()
    assert "fashion-mnist train: 5 images" in capsys.readouterr().out


def test_unavailable_data_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import data.fashion_mnist as fm

    monkeypatch.setattr(prepare, "missing_packages", lambda packages: [])
    monkeypatch.setenv(fm.SOURCE_DIR_ENV, str(tmp_path / "nowhere"))
    monkeypatch.setattr(fm, "_network_available", lambda timeout=3.0: False)
    assert prepare.main(["--only", "fashion-mnist"]) == 1
    assert "apt-get install -y dataset-fashion-mnist" in capsys.readouterr().err


def test_missing_packages_reports_unknown() -> None:
    if prepare.shutil.which("dpkg-query") is None:
        pytest.skip("dpkg-query is not available")
    assert prepare.missing_packages(["dpkg", "kfac-no-such-package"]) == ["kfac-no-such-package"]


def test_damaged_data_exits_1_in_one_line(
    tiny_fashion_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A truncated source file printed a traceback (only DataUnavailableError was caught)."""
    monkeypatch.setattr(prepare, "missing_packages", lambda packages: [])
    damaged = tiny_fashion_dir / "train-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:20])
    assert prepare.main(["--only", "fashion-mnist", "--data-dir", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("data.prepare: ")
    assert "train-images-idx3-ubyte.gz" in err


def test_a_data_dir_that_cannot_be_created_exits_1_in_one_line(
    tiny_fashion_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A regular file in the place of --data-dir ended in a NotADirectoryError traceback from
    the first cache written."""
    monkeypatch.setattr(prepare, "missing_packages", lambda packages: [])
    blocked = tmp_path / "afile"
    blocked.write_text("")
    assert prepare.main(["--only", "fashion-mnist", "--data-dir", str(blocked / "d")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{blocked} is not a directory" in err and "Fix: pass --data-dir" in err
