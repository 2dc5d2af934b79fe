"""GLUE fine-tuning of a pre-trained model (the paper's Tables 3-4).

Run with ``python -m reproductions.mkor.glue``, e.g.:

    python -m reproductions.mkor.glue --task rte --data-dir glue_data \\
        --model runs/mkor/bert_large_phase2/mkor-s0/model

``--data-dir`` holds the official GLUE folders as ``download_glue_data.py`` writes them
(``CoLA/``, ``SST-2/``, ``MRPC/``, ``QQP/``, ``STS-B/``, ``MNLI/``, ``QNLI/``, ``RTE/``, each with
``train.tsv`` and ``dev.tsv``; MNLI's dev set is ``dev_matched.tsv``). Each task is scored with
the metric of the paper's Table 4 on its dev set. No GLUE data is available offline: this
script is tested on tiny files in the official format only.
"""

from __future__ import annotations

import argparse
import csv
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import BertForSequenceClassification, DataCollatorWithPadding

from data.errors import CorruptDataError, DataUnavailableError
from reproductions.common.cli import exit_on_user_error, writable_directory
from reproductions.mkor.finetune import add_finetune_arguments, fine_tune, load_pretrained


@dataclass(frozen=True)
class GlueTask:
    """Where a task's text and label are in its TSV files, and how it is scored.

    Attributes:
        folder: The task's folder in the GLUE data directory.
        text: Column names (or indices, for header-less files) of the one or two sentences.
        label: Column name or index of the label.
        labels: The label values in class order; None for regression (STS-B).
        metric: ``accuracy``, ``f1``, ``mcc`` or ``pearson``.
        header: Whether the TSV files start with a header row (CoLA's do not).
        dev_file: The dev set's file name.
    """

    folder: str
    text: tuple[str | int, ...]
    label: str | int
    labels: tuple[str, ...] | None
    metric: str
    header: bool = True
    dev_file: str = "dev.tsv"


TASKS = {
    "mnli": GlueTask("MNLI", ("sentence1", "sentence2"), "gold_label",
                     ("contradiction", "entailment", "neutral"), "accuracy",
                     dev_file="dev_matched.tsv"),
    "qqp": GlueTask("QQP", ("question1", "question2"), "is_duplicate", ("0", "1"), "f1"),
    "qnli": GlueTask("QNLI", ("question", "sentence"), "label",
                     ("entailment", "not_entailment"), "accuracy"),
    "sst2": GlueTask("SST-2", ("sentence",), "label", ("0", "1"), "accuracy"),
    "cola": GlueTask("CoLA", (3,), 1, ("0", "1"), "mcc", header=False),
    "stsb": GlueTask("STS-B", ("sentence1", "sentence2"), "score", None, "pearson"),
    "mrpc": GlueTask("MRPC", ("#1 String", "#2 String"), "Quality", ("0", "1"), "f1"),
    "rte": GlueTask("RTE", ("sentence1", "sentence2"), "label",
                    ("entailment", "not_entailment"), "accuracy"),
}
"""The eight tasks of the paper's Table 4 (WNLI is not in it)."""


def read_split(path: Path, task: GlueTask) -> dict[str, list[Any]]:
    """Sentences and labels of one GLUE TSV file.

    GLUE's files contain unescaped quotes, so they are read with quoting off; a leading
    byte-order mark (MRPC's files have one) is dropped, and rows with too few columns (QQP's
    training file has some) are skipped with a warning that counts them, as the task's
    reference loaders do.

    Raises:
        DataUnavailableError: the file is missing (the message names it).
        CorruptDataError: the file is not UTF-8, a named column is missing, a label is not one
            of the task's (or an STS-B score not a number), or the file holds no examples.
    """
    fix = (f"--data-dir must hold the official GLUE folders ({task.folder}/train.tsv, "
           f"{task.folder}/{task.dev_file}) as download_glue_data.py writes them")
    if not path.is_file():
        raise DataUnavailableError(str(path), fix)
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    except UnicodeDecodeError as exc:
        raise CorruptDataError(path, f"not UTF-8 text ({exc})", fix) from None
    header, body = (rows[0], rows[1:]) if task.header else ([], rows)

    def index(column: str | int) -> int:
        if isinstance(column, int):
            return column
        if column not in header:
            raise CorruptDataError(path, f"no column {column!r} (header: {header})", fix)
        return header.index(column)

    text = [index(c) for c in task.text]
    label = index(task.label)
    out: dict[str, list[Any]] = {"text_a": [], "text_b": [], "label": []}
    width = max(label, *text) + 1
    short = []
    for number, row in enumerate(body, start=2 if task.header else 1):
        if len(row) < width:
            short.append(number)
            continue
        value = row[label]
        if task.labels is None:
            try:
                out["label"].append(float(value))
            except ValueError:
                raise CorruptDataError(f"{path}:{number}", f"score {value!r} is not a number",
                                       fix) from None
        elif value in task.labels:
            out["label"].append(task.labels.index(value))
        else:
            raise CorruptDataError(f"{path}:{number}",
                                   f"label {value!r} is not one of {task.labels}", fix)
        out["text_a"].append(row[text[0]])
        out["text_b"].append(row[text[1]] if len(text) > 1 else None)
    if short:
        warnings.warn(f"{path}: skipped {len(short)} rows with fewer than {width} columns "
                      f"(lines {short[:5]}{' ...' if len(short) > 5 else ''})", stacklevel=2)
    if not out["label"]:
        raise CorruptDataError(path, "no examples", fix)
    return out


def score(metric: str, predictions: list[float], labels: list[float]) -> float:
    """The task metric: accuracy, binary F1 (class 1), Matthews correlation or Pearson r."""
    pairs = list(zip(predictions, labels, strict=True))
    if metric == "accuracy":
        return sum(p == y for p, y in pairs) / len(pairs)
    if metric == "pearson":
        return float(torch.corrcoef(torch.tensor([predictions, labels]))[0, 1])
    tp = sum(p == 1 and y == 1 for p, y in pairs)
    fp = sum(p == 1 and y == 0 for p, y in pairs)
    fn = sum(p == 0 and y == 1 for p, y in pairs)
    tn = len(pairs) - tp - fp - fn
    if metric == "f1":
        return 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    if metric == "mcc":
        denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
        return (tp * tn - fp * fn) / denominator if denominator else 0.0
    raise ValueError(f"unknown metric {metric!r}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Fine-tune on one task and score its dev set; returns the results data.

    An invalid number exits with status 2, a missing or unreadable model directory or data file
    with status 1, each with one line naming the fix (no traceback).
    """
    parser = argparse.ArgumentParser(prog="python -m reproductions.mkor.glue",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), required=True, help="the GLUE task")
    add_finetune_arguments(parser, lr=2e-5, epochs=3, batch_size=32, max_seq_len=128)
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        writable_directory(args.out, "--out")
        return _fine_tune_task(TASKS[args.task], args)


def _fine_tune_task(task: GlueTask, args: argparse.Namespace) -> dict[str, Any]:
    """The body of :func:`main`: the model, the features of both splits, fine-tuning."""
    tokenizer, model = load_pretrained(args.model, BertForSequenceClassification,
                                       max_seq_len=args.max_seq_len, seed=args.seed,
                                       num_labels=len(task.labels) if task.labels else 1)

    def features(split: str) -> Dataset:
        data = read_split(args.data_dir / task.folder / split, task)
        pairs = data["text_b"] if len(task.text) > 1 else None
        encoded = tokenizer(data["text_a"], pairs, truncation=True, max_length=args.max_seq_len)
        return Dataset.from_dict({**encoded, "labels": data["label"]})

    train, dev = features("train.tsv"), features(task.dev_file)
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

    def evaluate(model: nn.Module, device: torch.device) -> dict[str, float]:
        predictions: list[float] = []
        for start in range(0, len(dev), args.batch_size):
            batch = collate(dev.select(range(start, min(start + args.batch_size, len(dev))))
                            .remove_columns("labels").to_list())
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
            predictions += (logits.squeeze(-1) if task.labels is None
                            else logits.argmax(-1)).tolist()
        return {task.metric: score(task.metric, predictions, dev["labels"])}

    return fine_tune(model, train, collate, evaluate, args, task=f"glue-{args.task}")


if __name__ == "__main__":
    main()
