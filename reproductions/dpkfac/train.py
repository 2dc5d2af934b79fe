"""Does DP-KFAC keep MPD-KFAC's convergence? SGD, MPD-KFAC and DP-KFAC on Fashion-MNIST (D5).

    python -m reproductions.dpkfac.train                     # 4 local gloo workers, all three
    python -m reproductions.dpkfac.train --out reproductions/dpkfac/results   # the committed D5
    python -m reproductions.dpkfac.train --optimizer dp-kfac --epochs 1 --workers 2
    torchrun --nproc_per_node=4 -m reproductions.dpkfac.train --optimizer mpd-kfac

Every optimizer trains the same CNN from the same initial weights on the same global batches
(each worker takes its slice), with momentum SGD underneath; MPD-KFAC (factors all-reduced,
layer ``l`` inverted on rank ``l mod P``, which broadcasts its preconditioned gradient) and
DP-KFAC (layer ``l``'s factors built only on rank ``l mod P``, from its own slice) share every
hyper-parameter, in the DP-KFAC code's conventions (``factor_scaling="dpkfac"``, eigen). Per
optimizer one results file ``<out>/<experiment>-<optimizer>.json`` (schema
``kfac-repro/results/v1``), one W&B run (offline unless logged in) and per-rank atomic
checkpoints under ``<run-dir>/checkpoints``; an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from tqdm import tqdm

from core import KFACPreconditioner
from core.config import FACTOR_INITS, ConfigError, check_choice, check_number
from core.distributed import Communicator, average_gradients
from core.preconditioner import discover_layers
from core.timing import StageTimer
from data.fashion_mnist import fashion_mnist
from data.paths import add_data_dir_argument
from reproductions.common.checkpoint import (
    CheckpointError,
    load_agreed_checkpoint,
    require_same_config,
    save_checkpoint,
)
from reproductions.common.cli import exit_on_user_error, positive_int, writable_directory
from reproductions.common.launch import (
    DistContext,
    cleanup,
    finished,
    init_distributed,
    run_local,
    seed_everything,
)
from reproductions.common.results import RunRecorder
from reproductions.common.rng import capture_rng_state, restore_rng_state
from reproductions.common.tracking import Tracker, add_wandb_argument
from reproductions.dpkfac.workloads import DP_KFAC, SCHEMES, Scheme

PAPER = "dpkfac"
HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "fashion_mnist.json"
OPTIMIZERS: dict[str, Scheme | None] = {
    "sgd": None,
    "mpd-kfac": next(s for s in SCHEMES if s.label == "MPD-KFAC"),
    "dp-kfac": DP_KFAC,
}
"""Optimizer name → the distribution scheme preconditioning it (None: plain SGD)."""


@dataclass(frozen=True)
class TrainConfig:
    """One experiment (``configs/*.json`` hold these fields).

    Attributes:
        experiment: Names the results files, W&B group and checkpoints.
        epochs: Passes over the 60,000 training images.
        max_steps: Stop earlier, after this many steps (None: all epochs).
        batch_size: Images per worker per step (the global batch is this × workers).
        lr: Peak learning rate of momentum SGD (cosine decay to 0 over the run).
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        damping: K-FAC damping λ (eigen: ``1/(d_G d_Aᵀ + λ)``).
        factor_decay: Weight of the old running factor (DP-KFAC code's ``stat_decay`` 0.95
            puts 0.95 on the new statistic, i.e. 0.05 here).
        kl_clip: KL-clip κ.
        factor_init: Where the running factors start: "identity" (the DP-KFAC code's: the first
            update gives ``0.05·I + 0.95·F_batch`` at factor decay 0.05) or "batch" (the first
            batch's factors), :class:`~core.config.KFACConfig`'s field.
        factor_update_steps: Steps between factor updates.
        inv_update_steps: Steps between eigendecompositions.
        seed: Seeds initial weights and data order.
        checkpoint_every: Steps between checkpoints (and at each epoch's end).
        test_examples: Evaluate on the first this many test images (None: all 10,000).
    """

    experiment: str = "fashion_mnist"
    epochs: int = 2
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    damping: float = 0.03
    factor_decay: float = 0.05
    kl_clip: float = 1e-3
    factor_init: str = "identity"
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    seed: int = 0
    checkpoint_every: int = 200
    test_examples: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.experiment, str) or not self.experiment or "/" in self.experiment:
            raise ConfigError("experiment", self.experiment, "a non-empty name without '/'")
        for name in ("epochs", "batch_size", "factor_update_steps", "inv_update_steps",
                     "checkpoint_every"):
            check_number(name, getattr(self, name), low=1, integer=True)
        for name in ("max_steps", "test_examples"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), low=1, integer=True)
        check_number("seed", self.seed, low=0, integer=True)
        finite = {"high": math.inf, "high_inclusive": False}
        for name in ("lr", "weight_decay"):
            check_number(name, getattr(self, name), low=0.0, **finite)
        for name in ("damping", "kl_clip"):
            check_number(name, getattr(self, name), low=0.0, low_inclusive=False, **finite)
        for name in ("momentum", "factor_decay"):
            check_number(name, getattr(self, name), low=0.0, high=1.0, high_inclusive=False)
        check_choice("factor_init", self.factor_init, FACTOR_INITS)

    def steps_per_epoch(self, train_size: int, world_size: int) -> int:
        """Steps per pass over ``train_size`` images with ``world_size`` workers (the tail
        that fills no global batch is dropped).

        Raises:
            ConfigError: if one global batch is larger than the training set.
        """
        steps = train_size // (self.batch_size * world_size)
        if steps == 0:
            raise ConfigError("batch_size", self.batch_size,
                              f"at most {train_size // world_size} images per worker: "
                              f"{world_size} workers share {train_size} training images")
        return steps

    @classmethod
    def from_file(cls, path: Path) -> TrainConfig:
        """Read a JSON config.

        Raises:
            ConfigError: the file cannot be read, is not a JSON object, or has an unknown or
                invalid field (named).
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError("--config", str(path), f"a readable JSON file ({exc})") from None
        known = [f.name for f in fields(cls)]
        if not isinstance(data, dict):
            raise ConfigError("--config", str(path), "a JSON object of fields: "
                              + ", ".join(known))
        for key in data:
            if key not in known:
                raise ConfigError(key, data[key], f"a field of {path}: " + ", ".join(known))
        return cls(**data)


def fashion_cnn() -> nn.Module:
    """Three convolutions and a linear layer: K-FAC factors of 10/32, 289/64, 577/64, 65/10."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10),
    )


def cosine(lr: float, total: int) -> Callable[[int], float]:
    """``lr · (1 + cos(π·step/total)) / 2``."""
    return lambda step: lr * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))


def batch_indices(step: int, steps_per_epoch: int, global_batch: int, size: int,
                  seed: int) -> Tensor:
    """The global batch of ``step``: epochs are seeded permutations, the tail dropped."""
    epoch, index = divmod(step, steps_per_epoch)
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return order[index * global_batch:(index + 1) * global_batch]


def _all_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum over workers (outside the K-FAC ledger)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


@torch.no_grad()
def evaluate(model: nn.Module, test: TensorDataset, ctx: DistContext) -> dict[str, float]:
    """Test loss and accuracy, each worker taking every ``P``-th slice of the test set."""
    model.eval()
    x, y = (t[ctx.rank::ctx.world_size] for t in test.tensors)
    loss_sum, correct = 0.0, 0.0
    for start in range(0, len(y), 1000):
        out = model(x[start:start + 1000])
        loss_sum += float(F.cross_entropy(out, y[start:start + 1000], reduction="sum"))
        correct += float((out.argmax(1) == y[start:start + 1000]).sum())
    model.train()
    loss_sum, correct = _all_sum([loss_sum, correct], ctx)
    return {"test_loss": loss_sum / len(test), "test_accuracy": correct / len(test)}


def _max_over_workers(values: dict[str, int], ctx: DistContext) -> dict[str, int]:
    tensor = torch.tensor(list(values.values()), dtype=torch.float64)
    if ctx.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return {k: int(v) for k, v in zip(values, tensor.tolist(), strict=True)}


def train_one(name: str, config: TrainConfig, ctx: DistContext, *, out: Path, run_dir: Path,
              data_dir: str | None, wandb_mode: str) -> dict[str, Any]:
    """Train one optimizer; returns the results object (rank 0's; others return {})."""
    scheme = OPTIMIZERS[name]
    train_set = fashion_mnist(train=True, root=data_dir)
    test_set = TensorDataset(*(t[:config.test_examples]
                               for t in fashion_mnist(train=False, root=data_dir).tensors))
    global_batch = config.batch_size * ctx.world_size
    steps_per_epoch = config.steps_per_epoch(len(train_set), ctx.world_size)
    total = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    schedule = cosine(config.lr, config.epochs * steps_per_epoch)

    seed_everything(config.seed)
    model = fashion_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)
    precond = None if scheme is None else KFACPreconditioner(
        model, strategy=scheme.strategy, factor_scaling="dpkfac",
        **scheme.options_for(len(discover_layers(model, ())), ctx.world_size),
        inverse_method="eigen", damping=config.damping, factor_decay=config.factor_decay,
        kl_clip=config.kl_clip, lr=schedule, factor_init=config.factor_init,
        factor_update_steps=config.factor_update_steps, inv_update_steps=config.inv_update_steps)
    communicator = (precond.strategy.communicator if precond is not None
                    else Communicator.from_torch())
    run_config = asdict(config) | {"optimizer": name, "world_size": ctx.world_size,
                                   "global_batch": global_batch, "model": "fashion_cnn",
                                   "scheme": None if scheme is None else asdict(scheme)}
    recorder = RunRecorder(paper=PAPER, experiment=config.experiment, optimizer=name,
                           config=run_config, world_size=ctx.world_size, device=ctx.device)
    checkpoints = run_dir / "checkpoints" / f"{config.experiment}-{name}" / f"rank{ctx.rank}"
    state = load_agreed_checkpoint(checkpoints, ctx.device,
                                   fix="pass another --run-dir (or delete this one) to start "
                                       "afresh")
    step, elapsed, run_id = 0, 0.0, None
    stage_time = StageTimer()
    if state is not None:  # an interrupted run of these settings continues
        saved = state.get("config")
        if saved is not None:  # saved before the field existed: its factors started at a batch
            saved = {"factor_init": "batch", **saved}
        require_same_config(saved, run_config, checkpoints, ignore=("max_steps",),
                            fix="run with the same settings to continue it, or pass another "
                                "--run-dir (or delete this one) to start afresh")
        if state["step"] + 1 > total:  # its results would record more steps than it says
            if ctx.world_size > 1:
                dist.barrier()  # every rank refuses alike: they leave together
            raise CheckpointError(
                f"the checkpoint in {checkpoints} has {state['step'] + 1} steps done, more than "
                f"--max-steps {total}; pass --max-steps {state['step'] + 1} or more to continue "
                "it, or another --run-dir (or delete this one) to start afresh")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        stage_time.totals.update(state["stage_time"])
        communicator.ledger.load_state_dict(state["ledger"])
        if precond is not None:
            precond.load_state_dict(state["precond"])
            precond.timer.totals.update(state["precond_stage_time"])
        restore_rng_state(state["rng"])
        step, elapsed, run_id = state["step"] + 1, state["elapsed"], state["wandb_id"]
        if ctx.is_main:  # its records so far, under this run's settings (--max-steps)
            recorder = RunRecorder.from_data(state["results"], run_config)
    tracker = Tracker(paper=PAPER, experiment=config.experiment, optimizer=name,
                      seed=config.seed, config=run_config, directory=run_dir, mode=wandb_mode,
                      run_id=run_id, enabled=ctx.is_main)
    recorder.update(wandb=tracker.info() if ctx.is_main and tracker.mode != "disabled" else None)
    out_file = out / f"{config.experiment}-{name}.json"
    x_all, y_all = train_set.tensors
    rows = slice(ctx.rank * config.batch_size, (ctx.rank + 1) * config.batch_size)

    def checkpoint(at: int) -> None:
        """Save step ``at``, then the results so far: should the results file fail to be
        written, the steps are not lost with it."""
        save_checkpoint(checkpoints, at, {
            "step": at, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "precond": None if precond is None else precond.state_dict(),
            "rng": capture_rng_state(), "elapsed": elapsed, "wandb_id": tracker.id,
            "stage_time": dict(stage_time.totals), "ledger": communicator.ledger.state_dict(),
            "precond_stage_time": {} if precond is None else dict(precond.timer.totals),
            "results": recorder.data if ctx.is_main else None,
            "config": recorder.data["config"], "world_size": ctx.world_size})
        if ctx.is_main:
            recorder.write(out_file)

    progress = tqdm(total=total, initial=step, desc=name, disable=not ctx.is_main,
                    mininterval=5.0)
    while step < total:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        index = batch_indices(step, steps_per_epoch, global_batch, len(train_set),
                              config.seed)[rows]
        captured = 0.0 if precond is None else precond.timer.totals["factors"]
        with stage_time.stage("forward_backward"):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x_all[index]), y_all[index])
            loss.backward()
        if precond is not None:  # the capture hooks ran inside; their time is "factors"
            stage_time.totals["forward_backward"] -= precond.timer.totals["factors"] - captured
        with stage_time.stage("grad_allreduce"):
            average_gradients(model.parameters(), communicator)
        if precond is not None:
            precond.step()
        with stage_time.stage("base_step"):
            optimizer.step()
        seconds = time.perf_counter() - start
        elapsed += seconds
        (mean_loss,) = _all_sum([loss.item() / ctx.world_size], ctx)
        metrics = {"loss": mean_loss, "time_s": seconds, "lr": schedule(step)}
        if precond is not None:
            metrics["kl_scale"] = precond.last_kl_scale
        if ctx.is_main:
            recorder.log_step(step, **metrics)
            tracker.log(metrics, step=step)
        # evaluated at epoch ends only, not where --max-steps stops the run: a continued run
        # must record the evaluations of an uninterrupted one
        end_of_epoch = (step + 1) % steps_per_epoch == 0
        if end_of_epoch:
            evaluation = evaluate(model, test_set, ctx)
            if ctx.is_main:
                recorder.log_eval(step, epoch=(step + 1) / steps_per_epoch, **evaluation)
                tracker.log(evaluation, step=step)
                progress.set_postfix(loss=f"{mean_loss:.3f}",
                                     acc=f"{evaluation['test_accuracy']:.4f}")
        if end_of_epoch or step + 1 == total or (step + 1) % config.checkpoint_every == 0:
            checkpoint(step)
        step += 1
        progress.update()
    progress.close()

    memory = {"momentum": sum(s["momentum_buffer"].numel() * s["momentum_buffer"].element_size()
                              for s in optimizer.state.values() if "momentum_buffer" in s)}
    if precond is not None:
        memory |= {f"kfac_{k}": v for k, v in precond.memory_usage().items()}
    memory = _max_over_workers(memory, ctx)
    result: dict[str, Any] = {}
    if ctx.is_main:
        evals = recorder.data["evals"]
        losses = [s["loss"] for s in recorder.data["steps"][-steps_per_epoch:]
                  if s["loss"] is not None]  # a diverged step's loss is recorded as null
        recorder.update(
            memory=memory,
            ledger={k: asdict(v) for k, v in communicator.ledger.summary().items()},
            optimizer_stage_time_s=dict(stage_time.totals)
            | ({} if precond is None else dict(precond.timer.totals)),
            summary={"final_test_accuracy": evals[-1]["test_accuracy"] if evals else None,
                     "best_test_accuracy": max((e["test_accuracy"] for e in evals),
                                               default=None),
                     "final_test_loss": evals[-1]["test_loss"] if evals else None,
                     "final_train_loss": sum(losses) / len(losses) if losses else None,
                     "train_seconds": elapsed, "steps": total,
                     "epochs": total / steps_per_epoch, "world_size": ctx.world_size,
                     "kfac_layers": 0 if precond is None else len(precond.layers)})
        recorder.finish()
        recorder.write(out_file)
        tracker.summary(recorder.data["summary"])
        result = recorder.data
    tracker.finish()
    return result


def run(names: list[str], config: TrainConfig, out: Path, run_dir: Path,
        data_dir: str | None, wandb_mode: str) -> list[dict[str, Any]]:
    """Train every optimizer in turn in this (already joined) process, on the CPU (gloo under
    ``torchrun`` too): the model, the data and the sums over workers stay there."""
    ctx = init_distributed("cpu")
    results = [train_one(name, config, ctx, out=out, run_dir=run_dir, data_dir=data_dir,
                         wandb_mode=wandb_mode) for name in names]
    finished()
    return results


def main(argv: list[str] | None = None) -> None:
    """The command line; a configuration or data error exits with one line (no traceback)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", nargs="+", choices=list(OPTIMIZERS),
                        default=list(OPTIMIZERS))
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--workers", type=positive_int, default=4,
                        help="local gloo processes to start (ignored under torchrun)")
    parser.add_argument("--epochs", type=positive_int, help="override the config's epochs")
    parser.add_argument("--max-steps", type=positive_int, help="stop after this many steps")
    parser.add_argument("--out", type=Path, default=Path("runs") / PAPER / "results",
                        help="where results files go (the committed D5 runs: "
                        "--out reproductions/dpkfac/results)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs") / PAPER,
                        help="checkpoints and W&B files")
    add_data_dir_argument(parser)
    add_wandb_argument(parser)
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        writable_directory(args.out, "--out")
        writable_directory(args.run_dir, "--run-dir")
        config = TrainConfig.from_file(args.config)
        overrides = {k: v for k, v in (("epochs", args.epochs), ("max_steps", args.max_steps))
                     if v is not None}
        config = replace(config, **overrides)
        # the cache built once, before the workers; the batch checked against it
        train_size = len(fashion_mnist(train=True, root=args.data_dir))
        world_size = (int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ
                      else args.workers)
        config.steps_per_epoch(train_size, world_size)
        fashion_mnist(train=False, root=args.data_dir)
        options = (args.optimizer, config, args.out, args.run_dir, args.data_dir, args.wandb)
        if "RANK" in os.environ or args.workers == 1:
            run(*options)
            cleanup()
        else:
            run_local(run, args.workers, *options)


if __name__ == "__main__":
    main()
