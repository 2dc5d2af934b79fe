"""The training entry point: Fashion-MNIST, a generated image folder, resume, and 2-process gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils.data import Dataset

from core.config import ConfigError
from data.errors import DataUnavailableError
from data.fashion_mnist import fashion_mnist
from data.image_folder import make_tiny_image_folder
from reproductions.common.checkpoint import checkpoint_step, list_checkpoints
from reproductions.common.results import load_results
from reproductions.osawa2018 import train
from reproductions.osawa2018.config import load_config
from reproductions.osawa2018.sampling import StreamBatchSampler, StreamExamples
from reproductions.osawa2018.train import main, run
from reproductions.osawa2018.trainer import OsawaTrainer
from tests.reliability.test_bad_input import Parsed, assert_clear_error, invoke

REPO = Path(__file__).resolve().parents[3]

#: Two updates of 64 examples in two micro-batches, evaluated only at the end.
TINY = {"width": 4, "batch_size": 64, "micro_batch_size": 32, "eval_every_epochs": 1.0,
        "eval_batch_size": 2500}


@pytest.fixture(scope="module", autouse=True)
def fashion_available() -> None:
    try:
        fashion_mnist(train=False)
    except DataUnavailableError as err:
        pytest.skip(str(err))


def final_parameters(out: Path) -> dict[str, torch.Tensor]:
    """Trainable parameters (not BatchNorm buffers) of rank 0's newest checkpoint."""
    newest = list_checkpoints(out / "checkpoints" / "rank-0")[-1]
    model = torch.load(newest, weights_only=True)["trainer"]["model"]
    return {k: v for k, v in model.items() if "running" not in k and "num_batches" not in k}


def test_two_steps_on_fashion_mnist_write_results_and_checkpoint(tmp_path: Path) -> None:
    main(["--config", "fmnist_default", "--out", str(tmp_path), "--max-steps", "2",
          "--wandb", "disabled", "--no-progress", "--set",
          *(f"{k}={v}" for k, v in TINY.items())])
    results = load_results(tmp_path / "results.json")
    assert [s["step"] for s in results["steps"]] == [1, 2]
    assert results["paper"] == "osawa2018" and results["optimizer"] == "kfac"
    assert results["config"]["bn_fisher"] == "unit" and results["finished"] is None
    assert results["evals"] == []  # stopped off the evaluation schedule: none recorded
    assert results["summary"]["planned_steps"] == 1875  # ceil(60,000 · 2 / 64)
    assert results["optimizer_stage_time_s"]["factors"] > 0
    assert len(list_checkpoints(tmp_path / "checkpoints" / "rank-0")) == 1


@pytest.mark.parametrize("optimizer", ["kfac", "sgd"])
def test_every_recipe_switch_can_be_turned_off(tmp_path: Path, optimizer: str) -> None:
    config = load_config("fmnist_default", {**TINY, "optimizer": optimizer, "bn_fisher": "none",
                                            "mixup_alpha": 0, "erasing_rate": 0,
                                            "weight_rescaling": False, "adjust_momentum": False,
                                            "lr_power": 0})
    results = run(config, out=tmp_path, max_steps=1, wandb="disabled", progress=False)
    assert results is not None and results["optimizer"] == optimizer
    assert bool(results["optimizer_stage_time_s"]) == (optimizer == "kfac")
    with pytest.raises(ConfigError, match="bn_fisher"):
        load_config("fmnist_default", {"bn_fisher": "kron"})
    with pytest.raises(ConfigError, match="lr_decay"):
        load_config("fmnist_default", {"lrdecay": 1})


def test_resume_continues_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A resumed run equals an uninterrupted one; ``--resume`` where there is no checkpoint
    starts afresh saying so (it had started silently, as for a mistyped ``--out``)."""
    config = load_config("fmnist_default", TINY)  # running mixup and erasing on
    straight = run(config, out=tmp_path / "a", max_steps=3, resume=True, wandb="disabled",
                   progress=False)
    assert "no checkpoint in " in capsys.readouterr().err
    run(config, out=tmp_path / "b", max_steps=2, wandb="disabled", progress=False)
    resumed = run(config, out=tmp_path / "b", max_steps=3, resume=True, wandb="disabled",
                  progress=False)
    assert "resuming from the checkpoint of step 2" in capsys.readouterr().err
    assert straight is not None and resumed is not None
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in straight["steps"]]
    assert resumed["evals"] == straight["evals"]  # the stop added no evaluation of its own
    a, b = final_parameters(tmp_path / "a"), final_parameters(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_fresh_run_replaces_the_checkpoints_and_resume_refuses_other_settings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--resume`` a run in an old ``--out`` starts from its own checkpoints (the old
    run's, of higher steps, would have outranked them); ``--resume`` under other settings
    stops with an error naming them, instead of continuing the old run as the new one."""
    base = ["--config", "fmnist_default", "--out", str(tmp_path), "--wandb", "disabled",
            "--no-progress"]
    tiny = [f"{k}={v}" for k, v in TINY.items()]
    main([*base, "--max-steps", "3", "--set", *tiny])
    main([*base, "--max-steps", "1", "--set", *tiny, "lr=0.05"])
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path / "checkpoints" / "rank-0")
            ] == [1]
    with pytest.raises(SystemExit) as info:
        main([*base, "--max-steps", "2", "--resume", "--set", *tiny])
    assert info.value.code == 1
    error = capsys.readouterr().err
    assert "saved by a run with other settings (lr: 0.05 saved" in error
    main([*base, "--max-steps", "2", "--resume", "--set", *tiny, "lr=0.05"])
    assert [s["step"] for s in load_results(tmp_path / "results.json")["steps"]] == [1, 2]


def test_two_steps_on_a_generated_image_folder(tmp_path: Path) -> None:
    folder = make_tiny_image_folder(tmp_path / "images", classes=3, per_class=8, size=20)
    config = load_config("fmnist_default", {
        "data": "image-folder", "image_size": 16, "width": 4, "batch_size": 12,
        "micro_batch_size": 6, "eval_batch_size": 8, "epochs": 1.0})
    results = run(config, out=tmp_path / "out", folder=str(folder), max_steps=2,
                  wandb="disabled", progress=False)
    assert results is not None and len(results["steps"]) == 2
    assert results["evals"][-1]["step"] == 2
    with pytest.raises(ValueError, match="image-folder"):
        run(config, out=tmp_path / "x", wandb="disabled", progress=False)
    # A folder given to a Fashion-MNIST config was ignored: the run trained on Fashion-MNIST.
    with pytest.raises(ConfigError, match=r"--image-folder=.*only with data 'image-folder'"):
        run(load_config("fmnist_default"), out=tmp_path / "y", folder=str(folder),
            wandb="disabled", progress=False)


def test_stream_sampler_splits_global_batches_across_ranks_and_epochs() -> None:
    single = iter(StreamBatchSampler(10, 4, 2, seed=3))
    first_two = [next(single) for _ in range(6)]  # three global batches straddle an epoch
    assert [p for batch in first_two for _, p in batch] == list(range(12))  # stream positions
    flat = [i for batch in first_two for i, _ in batch]
    assert sorted(flat[:10]) == list(range(10)) and len(set(flat[10:])) == 2
    ranks = [iter(StreamBatchSampler(10, 4, 2, rank=r, world_size=2, seed=3)) for r in (0, 1)]
    assert [next(ranks[0]), next(ranks[1])] == first_two[:2]
    resumed = iter(StreamBatchSampler(10, 4, 2, seed=3, start_step=2))
    assert [next(resumed), next(resumed)] == first_two[4:6]


class Draws(Dataset):
    """Each example is a draw from torch's global generator, as a random transform makes one."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(2)


def test_stream_examples_draw_by_stream_position_and_leave_the_global_generator() -> None:
    examples = StreamExamples(Draws(), seed=7)
    torch.manual_seed(0)
    first = examples[(1, 5)]
    after = torch.rand(1)
    torch.manual_seed(1)
    assert torch.equal(examples[(3, 5)], first)  # the position decides, not the global state
    assert not torch.equal(examples[(1, 6)], first)
    assert not torch.equal(StreamExamples(Draws(), seed=8)[(1, 5)], first)
    torch.manual_seed(0)
    examples[(2, 9)]
    assert torch.equal(torch.rand(1), after)  # the caller's generator is left as it was
    torch.manual_seed(0)
    unseeded = StreamExamples(Draws())[(0, 5)]  # no seed: the global generator's next draw
    torch.manual_seed(0)
    assert torch.equal(unseeded, torch.rand(2))


def test_trainer_state_carries_the_stage_times_so_far() -> None:
    """A resumed run's results report the K-FAC stage times of the whole run."""
    config = load_config("fmnist_default", {**TINY, "batch_size": 8, "micro_batch_size": 4})

    def trainer() -> OsawaTrainer:
        return OsawaTrainer(config, num_classes=3, in_channels=1, dataset_size=64,
                            device=torch.device("cpu"))

    trained = trainer()
    trained.train_step([(torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))) for _ in range(2)])
    resumed = trainer()
    resumed.load_state_dict(trained.state_dict())
    assert trained.stage_times()["factors"] > 0
    assert resumed.stage_times() == trained.stage_times()
    assert resumed.ledger() is None  # one process: nothing moves


def test_weight_decay_raises_the_damping_of_the_layers_that_take_it_only() -> None:
    """λ = max(the parameter's L2 coefficient, damping) (chainerkfac's ``get_diagval``): the
    Conv/Linear layers take ``weight_decay``, BatchNorm's parameters none, so its damping stays
    ``bn_damping_scale · damping`` (it took the max too)."""
    config = load_config("fmnist_default", {**TINY, "weight_decay": 1e-3, "damping": 2.5e-4})
    trainer = OsawaTrainer(config, num_classes=3, in_channels=1, dataset_size=64,
                           device=torch.device("cpu"))
    assert trainer.kfac is not None and trainer.bn is not None
    assert trainer.kfac.config.damping == 1e-3
    assert trainer.bn.damping == pytest.approx(64 * 2.5e-4)


@pytest.mark.distributed
def test_two_gloo_processes_with_the_osawa_strategy_match_one_process(tmp_path: Path) -> None:
    """With augmentation off, 2 processes × 1 micro-batch equal 1 process × 2 micro-batches;
    each evaluation (one per step here) is printed once, by rank 0 (it was printed by every
    rank)."""
    common: dict[str, Any] = {**TINY, "mixup_alpha": 0, "erasing_rate": 0, "strategy": "osawa",
                              "eval_every_epochs": 0.001}
    settings = [f"{k}={v}" for k, v in common.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "reproductions.osawa2018.train", "--out", str(tmp_path / "gloo"),
         "--max-steps", "2", "--wandb", "disabled", "--no-progress", "--set", *settings],
        cwd=REPO, env=env, check=True, timeout=240, capture_output=True)
    run(load_config("fmnist_default", common), out=tmp_path / "one", max_steps=2,
        wandb="disabled", progress=False)
    results = load_results(tmp_path / "gloo" / "results.json")
    assert results["hardware"]["world_size"] == 2
    assert len(results["evals"]) == 2
    assert completed.stdout.decode().count("test accuracy") == 2
    assert {"factor_comm", "grad_comm"} <= set(results["ledger"])
    gloo, one = final_parameters(tmp_path / "gloo"), final_parameters(tmp_path / "one")
    for name, value in one.items():
        assert torch.allclose(gloo[name], value, rtol=1e-4, atol=1e-5), name
    rank1 = torch.load(list_checkpoints(tmp_path / "gloo" / "checkpoints" / "rank-1")[-1],
                       weights_only=True)["trainer"]["model"]
    assert all(torch.equal(rank1[k], v) for k, v in gloo.items())


def test_an_out_that_cannot_be_created_is_refused_before_training(tmp_path: Path) -> None:
    """A regular file in the place of --out ended in a FileExistsError traceback from the W&B
    tracker, after the data and the model were loaded."""
    blocked = tmp_path / "afile"
    blocked.write_text("")
    never_run = mock.patch.object(train, "run", side_effect=Parsed)
    for out in (blocked, blocked / "run"):
        outcome, stderr = invoke(main, ["--out", str(out), "--wandb", "disabled"], never_run)
        assert_clear_error(outcome, stderr, set())
        assert f"--out='{out}'" in stderr and f"{blocked} is not a directory" in stderr


def test_a_data_dir_that_cannot_be_created_ends_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It ended in a NotADirectoryError traceback from the first cache written."""
    blocked = tmp_path / "afile"
    blocked.write_text("")
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "out"), "--data-dir", str(blocked), "--max-steps", "1",
              "--wandb", "disabled", "--no-progress"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"error: the data cache directory {blocked} ({blocked} is not a directory) is not " \
           "available. Fix: pass --data-dir" in err.strip().splitlines()[-1]
