"""Train with Osawa et al.'s large-batch K-FAC recipe; torchrun-compatible.

Examples::

    # the built-in default: a small ResNet on Fashion-MNIST, CPU, a few minutes
    python -m reproductions.osawa2018.train
    # momentum SGD instead of K-FAC, BatchNorm left first-order, no mixup
    python -m reproductions.osawa2018.train --set optimizer=sgd bn_fisher=none mixup_alpha=0
    # the paper's scale: ResNet-50 on an ImageNet folder, batch 32,768 on 128 GPUs × 8 micro-steps
    torchrun --nnodes 16 --nproc_per_node 8 ... -m reproductions.osawa2018.train \\
        --config imagenet_bs32k --image-folder /data/imagenet --out runs/bs32k
    # continue an interrupted run from its newest checkpoint
    python -m reproductions.osawa2018.train --resume
    # survive a failed worker: torchrun restarts the group, which resumes from its checkpoints
    torchrun --nproc_per_node 8 --max-restarts 3 ... -m reproductions.osawa2018.train \\
        --out runs/bs32k --checkpoint-every 100

Each run writes ``<out>/results.json`` (schema ``kfac-repro/results/v1``, rewritten at every
evaluation), per-rank checkpoints under ``<out>/checkpoints/rank-<r>/`` and a W&B run under
``<out>/wandb`` (offline unless logged in).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

from core.config import ConfigError
from data.fashion_mnist import fashion_mnist
from data.image_folder import image_folder
from data.paths import add_data_dir_argument
from reproductions.common.checkpoint import (
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
    seed_everything,
)
from reproductions.common.results import RunRecorder
from reproductions.common.rng import capture_rng_state, restore_rng_state
from reproductions.common.tracking import Tracker, add_wandb_argument
from reproductions.osawa2018.config import OsawaConfig, load_config, parse_override
from reproductions.osawa2018.sampling import StreamBatchSampler, StreamExamples
from reproductions.osawa2018.schedule import epoch_at
from reproductions.osawa2018.trainer import OsawaTrainer

PAPER = "osawa2018"


@dataclass
class TrainingData:
    """The splits of one data set and what the model needs to know about it.

    The training split is read at the ``(index, stream position)`` pairs of
    :class:`~reproductions.osawa2018.sampling.StreamBatchSampler`.
    """

    train: StreamExamples
    test: Dataset
    num_classes: int
    in_channels: int


def load_data(config: OsawaConfig, data_dir: str | None, folder: str | None) -> TrainingData:
    """Fashion-MNIST (cached under ``data_dir``) or an ImageNet-style folder.

    The folder's random crops and flips are seeded per example by ``config.seed`` and its stream
    position; Fashion-MNIST has no random transforms.

    Raises:
        ConfigError: ``image-folder`` data without a folder, or a folder with other data (it
            would be ignored: the run would train on Fashion-MNIST).
        DataUnavailableError: the data is not there (the message says how to get it).
    """
    if config.data == "fashion-mnist":
        if folder is not None:
            raise ConfigError("--image-folder", folder,
                              "only with data 'image-folder' (e.g. --config imagenet_bs4k, or "
                              "--set data=image-folder); this config trains on Fashion-MNIST")
        return TrainingData(StreamExamples(fashion_mnist(True, data_dir)),
                            fashion_mnist(False, data_dir), 10, 1)
    if folder is None:
        raise ConfigError("--image-folder", None,
                          "a folder with train/ and val/ inside for data 'image-folder'")
    train = image_folder(Path(folder), True, config.image_size)
    return TrainingData(StreamExamples(train, config.seed),
                        image_folder(Path(folder), False, config.image_size), len(train.classes), 3)


def summarize(config: OsawaConfig, evals: list[dict[str, Any]], steps: list[dict[str, Any]],
              dataset_size: int) -> dict[str, Any]:
    """The numbers the tables read: final and best accuracy, and the first target crossing."""
    accuracies = [e["test_accuracy"] for e in evals]
    reached = next((e for e in evals if config.target_accuracy is not None
                    and e["test_accuracy"] >= config.target_accuracy), None)
    return {
        "batch_size": config.batch_size,
        "steps": steps[-1]["step"] if steps else 0,
        "epochs": epoch_at(steps[-1]["step"], config.batch_size, dataset_size) if steps else 0.0,
        "planned_steps": config.total_steps(dataset_size),
        "final_test_accuracy": accuracies[-1] if accuracies else None,
        "best_test_accuracy": max(accuracies) if accuracies else None,
        "target_accuracy": config.target_accuracy,
        "steps_to_target": None if reached is None else reached["step"],
        "epochs_to_target": None if reached is None else reached["epoch"],
        "train_time_s": sum(s["time_s"] for s in steps),
    }


def _test_loader(data: TrainingData, config: OsawaConfig, ctx: DistContext) -> DataLoader:
    """This rank's strided shard of the test split (every example counted exactly once)."""
    shard = Subset(data.test, range(ctx.rank, len(data.test), ctx.world_size))
    return DataLoader(shard, batch_size=config.eval_batch_size, num_workers=config.num_workers,
                      generator=torch.Generator())  # evaluating must not draw from the global RNG


def run(config: OsawaConfig, *, out: Path, data_dir: str | None = None,
        folder: str | None = None, resume: bool = False, max_steps: int | None = None,
        checkpoint_every: int | None = None, wandb: str = "auto", progress: bool = True
        ) -> dict[str, Any] | None:
    """Train one configuration.

    Args:
        config: The run.
        out: Output directory (results, checkpoints, W&B files).
        data_dir: Cache directory of the built-in data.
        folder: ImageNet-style folder for ``data: image-folder``.
        resume: Continue from the newest checkpoint in ``out`` (a fresh start if there is none);
            implied when ``torchrun`` restarts the worker group after a failure.
        max_steps: Stop after this many updates (the run is then unfinished and resumable).
        checkpoint_every: Also checkpoint every this many updates (None: only at evaluations).
        wandb: W&B mode (``auto``, ``online``, ``offline``, ``disabled``).
        progress: Show a progress bar on rank 0.

    Returns:
        The results object on rank 0, None on the other ranks.
    """
    ctx = init_distributed()
    try:
        result = _run(config, ctx, out=Path(out), data_dir=data_dir, folder=folder,
                      resume=resume or ctx.restarts > 0, max_steps=max_steps,
                      checkpoint_every=checkpoint_every, wandb=wandb, progress=progress)
        finished()
        return result
    finally:
        cleanup()


def _run(config: OsawaConfig, ctx: DistContext, *, out: Path, data_dir: str | None,
         folder: str | None, resume: bool, max_steps: int | None,
         checkpoint_every: int | None, wandb: str, progress: bool) -> dict[str, Any] | None:
    seed_everything(config.seed + ctx.rank)
    data = load_data(config, data_dir, folder)
    size = len(data.train)
    trainer = OsawaTrainer(config, num_classes=data.num_classes, in_channels=data.in_channels,
                           dataset_size=size, device=ctx.device, world_size=ctx.world_size)
    checkpoints = out / "checkpoints" / f"rank-{ctx.rank}"
    recorder = RunRecorder(paper=PAPER, experiment=config.name, optimizer=config.optimizer,
                           config=config.to_dict(), world_size=ctx.world_size,
                           device=ctx.device)
    wandb_id = None
    if not resume:  # a fresh run: the older checkpoints here would outrank its own
        shutil.rmtree(checkpoints, ignore_errors=True)
    state = load_agreed_checkpoint(
        checkpoints, ctx.device, fix="start afresh without --resume (which deletes these "
        "checkpoints) or in another --out") if resume else None
    if state is not None:
        require_same_config(json.loads(state["results"])["config"], config.to_dict(), checkpoints,
                            fix="resume with the same --config and --set, or start afresh "
                                "without --resume (which deletes these checkpoints) or in "
                                "another --out")
        trainer.load_state_dict(state["trainer"])
        recorder = RunRecorder.from_data(json.loads(state["results"]))
        wandb_id = state["wandb_id"]
        if ctx.is_main:
            restart = f"restart {ctx.restarts}: " if ctx.restarts else ""
            tqdm.write(f"{restart}resuming from the checkpoint of step {trainer.step}",
                       file=sys.stderr)
    elif resume and ctx.is_main:  # a restart that failed before the first checkpoint, or
        # a --resume given an --out that holds none: say so rather than start silently
        tqdm.write(f"no checkpoint in {checkpoints}: starting afresh", file=sys.stderr)
    tracker = Tracker(paper=PAPER, experiment=config.name, optimizer=config.optimizer,
                      seed=config.seed, config=config.to_dict(), directory=out, mode=wandb,
                      run_id=wandb_id, enabled=ctx.is_main)
    sampler = StreamBatchSampler(size, config.batch_size, config.micro_batch_size,
                                 rank=ctx.rank, world_size=ctx.world_size, seed=config.seed,
                                 start_step=trainer.step)
    batches = iter(DataLoader(data.train, batch_sampler=sampler, num_workers=config.num_workers,
                              pin_memory=ctx.device.type == "cuda", generator=torch.Generator()))
    test_loader = _test_loader(data, config, ctx)
    if state is not None:  # last: starting the tracker may draw random numbers
        restore_rng_state(state["rng"])
    total = config.total_steps(size)
    stop = total if max_steps is None else min(total, max_steps)
    every = config.eval_every_epochs
    next_eval = (math.floor(trainer.epoch / every + 1e-9) + 1) * every
    if state is not None and trainer.step >= stop and ctx.is_main:
        # Nothing left to train: the run was stopped after its last checkpoint, perhaps before
        # the results file (written after it) caught up with it.
        recorder.write(out / "results.json")
        tracker.summary(recorder.data["summary"])
    bar = tqdm(total=total, initial=trainer.step, disable=not (ctx.is_main and progress),
               desc=f"{config.name} {config.optimizer} B={config.batch_size}", unit="step")
    while trainer.step < stop:
        micro = [next(batches) for _ in range(trainer.accumulation_steps)]
        start = time.perf_counter()
        metrics = trainer.train_step(micro)
        seconds = time.perf_counter() - start
        recorder.log_step(trainer.step, time_s=seconds, **metrics)
        tracker.log({**metrics, **trainer.metrics(), "epoch": trainer.epoch}, step=trainer.step)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", lr=f"{metrics['lr']:.2e}")
        evaluate = trainer.epoch >= next_eval - 1e-9 or trainer.step == total
        # --max-steps: summarised and checkpointed, not evaluated off the schedule (a resumed
        # run must record the evaluations of an uninterrupted one)
        stopping = trainer.step == stop
        if evaluate:
            result = trainer.evaluate(test_loader)
            recorder.log_eval(trainer.step, epoch=trainer.epoch, **result)
            tracker.log({**result, "epoch": trainer.epoch}, step=trainer.step)
            if ctx.is_main:  # tqdm.write prints on every rank, the bar disabled or not
                bar.write(f"epoch {trainer.epoch:.2f} step {trainer.step}: test accuracy "
                          f"{result['test_accuracy']:.4f}, loss {result['test_loss']:.4f}")
            next_eval = (math.floor(trainer.epoch / every + 1e-9) + 1) * every
        if evaluate or stopping:
            summary = summarize(config, recorder.data["evals"], recorder.data["steps"], size)
            recorder.update(summary=summary, wandb=tracker.info(), ledger=trainer.ledger(),
                            optimizer_stage_time_s=trainer.stage_times(),
                            memory=trainer.kfac.memory_usage() if trainer.kfac else {})
            if trainer.step == total:
                recorder.finish()
        if evaluate or stopping or (checkpoint_every is not None
                                    and trainer.step % checkpoint_every == 0):
            save_checkpoint(checkpoints, trainer.step, {
                "trainer": trainer.state_dict(), "rng": capture_rng_state(),
                "results": json.dumps(recorder.data), "wandb_id": tracker.id,
                "world_size": ctx.world_size})
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
        if (evaluate or stopping) and ctx.is_main:
            recorder.write(out / "results.json")
            tracker.summary(recorder.data["summary"])
    bar.close()
    tracker.finish()
    return recorder.data if ctx.is_main else None


def main(argv: list[str] | None = None) -> None:
    """The command line (``--help``); a configuration or data error exits with one line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="fmnist_default",
                        help="a config file, or a name in reproductions/osawa2018/configs/")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="override config fields (JSON values), e.g. optimizer=sgd lr=0.1")
    parser.add_argument("--out", default=None,
                        help="output directory (default: runs/osawa2018/<config name>)")
    parser.add_argument("--image-folder", default=None,
                        help="ImageNet-style folder (train/<class>/…, val/<class>/…)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --out")
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="stop after this many updates (resumable)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="STEPS",
                        help="also checkpoint every STEPS updates (default: at evaluations only)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_data_dir_argument(parser)
    add_wandb_argument(parser)
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        config = load_config(args.config, dict(parse_override(s) for s in args.set))
        out = writable_directory(Path(args.out or Path("runs") / PAPER / config.name), "--out")
        run(config, out=out, data_dir=args.data_dir, folder=args.image_folder,
            resume=args.resume, max_steps=args.max_steps,
            checkpoint_every=args.checkpoint_every, wandb=args.wandb,
            progress=not args.no_progress)


if __name__ == "__main__":
    main()
