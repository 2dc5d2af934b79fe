"""W&B runs: mode resolution, naming, an offline run written and read back, no secrets."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from reproductions.common.scrub import REDACTED
from reproductions.common.tracking import (
    INIT_TIMEOUT_S,
    Tracker,
    add_wandb_argument,
    read_offline_history,
    resolve_mode,
    wandb_logged_in,
)


def test_logged_in_by_key_or_netrc(tmp_path: Path) -> None:
    netrc = tmp_path / "netrc"
    assert not wandb_logged_in({"NETRC": str(netrc)})
    assert wandb_logged_in({"WANDB_API_KEY": "x" * 40, "NETRC": str(netrc)})
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    netrc.chmod(0o600)
    assert wandb_logged_in({"NETRC": str(netrc)})


def test_logged_in_by_netrc_for_the_server_wandb_uses(tmp_path: Path) -> None:
    """``wandb login`` writes api.forge.coreweave.com since wandb 0.31; a server of one's own is
    the host of WANDB_BASE_URL."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.forge.coreweave.com\n  login user\n  password abc\n")
    netrc.chmod(0o600)
    assert wandb_logged_in({"NETRC": str(netrc)})
    netrc.write_text("machine wandb.example.org:8080\n  login user\n  password abc\n")
    assert not wandb_logged_in({"NETRC": str(netrc)})
    assert wandb_logged_in({"NETRC": str(netrc),
                            "WANDB_BASE_URL": "https://wandb.example.org:8080"})


@pytest.mark.parametrize(("requested", "env", "mode"), [
    ("auto", {"WANDB_API_KEY": "k"}, "online"),
    ("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),
    ("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}, "disabled"),
    ("auto", {}, "offline"),
    ("disabled", {"WANDB_API_KEY": "k"}, "disabled"),
    ("online", {}, "online"),
])
def test_resolve_mode(tmp_path: Path, requested: str, env: dict, mode: str) -> None:
    assert resolve_mode(requested, {**env, "NETRC": str(tmp_path / "none")}) == mode


def test_flag() -> None:
    parser = argparse.ArgumentParser()
    add_wandb_argument(parser)
    assert parser.parse_args([]).wandb == "auto"
    assert parser.parse_args(["--wandb", "disabled"]).wandb == "disabled"
    with pytest.raises(SystemExit):
        parser.parse_args(["--wandb", "sometimes"])


def test_online_without_a_login_is_refused_when_parsed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It crashed in W&B's "No API key configured" traceback, after the data and the model were
    built."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    parser = argparse.ArgumentParser(prog="train")
    add_wandb_argument(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--wandb", "online"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("train: error: argument --wandb: online needs a W&B login: run `wandb "
                       "login` (or set WANDB_API_KEY) first, or pass --wandb offline and upload "
                       "the run later with `wandb sync`")
    assert parser.parse_args(["--wandb", "offline"]).wandb == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert parser.parse_args(["--wandb", "online"]).wandb == "online"


def test_an_online_run_the_server_does_not_start_is_recorded_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a login but no network, wandb.init waited ~95 s, then the run crashed in a
    CommError traceback."""
    import wandb

    real_init = wandb.init
    calls: list[tuple[str, float]] = []

    def init(**kwargs: object) -> object:
        calls.append((kwargs["mode"], kwargs["settings"].init_timeout))
        if kwargs["mode"] == "online":
            raise wandb.errors.CommError("Timed out while retrying: no such host\nConsider ...")
        return real_init(**kwargs)

    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    monkeypatch.setattr(wandb, "init", init)
    with pytest.warns(UserWarning) as caught:
        tracker = Tracker(paper="mkor", experiment="tiny", optimizer="mkor", seed=0, config={},
                          directory=tmp_path, mode="online")
    with tracker:
        tracker.log({"loss": 1.0}, step=0)
        run_dir = tracker.run_dir
    assert [mode for mode, _ in calls] == ["online", "offline"]
    assert calls[0][1] == INIT_TIMEOUT_S
    assert tracker.mode == "offline" and tracker.info()["mode"] == "offline"
    assert run_dir is not None and run_dir.parent == tmp_path / "wandb"
    assert [str(w.message) for w in caught] == [
        "W&B could not start the online run (Timed out while retrying: no such host); it is "
        f"recorded offline in {run_dir} instead: upload it later with `wandb sync {run_dir}`"]
    assert [h["loss"] for h in read_offline_history(run_dir, wait_s=30)] == [1.0]


def test_offline_run_is_written_and_read_back(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "fake-key-0123456789")
    many = {f"layer{i}/bytes": float(i) for i in range(3000)}  # a record > 32 KiB (split chunks)
    with Tracker(paper="mkor", experiment="tiny", optimizer="mkor", seed=0,
                 config={"lr": 0.1, "hf_token": "hf_secret", "note": "fake-key-0123456789"},
                 directory=tmp_path) as tracker:
        assert tracker.info() == {"project": "kfac-repro-mkor", "group": "tiny",
                                  "name": "tiny-mkor-0", "id": tracker.id, "mode": "offline"}
        for step in range(3):
            tracker.log({"train/loss": 1.0 / (step + 1), "note": "ok"}, step=step)
        tracker.log(many, step=3)
        tracker.summary({"final_loss": 0.33})
        run_dir = tracker.run_dir
    assert run_dir is not None and run_dir.parent == tmp_path / "wandb"
    history = read_offline_history(run_dir, wait_s=30)
    assert [h["_step"] for h in history] == [0, 1, 2, 3]
    assert [h.get("train/loss") for h in history[:3]] == [1.0, 0.5, 1.0 / 3]
    assert history[3]["layer2999/bytes"] == 2999.0
    raw = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert b"hf_secret" not in raw and b"fake-key-0123456789" not in raw
    assert REDACTED.encode() in raw


def test_disabled_run_writes_nothing(tmp_path: Path) -> None:
    tracker = Tracker(paper="mkor", experiment="tiny", optimizer="lamb", seed=1, config={},
                      directory=tmp_path, enabled=False)
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish()
    assert tracker.mode == "disabled" and tracker.run_dir is None
    assert not (tmp_path / "wandb").exists()


def test_reader_rejects_other_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run-"):
        read_offline_history(tmp_path)
    (tmp_path / "run-x.wandb").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="bad header"):
        read_offline_history(tmp_path)


def test_reader_waits_at_most_wait_s_for_the_exit_record(tmp_path: Path) -> None:
    path = tmp_path / "run-x.wandb"
    path.write_bytes(b":W&B" + (0xBEE1).to_bytes(2, "little") + b"\x00")  # a header, no records
    started = time.monotonic()
    assert read_offline_history(path, wait_s=0.3) == []  # still being written: read as it stands
    assert 0.3 <= time.monotonic() - started < 5
