"""A two-step DP-KFAC run on 2 gloo workers: results file, checkpoints, W&B, resume."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from core.config import ConfigError
from reproductions.common.checkpoint import checkpoint_step, list_checkpoints, save_checkpoint
from reproductions.common.results import load_results
from reproductions.dpkfac.train import DEFAULT_CONFIG, TrainConfig, batch_indices, main, run


def test_default_config_file_is_the_dataclass_default() -> None:
    assert TrainConfig.from_file(DEFAULT_CONFIG) == TrainConfig()


def test_batches_are_seeded_permutations() -> None:
    first = batch_indices(0, 10, 6, 60, seed=0)
    assert first.tolist() == batch_indices(0, 10, 6, 60, seed=0).tolist()
    epoch = [i for step in range(10) for i in batch_indices(step, 10, 6, 60, 0).tolist()]
    assert sorted(epoch) == list(range(60))
    assert batch_indices(10, 10, 6, 60, 0).tolist() != first.tolist()


@pytest.mark.distributed
def test_two_steps_then_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(asdict(TrainConfig(test_examples=200))))
    args = ["--optimizer", "dp-kfac", "--workers", "2", "--config", str(config),
            "--out", str(tmp_path / "results"), "--run-dir", str(tmp_path / "run")]
    main([*args, "--max-steps", "2"])
    path = tmp_path / "results" / "fashion_mnist-dp-kfac.json"
    run = load_results(path)
    assert [s["step"] for s in run["steps"]] == [0, 1] and run["finished"]
    assert run["hardware"]["world_size"] == 2 and run["wandb"]["mode"] == "offline"
    assert {"grad_allreduce", "inverse_comm", "grad_comm"} == set(run["ledger"])
    assert run["memory"]["kfac_factors"] > 0 and run["summary"]["kfac_layers"] == 4
    # not evaluated where --max-steps stops (mid-epoch): a continued run must record what an
    # uninterrupted one does (it had recorded an evaluation at each stop)
    assert run["evals"] == [] and run["summary"]["final_test_accuracy"] is None
    for rank in (0, 1):
        saved = list_checkpoints(tmp_path / "run" / "checkpoints" / "fashion_mnist-dp-kfac"
                                 / f"rank{rank}")
        assert [p.name for p in saved] == ["checkpoint-000000001.pt"]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))

    main([*args, "--max-steps", "3"])  # resumes after step 1
    resumed = load_results(path)
    assert [s["step"] for s in resumed["steps"]] == [0, 1, 2]
    assert resumed["steps"][:2] == run["steps"] and resumed["wandb"]["id"] == run["wandb"]["id"]
    assert resumed["config"]["max_steps"] == 3 and resumed["evals"] == []
    for stage, totals in run["ledger"].items():  # the collectives of all three steps
        assert resumed["ledger"][stage]["collectives"] == totals["collectives"] * 3 // 2
        assert resumed["ledger"][stage]["traffic_bytes"] == totals["traffic_bytes"] * 3 // 2
    for stage in ("forward_backward", "factors", "grad_comm"):  # times of the whole run
        assert resumed["optimizer_stage_time_s"][stage] > run["optimizer_stage_time_s"][stage]

    # Rank 1 died while writing its newest checkpoint: both workers agree on the older step.
    newest = [list_checkpoints(tmp_path / "run" / "checkpoints" / "fashion_mnist-dp-kfac"
                               / f"rank{rank}")[-1] for rank in (0, 1)]
    assert [p.name for p in newest] == ["checkpoint-000000002.pt"] * 2
    newest[1].write_bytes(newest[1].read_bytes()[:100])
    main([*args, "--max-steps", "3"])  # rank 1 warns (in its process) and falls back
    again = load_results(path)
    assert [s["step"] for s in again["steps"]] == [0, 1, 2]
    assert again["steps"][2]["loss"] == resumed["steps"][2]["loss"]
    assert again["wandb"]["id"] == run["wandb"]["id"]  # resumed, not started afresh

    # Other settings in the same --run-dir: refused in one line, nothing overwritten.
    other = tmp_path / "other.json"
    other.write_text(json.dumps(asdict(TrainConfig(test_examples=200, lr=0.5))))
    with pytest.raises(SystemExit) as info:
        main([*args[:5], str(other), *args[6:], "--max-steps", "4"])
    assert info.value.code == 1
    assert "saved by a run with other settings (lr: 0.05 saved, 0.5 now)" in capsys.readouterr().err
    assert load_results(path) == again


def test_a_diverged_run_still_ends_with_a_summary(tmp_path: Path) -> None:
    """Non-finite losses are recorded as null; the end-of-run summary leaves them out instead of
    failing on them, so the results file is finished."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(asdict(TrainConfig(test_examples=100, lr=1e30))))
    main(["--optimizer", "sgd", "--workers", "1", "--config", str(config), "--max-steps", "3",
          "--out", str(tmp_path / "results"), "--run-dir", str(tmp_path / "run"),
          "--wandb", "disabled"])
    run = load_results(tmp_path / "results" / "fashion_mnist-sgd.json")
    assert run["finished"] and any(s["loss"] is None for s in run["steps"])
    final = run["summary"]["final_train_loss"]
    assert final is None or math.isfinite(final)


def test_a_global_batch_larger_than_the_training_set_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It gave zero steps per epoch and an IndexError at the end of the run."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(asdict(TrainConfig(batch_size=40000))))
    with pytest.raises(SystemExit) as info:
        main(["--optimizer", "sgd", "--workers", "2", "--config", str(config),
              "--out", str(tmp_path / "results"), "--run-dir", str(tmp_path / "run")])
    assert info.value.code == 2  # argparse's code for a bad setting
    assert "at most 30000 images per worker" in capsys.readouterr().err


def test_results_go_to_runs_unless_out_names_the_committed_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's short example run (``--max-steps 100``) replaced the committed D5 results
    file, its default ``--out``; results now go under runs/ by default."""
    from reproductions.dpkfac import train

    launched: list[tuple] = []
    monkeypatch.setattr(train, "fashion_mnist", lambda **_: range(60_000))
    monkeypatch.setattr(train, "run_local", lambda _run, _workers, *options:
                        launched.append(options))
    main(["--optimizer", "dp-kfac", "--workers", "2", "--max-steps", "100"])
    assert launched[0][2] == Path("runs") / "dpkfac" / "results"


@pytest.mark.parametrize("option", ["--out", "--run-dir"])
def test_a_directory_that_cannot_be_created_is_refused_before_training(
        option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A regular file in the place of --out trained the run, then failed with a traceback in
    its first checkpoint; now it is refused (status 2, one line) before anything runs."""
    blocked = tmp_path / "afile"
    blocked.write_text("")
    dirs = {"--out": str(tmp_path / "results"), "--run-dir": str(tmp_path / "run"),
            option: str(blocked)}
    with pytest.raises(SystemExit) as info:
        main(["--optimizer", "sgd", "--workers", "1", "--max-steps", "3", "--wandb",
              "disabled", *(x for item in dirs.items() for x in item)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"invalid {option}='{blocked}'" in err.strip().splitlines()[-1]


def test_the_checkpoint_is_saved_before_the_results_file(tmp_path: Path) -> None:
    """The results file was written first: when it could not be, the steps since the last
    checkpoint (up to 200) were lost with it."""
    blocked = tmp_path / "afile"
    blocked.write_text("")
    with pytest.raises(OSError):
        run(["sgd"], TrainConfig(test_examples=100, max_steps=3), blocked, tmp_path / "run",
            None, "disabled")
    saved = list_checkpoints(tmp_path / "run" / "checkpoints" / "fashion_mnist-sgd" / "rank0")
    assert [p.name for p in saved] == ["checkpoint-000000002.pt"]


def test_a_max_steps_below_the_checkpoint_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rerun with a smaller --max-steps than its checkpoint had done, a run exited 0 and
    rewrote its results file: all the steps recorded, but summary.steps the smaller number."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(asdict(TrainConfig(test_examples=100))))
    args = ["--optimizer", "sgd", "--workers", "1", "--config", str(config), "--wandb",
            "disabled", "--out", str(tmp_path / "results"), "--run-dir", str(tmp_path / "run")]
    main([*args, "--max-steps", "3"])
    path = tmp_path / "results" / "fashion_mnist-sgd.json"
    before = path.read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([*args, "--max-steps", "2"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    checkpoints = tmp_path / "run" / "checkpoints" / "fashion_mnist-sgd" / "rank0"
    assert err.strip().endswith(
        f"error: the checkpoint in {checkpoints} has 3 steps done, more than --max-steps 2; pass "
        "--max-steps 3 or more to continue it, or another --run-dir (or delete this one) to "
        "start afresh")
    assert path.read_bytes() == before


def test_factors_start_at_the_identity_as_the_dpkfac_code_does(tmp_path: Path) -> None:
    """The DP-KFAC code's running factors start at I: one step from the same weights and batch
    gives ``0.05·I + 0.95·F_batch`` where ``factor_init="batch"`` gives ``F_batch``."""
    factors = {}
    for init in ("identity", "batch"):
        config = tmp_path / f"{init}.json"
        config.write_text(json.dumps(asdict(TrainConfig(test_examples=100, factor_init=init))))
        main(["--optimizer", "dp-kfac", "--workers", "1", "--config", str(config),
              "--max-steps", "1", "--wandb", "disabled", "--out", str(tmp_path / init),
              "--run-dir", str(tmp_path / f"run-{init}")])
        saved = list_checkpoints(tmp_path / f"run-{init}" / "checkpoints"
                                 / "fashion_mnist-dp-kfac" / "rank0")[-1]
        factors[init] = torch.load(saved, weights_only=False)["precond"]["layers"]
    assert len(factors["batch"]) == 4
    for name, layer in factors["batch"].items():
        for key in ("A", "G"):
            batch = layer[key].double()
            expected = 0.05 * torch.eye(len(batch), dtype=torch.float64) + 0.95 * batch
            torch.testing.assert_close(factors["identity"][name][key].double(), expected)


def test_an_unknown_factor_init_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="factor_init"):
        TrainConfig(factor_init="zeros")


def test_a_checkpoint_saved_before_factor_init_existed_resumes_as_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its saved settings lack the field, which compared as None against either value: the run
    could not be resumed at all. It ran with the first batch's factors, and resumes so."""
    args = ["--optimizer", "dp-kfac", "--workers", "1", "--wandb", "disabled",
            "--out", str(tmp_path / "results"), "--run-dir", str(tmp_path / "run")]

    def config(init: str) -> str:
        path = tmp_path / f"{init}.json"
        path.write_text(json.dumps(asdict(TrainConfig(test_examples=100, factor_init=init))))
        return str(path)

    main([*args, "--config", config("batch"), "--max-steps", "1"])
    folder = tmp_path / "run" / "checkpoints" / "fashion_mnist-dp-kfac" / "rank0"
    (saved,) = list_checkpoints(folder)
    state = torch.load(saved, weights_only=False)
    del state["config"]["factor_init"]
    save_checkpoint(folder, checkpoint_step(saved), state)
    with pytest.raises(SystemExit):
        main([*args, "--config", config("identity"), "--max-steps", "2"])
    assert "factor_init: 'batch' saved, 'identity' now" in capsys.readouterr().err
    main([*args, "--config", config("batch"), "--max-steps", "2"])
    run = load_results(tmp_path / "results" / "fashion_mnist-dp-kfac.json")
    assert [s["step"] for s in run["steps"]] == [0, 1]
