"""Safety: checkpoints are loaded with ``torch.load(weights_only=True)``, so a checkpoint holding
a pickled callable is refused with a clear error and never runs it; no API key or token reaches
logs, results files, checkpoints or the W&B run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reproductions.common.checkpoint import (
    checkpoint_path,
    load_latest_checkpoint,
    save_checkpoint,
)
from reproductions.common.results import RunRecorder, load_results
from reproductions.common.scrub import REDACTED
from reproductions.osawa2018.train import main
from tests.reliability.helpers import (
    SETTINGS,
    TIMEOUT_S,
    child_env,
    kill_group,
    start,
    train_args,
)

WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"
HF_TOKEN = "hf_FAKEtokenFAKEtokenFAKEtokenFAKE"


class TouchOnLoad:
    """Unpickling this calls ``Path.touch(marker)``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.marker,)


def test_checkpoint_with_a_pickled_callable_is_refused_and_never_run(
        tmp_path: Path, image_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, marker = tmp_path / "run", tmp_path / "pwned"
    bad = checkpoint_path(out / "checkpoints" / "rank-0", 3)
    bad.parent.mkdir(parents=True)
    torch.save({"trainer": TouchOnLoad(marker)}, bad)
    with pytest.warns(RuntimeWarning, match=f"checkpoint {bad} cannot be loaded"), \
            pytest.raises(SystemExit) as info:
        main(train_args(out, image_folder, "--resume"))
    assert info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"no checkpoint in {bad.parent} can be loaded: {bad} (UnpicklingError" in error
    assert not marker.exists(), "loading the checkpoint ran code from it"


def test_results_recorder_data_loads_from_a_weights_only_checkpoint(tmp_path: Path) -> None:
    recorder = RunRecorder(paper="osawa2018", experiment="x", optimizer="kfac", config={})
    save_checkpoint(tmp_path, 1, {"results": recorder.data})
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded["results"]["hardware"]["torch"] == torch.__version__


def test_no_secret_reaches_logs_results_checkpoints_or_wandb(tmp_path: Path,
                                                           image_folder: Path) -> None:
    """A user's W&B key and Hugging Face token in the environment, and the token pasted into a
    config value, while a run logs to W&B offline, checkpoints and writes its results."""
    out = tmp_path / "run"
    settings = {**SETTINGS, "source": f"notes (token {HF_TOKEN})"}
    args = train_args(out, image_folder, "--max-steps", "4", "--wandb", "offline",
                      settings=settings)  # the last --wandb wins
    env = child_env(WANDB_API_KEY=WANDB_KEY, HF_TOKEN=HF_TOKEN, WANDB_MODE="offline")
    log = tmp_path / "train.log"  # everything the run printed, stdout and stderr
    process = start(["-m", "reproductions.osawa2018.train", *args], log, env)
    try:
        assert process.wait(timeout=TIMEOUT_S) == 0, log.read_text()
    finally:
        kill_group(process)  # and W&B's service process, if it outlived the run
    written = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix == ".wandb" for p in written), "the W&B offline run was written"
    assert any(p.name.startswith("checkpoint-") for p in written)
    assert load_results(out / "results.json")["config"]["source"] == f"notes (token {REDACTED})"
    for secret in (WANDB_KEY, HF_TOKEN):
        for path in [log, *written]:
            assert secret.encode() not in path.read_bytes(), f"{path} holds a secret"
