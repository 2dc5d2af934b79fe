"""Interrupted runs of the entry points, resumed as a user would: faults found in review."""

from __future__ import annotations

import json
import warnings
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from reproductions.common.checkpoint import (
    list_checkpoints,
    load_latest_checkpoint,
    save_checkpoint,
)
from reproductions.common.results import RunRecorder, load_results
from reproductions.dpkfac import train as dpkfac
from reproductions.mkor import bert
from reproductions.osawa2018.train import main
from tests.reliability.helpers import train_args
from tests.reproductions.mkor.conftest import english_like_lines


def test_a_run_stopped_between_its_last_checkpoint_and_results_file_completes_on_resume(
        tmp_path: Path, image_folder: Path, uninterrupted: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the final checkpoint was saved, before the results file was rewritten:
    ``--resume`` found nothing left to train and left the file unfinished, 4 steps short."""
    write = RunRecorder.write

    def interrupted_when_finished(recorder: RunRecorder, path: Path) -> Path:
        if recorder.data["finished"]:
            raise KeyboardInterrupt
        return write(recorder, path)

    with monkeypatch.context() as patch:
        patch.setattr(RunRecorder, "write", interrupted_when_finished)
        with pytest.raises(KeyboardInterrupt):
            main(train_args(tmp_path, image_folder))
    assert load_results(tmp_path / "results.json")["finished"] is None
    main(train_args(tmp_path, image_folder, "--resume"))
    resumed, whole = (load_results(out / "results.json") for out in (tmp_path, uninterrupted))
    assert resumed["finished"] is not None
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in whole["steps"]]
    assert resumed["evals"] == whole["evals"] and resumed["summary"] == {
        **whole["summary"], "train_time_s": resumed["summary"]["train_time_s"]}


@pytest.mark.distributed
def test_dpkfac_rerun_with_more_workers_is_refused_not_started_afresh(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 1-worker run's checkpoints, rerun with 2 workers: rank 1 had none, so both started
    afresh over them (and the results file) instead of saying the world size differs."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(asdict(dpkfac.TrainConfig(test_examples=100))))
    args = ["--optimizer", "sgd", "--config", str(config), "--wandb", "disabled",
            "--out", str(tmp_path / "results"), "--run-dir", str(tmp_path / "run")]
    dpkfac.main([*args, "--workers", "1", "--max-steps", "2"])
    path = tmp_path / "results" / "fashion_mnist-sgd.json"
    before = load_results(path)
    with pytest.raises(SystemExit) as info:
        dpkfac.main([*args, "--workers", "2", "--max-steps", "3"])
    assert info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "saved by a run of world size 1, not 2" in last and "--run-dir" in last
    assert load_results(path) == before
    saved = tmp_path / "run" / "checkpoints" / "fashion_mnist-sgd"
    assert [p.name for p in list_checkpoints(saved / "rank0")] == ["checkpoint-000000001.pt"]
    assert not list_checkpoints(saved / "rank1")


def test_a_checkpoint_with_damaged_tensor_bytes_warns_and_the_previous_is_used(
        tmp_path: Path) -> None:
    """One bit flipped inside a tensor (a bad disk or copy): torch.load does not check the
    archive's CRCs, so the damaged weights loaded silently and the resumed run diverged."""
    save_checkpoint(tmp_path, 1, {"step": 1, "weights": torch.ones(1000)})
    newest = save_checkpoint(tmp_path, 2, {"step": 2, "weights": torch.ones(1000)})
    with zipfile.ZipFile(newest) as archive:
        (tensor,) = [info for info in archive.infolist() if "/data/" in info.filename]
    data = bytearray(newest.read_bytes())
    start = tensor.header_offset + 30 + len(tensor.filename.encode()) + len(tensor.extra)
    data[start + 2003] ^= 0x40  # an exponent bit of weights[500]: 1.0 becomes inf
    newest.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=f"{newest}.*CRC-32"):
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 1
    assert torch.equal(loaded["weights"], torch.ones(1000))


def test_bert_resume_of_a_fresh_run_is_not_refused_for_the_earlier_runs_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh run (another learning rate, no --resume) over an earlier one's output, stopped
    during its first optimizer: the earlier run's state of the optimizers it had not reached
    was still there, so ``--resume`` of the very same command was refused naming the old
    learning rate, and only a restart from scratch continued."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(english_like_lines(300)) + "\n", encoding="utf-8")
    args = ["--config", "tiny", "--corpus", str(corpus), "--data-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out"), "--device", "cpu", "--wandb", "disabled",
            "--optimizers", "lamb,mkor", "--steps", "4", "--set", "checkpoint_every=1"]
    bert.main(args)  # the earlier run, finished
    save = bert.save_checkpoint

    def interrupted_after_the_first(directory: Path, step: int, state: dict) -> Path:
        save(directory, step, state)
        raise KeyboardInterrupt  # Ctrl-C right after the fresh run's first checkpoint

    with monkeypatch.context() as patch:
        patch.setattr(bert, "save_checkpoint", interrupted_after_the_first)
        with pytest.raises(KeyboardInterrupt):
            bert.main([*args, "--lr", "0.002"])
    runs = bert.main([*args, "--lr", "0.002", "--resume"])
    assert [(r["optimizer"], r["config"]["lr"], len(r["steps"]), r["finished"] is not None)
            for r in runs] == [("lamb", 0.002, 4, True), ("mkor", 0.002, 4, True)]


@pytest.mark.parametrize("how", ["legacy format", "no CRC-32s"])
def test_a_checkpoint_without_crcs_to_check_loads_without_a_warning(
        tmp_path: Path, how: str) -> None:
    """torch.save's legacy (non-zip) format, and its zip written after
    ``set_crc32_options(False)`` (every CRC-32 recorded as 0), load with torch.load: the CRC
    check refused both as damaged and fell back to an older checkpoint, or to none."""
    save_checkpoint(tmp_path, 1, {"step": 1})
    state = {"step": 2, "weights": torch.ones(1000)}
    newest = tmp_path / "checkpoint-000000002.pt"
    if how == "legacy format":
        torch.save(state, newest, _use_new_zipfile_serialization=False)
    else:
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(state, newest)
        finally:
            torch.serialization.set_crc32_options(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 2
    assert torch.equal(loaded["weights"], torch.ones(1000))


def test_a_fresh_bert_run_whose_corpus_is_missing_keeps_the_earlier_runs(
        tmp_path: Path) -> None:
    """A fresh run (no --resume) deletes the earlier state of its runs up front; it did so
    before loading the data, so a mistyped --corpus ended the command after every listed
    run's results, checkpoints and model were gone."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(english_like_lines(300)) + "\n", encoding="utf-8")
    args = ["--config", "tiny", "--data-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out"), "--device", "cpu", "--wandb", "disabled",
            "--optimizers", "lamb,mkor", "--steps", "2"]
    bert.main([*args, "--corpus", str(corpus)])
    kept = sorted((tmp_path / "out").rglob("*"))
    with pytest.raises(SystemExit):
        bert.main([*args, "--corpus", str(tmp_path / "corpus-typo.txt"), "--lr", "0.002"])
    assert sorted((tmp_path / "out").rglob("*")) == kept
    with pytest.raises(SystemExit):  # a mistyped starting checkpoint, found before clearing
        bert.main([*args, "--corpus", str(corpus), "--init-checkpoint",
                   str(tmp_path / "no-such-model")])
    assert sorted((tmp_path / "out").rglob("*")) == kept
    assert [load_results(tmp_path / "out" / "tiny" / f"{name}-s0" / "results.json")["finished"]
            is not None for name in ("lamb", "mkor")] == [True, True]
