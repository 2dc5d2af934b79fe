"""The fine-tuning loop GLUE and SQuAD share (the paper's Tables 2-4 evaluate phase-2 models so).

A pre-trained model directory (``<out>/<experiment>/<optimizer>-s<seed>/model``, written by
``reproductions.mkor.bert``: ``save_pretrained`` weights plus the tokenizer) is fine-tuned with
AdamW and a linear warm-up/decay schedule, evaluated after every epoch, and recorded like every
other run: one results file (``kfac-repro/results/v1``, experiment = the task, optimizer = the
pre-trained model's label) and a W&B run. A missing model directory or data file, or an invalid
number, ends the command with one line that says what to fix.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedModel, get_linear_schedule_with_warmup

from core.config import ConfigError
from core.optim import build_first_order
from data.errors import DataUnavailableError
from reproductions.common.cli import float_in, positive_int
from reproductions.common.launch import init_distributed, seed_everything
from reproductions.common.results import RunRecorder
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
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="compute device (default: the GPU when there is one)")
    add_wandb_argument(parser)


def load_pretrained(path: Path, model_class: type[PreTrainedModel], *, max_seq_len: int,
                    **options: Any) -> tuple[Any, PreTrainedModel]:
    """The tokenizer and the task model (``model_class``) of a pre-trained model directory.

    Args:
        path: The ``--model`` directory (``save_pretrained`` weights and tokenizer).
        model_class: The task's model, e.g. ``BertForSequenceClassification``.
        max_seq_len: The ``--max-seq-len`` the examples will be cut to.
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
        model = model_class.from_pretrained(path, local_files_only=True, **options)
    except (OSError, ValueError) as exc:  # transformers' errors for missing or foreign files
        raise DataUnavailableError(f"a tokenizer and weights in {path} "
                                   f"({describe_load_error(exc)})", fix) from None
    limit = model.config.max_position_embeddings
    if max_seq_len > limit:
        raise ConfigError("--max-seq-len", max_seq_len,
                          f"at most {limit}, the positions this model was trained with")
    return tokenizer, model


def fine_tune(model: nn.Module, train: Dataset, collate: Callable[[list[dict]], dict[str, Any]],
              evaluate: Callable[[nn.Module, torch.device], dict[str, float]],
              args: argparse.Namespace, task: str) -> dict[str, Any]:
    """Fine-tune ``model`` on ``train`` and evaluate after each epoch.

    Args:
        model: The task model (already holding the pre-trained weights).
        train: Tokenised training features (the model's keyword inputs and labels).
        collate: Turns a list of features into a batch of tensors.
        evaluate: Scores the model on the task's dev set, e.g. ``{"accuracy": 0.8}``.
        args: The parsed :func:`add_finetune_arguments` options.
        task: The task's name (results experiment and W&B group).

    Returns:
        The results data (also written to ``<out>/<task>/<label>/results.json``).
    """
    ctx = init_distributed(args.device)
    seed_everything(args.seed)
    label = args.label or args.model.resolve().parent.name
    model.to(ctx.device)
    optimizer = build_first_order("adamw", model, lr=args.lr, weight_decay=args.weight_decay,
                                  momentum=0.0, betas=(0.9, 0.999))
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                        generator=torch.Generator().manual_seed(args.seed))
    total = len(loader) * args.epochs
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    scheduler = get_linear_schedule_with_warmup(optimizer, round(args.warmup * total), total)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    recorder = RunRecorder(paper=PAPER, experiment=task, optimizer=label, config=config,
                           device=ctx.device)
    tracker = Tracker(paper=PAPER, experiment=task, optimizer=label, seed=args.seed,
                      config=config, directory=args.out / task, mode=args.wandb)
    recorder.update(wandb=tracker.info())
    progress = tqdm(total=total, desc=f"{task} {label}", file=sys.stdout, dynamic_ncols=True)
    step = 0
    model.train()
    for _ in range(args.epochs):
        for batch in loader:
            if step == total:
                break
            start = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            loss = model(**{k: v.to(ctx.device) for k, v in batch.items()}).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            recorder.log_step(step, loss=loss.item(), time_s=time.perf_counter() - start, lr=lr)
            tracker.log({"train/loss": loss.item(), "train/lr": lr}, step=step)
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}")
            step += 1
        model.eval()
        with torch.no_grad():
            scores = evaluate(model, ctx.device)
        model.train()
        recorder.log_eval(max(step - 1, 0), **scores)
        tracker.log({f"eval/{k}": v for k, v in scores.items()}, step=max(step - 1, 0))
        if step == total:
            break
    progress.close()
    recorder.update(summary={"steps": step, **scores})
    recorder.finish()
    tracker.summary(scores)
    tracker.finish()
    recorder.write(args.out / task / label / "results.json")
    print(f"{task} ({label}): " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
    return recorder.data
