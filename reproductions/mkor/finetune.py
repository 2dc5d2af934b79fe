"""The fine-tuning loop GLUE and SQuAD share (the paper's Tables 2-4 evaluate phase-2 models so).

A pre-trained model directory (``<out>/<experiment>/<optimizer>-s<seed>/model``, written by
``reproductions.mkor.bert``: ``save_pretrained`` weights plus the tokenizer) is fine-tuned with
AdamW and a linear warm-up/decay schedule, evaluated after every epoch, and recorded like every
other run: one results file (``kfac-repro/results/v1``, experiment = the task, optimizer = the
pre-trained model's label) and a W&B run. Checkpoints are taken every ``--checkpoint-every``
steps and after every epoch's evaluation under ``<out>/<task>/<label>/checkpoints``; ``--resume``
continues from the newest one exactly where the run stopped (the same batches, dropout masks and
learning rates as an uninterrupted run). A missing model directory or data file, an invalid
number or a checkpoint of other settings ends the command with one line that says what to fix.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedModel, get_linear_schedule_with_warmup

from core.config import ConfigError
from core.optim import build_first_order
from data.errors import DataUnavailableError
from reproductions.common.checkpoint import (
    load_latest_checkpoint,
    require_same_config,
    save_checkpoint,
)
from reproductions.common.cli import device_name, float_in, positive_int
from reproductions.common.launch import init_distributed, seed_everything
from reproductions.common.results import RunRecorder, earlier_results
from reproductions.common.rng import capture_rng_state, restore_rng_state
from reproductions.common.tracking import Tracker, add_wandb_argument
from reproductions.mkor.model import describe_load_error

PAPER = "mkor"


def add_finetune_arguments(parser: argparse.ArgumentParser, *, lr: float, epochs: int,
                           batch_size: int, max_seq_len: int) -> None:
    """The options every fine-tuning script takes (defaults are the task's recipe)."""
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="directory holding the task's files in the official format")
    parser.add_argument("--model", type=Path, required=True,
                        help="pre-trained model directory (save_pretrained weights and "
                             "tokenizer), e.g. runs/mkor/bert_large_phase2/mkor-s0/model")
    parser.add_argument("--label", help="name of the pre-trained model in results and W&B "
                                        "(default: the model directory's parent, e.g. mkor-s0)")
    parser.add_argument("--out", type=Path, default=Path("runs/mkor/finetune"),
                        help="output directory of results files and W&B runs")
    parser.add_argument("--lr", type=float_in(0.0, low_inclusive=False), default=lr,
                        help=f"AdamW peak learning rate (default {lr})")
    parser.add_argument("--epochs", type=positive_int, default=epochs,
                        help=f"training epochs (default {epochs})")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help=f"examples per step (default {batch_size})")
    parser.add_argument("--max-seq-len", type=positive_int, default=max_seq_len,
                        help=f"tokens per example (default {max_seq_len})")
    parser.add_argument("--warmup", type=float_in(0.0, 1.0), default=0.1,
                        help="fraction of steps with a linear warm-up (default 0.1)")
    parser.add_argument("--weight-decay", type=float_in(0.0), default=0.01,
                        help="AdamW weight decay, not on biases and LayerNorms (default 0.01)")
    parser.add_argument("--max-steps", type=positive_int,
                        help="stop after this many steps (smoke tests; default: all epochs)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=500,
                        help="steps between checkpoints; one is also taken after every epoch "
                             "and where --stop-after stops (default 500)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint of this run (same options); "
                             "without it an earlier run's checkpoints are deleted")
    parser.add_argument("--stop-after", type=positive_int,
                        help="stop after this many steps of this invocation, checkpointed "
                             "(wall-time-limited jobs; continue with --resume)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--device", type=device_name, choices=("auto", "cpu", "cuda"),
                        default="auto",
                        help="compute device (default: the GPU when there is one)")
    add_wandb_argument(parser)


def load_pretrained(path: Path, model_class: type[PreTrainedModel], *, max_seq_len: int,
                    seed: int, **options: Any) -> tuple[Any, PreTrainedModel]:
    """The tokenizer and the task model (``model_class``) of a pre-trained model directory.

    Args:
        path: The ``--model`` directory (``save_pretrained`` weights and tokenizer).
        model_class: The task's model, e.g. ``BertForSequenceClassification``.
        max_seq_len: The ``--max-seq-len`` the examples will be cut to.
        seed: Seeds the task head's fresh weights (the one part not pre-trained), so that one
            ``--seed`` gives one run.
        **options: Passed to ``model_class.from_pretrained`` (e.g. ``num_labels``).

    Raises:
        DataUnavailableError: ``path`` is not a directory, or transformers cannot read a
            tokenizer and weights from it (the message names it and where such a directory
            comes from).
        ConfigError: ``max_seq_len`` is longer than the model has positions for (its
            embedding lookup would fail mid-run).
    """
    fix = ("pass --model the model directory that python -m reproductions.mkor.bert wrote, "
           "<out>/<experiment>/<optimizer>-s<seed>/model")
    if not path.is_dir():
        raise DataUnavailableError(f"the pre-trained model directory {path}", fix)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        seed_everything(seed)
        model = model_class.from_pretrained(path, local_files_only=True, **options)
    except (OSError, ValueError) as exc:  # transformers' errors for missing or foreign files
        raise DataUnavailableError(f"a tokenizer and weights in {path} "
                                   f"({describe_load_error(exc)})", fix) from None
    limit = model.config.max_position_embeddings
    if max_seq_len > limit:
        raise ConfigError("--max-seq-len", max_seq_len,
                          f"at most {limit}, the positions this model was trained with")
    return tokenizer, model


#: What ``--resume`` requires of the checkpoint's recorded options: all the same except where the
#: files are (they move with the machine), when to stop this invocation, the checkpoint cadence
#: and the tracking mode.
RESUME_CHECK: dict[str, Any] = {
    "fix": "resume with the same options, or run without --resume (which deletes this run's "
           "checkpoints) or with another --out",
    "ignore": ("data_dir", "model", "out", "resume", "stop_after", "checkpoint_every", "wandb")}


def epoch_batches(size: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The example indices of each step of ``epoch``: a seeded permutation, the last batch short.

    A function of its arguments alone, so a resumed run draws the batches an uninterrupted one
    would have.
    """
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [order[i:i + batch_size].tolist() for i in range(0, size, batch_size)]


def fine_tune(model: nn.Module, train: Dataset, collate: Callable[[list[dict]], dict[str, Any]],
              evaluate: Callable[[nn.Module, torch.device], dict[str, float]],
              args: argparse.Namespace, task: str) -> dict[str, Any]:
    """Fine-tune ``model`` on ``train`` and evaluate after each epoch, checkpointing as it goes.

    Args:
        model: The task model (already holding the pre-trained weights).
        train: Tokenised training features (the model's keyword inputs and labels).
        collate: Turns a list of features into a batch of tensors.
        evaluate: Scores the model on the task's dev set, e.g. ``{"accuracy": 0.8}``.
        args: The parsed :func:`add_finetune_arguments` options.
        task: The task's name (results experiment and W&B group).

    Returns:
        The results data (also written to ``<out>/<task>/<label>/results.json``; after
        ``--stop-after``, the part trained so far, unfinished).

    Raises:
        ConfigError: more than one process (fine-tuning runs in one).
        CheckpointError: ``--resume`` found checkpoints of other options, or none readable.
    """
    ctx = init_distributed(args.device)
    if ctx.world_size > 1:
        raise ConfigError("WORLD_SIZE", ctx.world_size,
                          "1: fine-tuning runs in one process; start it with python, not "
                          "torchrun with several processes")
    label = args.label or args.model.resolve().parent.name
    here = args.out / task / label
    ckpt_dir, results_path = here / "checkpoints", here / "results.json"
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    done = earlier_results(results_path) if args.resume else None
    if done is not None:
        require_same_config(done["config"], config, here, **RESUME_CHECK)
        if done["finished"]:
            return done
    if not args.resume:
        # A fresh run: an earlier run's checkpoints would outrank its own, and its results,
        # until this run's first checkpoint, would be taken for this run's by --resume.
        if ckpt_dir.exists():
            shutil.rmtree(ckpt_dir)
        results_path.unlink(missing_ok=True)

    seed_everything(args.seed)
    model.to(ctx.device)
    optimizer = build_first_order("adamw", model, lr=args.lr, weight_decay=args.weight_decay,
                                  momentum=0.0, betas=(0.9, 0.999))
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    scheduler = get_linear_schedule_with_warmup(optimizer, round(args.warmup * total), total)
    recorder = RunRecorder(paper=PAPER, experiment=task, optimizer=label, config=config,
                           device=ctx.device)
    start, wandb_id = 0, None
    state = load_latest_checkpoint(ckpt_dir, map_location=ctx.device) if args.resume else None
    if state is not None:
        require_same_config(state["results"]["config"], config, ckpt_dir, **RESUME_CHECK)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        restore_rng_state(state["rng"])
        recorder = RunRecorder.from_data(state["results"], config)
        start, wandb_id = state["step"], state["wandb_id"]
        tqdm.write(f"{task} {label}: resuming from the checkpoint of step {start}",
                   file=sys.stderr)
    tracker = Tracker(paper=PAPER, experiment=task, optimizer=label, seed=args.seed,
                      config=recorder.data["config"], directory=args.out / task, mode=args.wandb,
                      run_id=wandb_id)
    recorder.update(wandb=tracker.info())

    def checkpoint(step: int) -> None:
        """The checkpoint after ``step`` steps, and the results file so far."""
        recorder.write(results_path)
        save_checkpoint(ckpt_dir, step, {
            "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "rng": capture_rng_state(),
            "results": recorder.data, "wandb_id": tracker.id})

    end = total if args.stop_after is None else min(total, start + args.stop_after)
    progress = tqdm(range(start, end), initial=start, total=total, desc=f"{task} {label}",
                    file=sys.stdout, dynamic_ncols=True)
    model.train()
    order: tuple[int, list[list[int]]] = (-1, [])  # the epoch whose batches are drawn
    for step in progress:
        epoch, position = divmod(step, steps_per_epoch)
        if order[0] != epoch:
            order = (epoch, epoch_batches(len(train), args.batch_size, args.seed, epoch))
        batch = collate(train.select(order[1][position]).to_list())
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        loss = model(**{k: v.to(ctx.device) for k, v in batch.items()}).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        recorder.log_step(step, loss=loss.item(), time_s=time.perf_counter() - t0, lr=lr)
        tracker.log({"train/loss": loss.item(), "train/lr": lr}, step=step)
        progress.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
        if done % steps_per_epoch == 0 or done == total:
            model.eval()
            with torch.no_grad():
                scores = evaluate(model, ctx.device)
            model.train()
            recorder.log_eval(step, **scores)
            tracker.log({f"eval/{k}": v for k, v in scores.items()}, step=step)
            if done == total:
                recorder.update(summary={"steps": done, **scores})
                recorder.finish()
                tracker.summary(scores)
        if done % args.checkpoint_every == 0 or done % steps_per_epoch == 0 or done == end:
            checkpoint(done)
    if start == end:  # resumed at its last checkpoint, its results file lost
        recorder.write(results_path)
    progress.close()
    tracker.finish()
    if recorder.data["finished"]:
        print(f"{task} ({label}): " + ", ".join(
            f"{k} {v:.4f}" for k, v in recorder.data["summary"].items() if k != "steps"))
    else:
        print(f"{task} ({label}): stopped after step {end}; continue with --resume")
    return recorder.data
