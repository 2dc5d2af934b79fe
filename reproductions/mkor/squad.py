"""SQuAD v1.1 fine-tuning of a pre-trained model (the paper's Table 2).

Run with ``python -m reproductions.mkor.squad``, e.g.:

    python -m reproductions.mkor.squad --data-dir squad \\
        --model runs/mkor/bert_large_phase2/mkor-s0/model

``--data-dir`` holds the official ``train-v1.1.json`` and ``dev-v1.1.json``. The recipe is the
MKOR repository's (``run_squad_local.sh``): lr 3e-5, 2 epochs, sequence 384, document stride
128. Contexts longer than a sequence are split into overlapping windows; the answer is the
best-scoring span (at most 30 tokens) over a question's windows, scored with the official v1.1
exact-match and F1. No SQuAD data is available offline: this script is tested on tiny files in
the official format only.
"""

from __future__ import annotations

import argparse
import json
import re
import string
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import BertForQuestionAnswering, default_data_collator

from core.config import ConfigError
from data.errors import CorruptDataError, DataUnavailableError
from reproductions.common.cli import exit_on_user_error, positive_int, writable_directory
from reproductions.mkor.finetune import add_finetune_arguments, fine_tune, load_pretrained

MAX_ANSWER_TOKENS = 30

PAIR_SPECIAL_TOKENS = 3
"""The tokens BERT adds to a (question, context) pair: ``[CLS] question [SEP] context [SEP]``."""


def read_squad(path: Path) -> list[dict[str, Any]]:
    """Questions of a SQuAD v1.1 file: ``id``, ``question``, ``context``, ``answers`` (texts) and
    ``answer_start`` (character offset of the first answer).

    Raises:
        DataUnavailableError: the file is missing (the message names the expected files).
        CorruptDataError: the file is not UTF-8 SQuAD v1.1 JSON or holds no questions.
    """
    fix = "--data-dir must hold the official train-v1.1.json and dev-v1.1.json"
    if not path.is_file():
        raise DataUnavailableError(str(path), fix)
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))["data"]
        questions = [{"id": qa["id"], "question": qa["question"],
                      "context": paragraph["context"],
                      "answers": [a["text"] for a in qa["answers"]],
                      "answer_start": qa["answers"][0]["answer_start"]}
                     for article in articles for paragraph in article["paragraphs"]
                     for qa in paragraph["qas"]]
    except (KeyError, IndexError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptDataError(path, f"not SQuAD v1.1 JSON ({type(exc).__name__}: {exc})",
                               fix) from None
    if not questions:
        raise CorruptDataError(path, "no questions", fix)
    return questions


def normalize_answer(text: str) -> str:
    """The official v1.1 normalisation: lower case, no punctuation, articles or extra spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match_and_f1(prediction: str, answers: list[str]) -> tuple[float, float]:
    """The official v1.1 scores of one prediction: the best over the gold answers."""
    def f1(gold: str) -> float:
        predicted, truth = normalize_answer(prediction).split(), normalize_answer(gold).split()
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(predicted), common / len(truth)
        return 2 * precision * recall / (precision + recall)

    exact = max(float(normalize_answer(prediction) == normalize_answer(a)) for a in answers)
    return exact, max(f1(a) for a in answers)


def check_doc_stride(stride: int, max_len: int, question_tokens: int = 0) -> None:
    """Check that consecutive context windows, which share ``stride`` context tokens, each
    bring new ones: a window of ``max_len`` tokens holds the special tokens, the question and
    ``max_len - question_tokens - 3`` context tokens, more than ``stride``. (The tokenizer
    stops with an error or a Rust panic otherwise, after the model was loaded.)

    Args:
        stride: ``--doc-stride``.
        max_len: ``--max-seq-len``.
        question_tokens: The longest question's tokens (0 before the data is read).

    Raises:
        ConfigError: ``stride`` is not below that room (named as ``--doc-stride``).
    """
    room = max_len - question_tokens - PAIR_SPECIAL_TOKENS
    if stride >= room:
        beside = (f" beside the longest question ({question_tokens} tokens)" if question_tokens
                  else "")
        raise ConfigError("--doc-stride", stride,
                          f"fewer than the {room} context tokens a window of --max-seq-len "
                          f"{max_len} holds{beside}")


def windows(tokenizer: Any, questions: list[dict[str, Any]], max_len: int,
            stride: int) -> dict[str, list]:
    """Tokenised (question, context window) pairs, with each window's example index and
    offsets (None outside the context).

    Raises:
        ConfigError: ``stride`` leaves a window beside the longest question no new context
            (:func:`check_doc_stride`).
    """
    asked = tokenizer([q["question"] for q in questions], add_special_tokens=False)
    check_doc_stride(stride, max_len, max(len(ids) for ids in asked["input_ids"]))
    encoded = tokenizer([q["question"] for q in questions], [q["context"] for q in questions],
                        truncation="only_second", max_length=max_len, stride=stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True,
                        padding="max_length")
    encoded["offset_mapping"] = [
        [offset if sequence_id == 1 else None
         for offset, sequence_id in zip(offsets, encoded.sequence_ids(i), strict=True)]
        for i, offsets in enumerate(encoded["offset_mapping"])]
    return dict(encoded)


def training_features(tokenizer: Any, questions: list[dict[str, Any]], max_len: int,
                      stride: int) -> Dataset:
    """Windows labelled with the answer's token span (the [CLS] token when the answer is not
    wholly inside the window). Whitespace around an answer's text (``"Catholic "``) is left
    out of its span: no token covers it, so the answer would be inside no window."""
    encoded = windows(tokenizer, questions, max_len, stride)
    starts, ends = [], []
    for offsets, example in zip(encoded["offset_mapping"], encoded["overflow_to_sample_mapping"],
                                strict=True):
        question = questions[example]
        answer = question["answers"][0]
        first = question["answer_start"] + len(answer) - len(answer.lstrip())
        last = question["answer_start"] + len(answer.rstrip())
        inside = [i for i, o in enumerate(offsets) if o is not None and o[0] < last
                  and o[1] > first]
        whole = inside and offsets[inside[0]][0] <= first and offsets[inside[-1]][1] >= last
        starts.append(inside[0] if whole else 0)
        ends.append(inside[-1] if whole else 0)
    keep = ("input_ids", "token_type_ids", "attention_mask")
    return Dataset.from_dict({**{k: encoded[k] for k in keep}, "start_positions": starts,
                              "end_positions": ends})


def best_spans(start_logits: torch.Tensor, end_logits: torch.Tensor,
               offsets: list[list[tuple[int, int] | None]], examples: list[int],
               questions: list[dict[str, Any]]) -> dict[str, str]:
    """Each question's highest-scoring context span (start <= end, at most 30 tokens) over all
    its windows."""
    best: dict[int, tuple[float, str]] = defaultdict(lambda: (-float("inf"), ""))
    for w, example in enumerate(examples):
        scores = start_logits[w][:, None] + end_logits[w][None, :]
        length = scores.shape[0]
        allowed = torch.ones(length, length, dtype=torch.bool).triu().tril(MAX_ANSWER_TOKENS - 1)
        valid = torch.tensor([o is not None for o in offsets[w]])
        allowed &= valid[:, None] & valid[None, :]
        scores = scores.masked_fill(~allowed, -float("inf"))
        flat = int(scores.argmax())
        start, end = divmod(flat, length)
        score = float(scores[start, end])
        if score > best[example][0]:
            context = questions[example]["context"]
            best[example] = (score, context[offsets[w][start][0]:offsets[w][end][1]])
    return {questions[e]["id"]: text for e, (_, text) in best.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Fine-tune on SQuAD v1.1 train and score dev; returns the results data.

    An invalid number exits with status 2, a missing or unreadable model directory or data file
    with status 1, each with one line naming the fix (no traceback).
    """
    parser = argparse.ArgumentParser(prog="python -m reproductions.mkor.squad",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_finetune_arguments(parser, lr=3e-5, epochs=2, batch_size=32, max_seq_len=384)
    parser.add_argument("--doc-stride", type=positive_int, default=128,
                        help="tokens shared by consecutive context windows (default 128)")
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        writable_directory(args.out, "--out")
        check_doc_stride(args.doc_stride, args.max_seq_len)
        return _fine_tune_squad(args)


def _fine_tune_squad(args: argparse.Namespace) -> dict[str, Any]:
    """The body of :func:`main`: the model, the training windows and dev set, fine-tuning."""
    tokenizer, model = load_pretrained(args.model, BertForQuestionAnswering,
                                       max_seq_len=args.max_seq_len, seed=args.seed)
    train = training_features(tokenizer, read_squad(args.data_dir / "train-v1.1.json"),
                              args.max_seq_len, args.doc_stride)
    dev_questions = read_squad(args.data_dir / "dev-v1.1.json")
    dev = windows(tokenizer, dev_questions, args.max_seq_len, args.doc_stride)

    def evaluate(model: nn.Module, device: torch.device) -> dict[str, float]:
        starts, ends = [], []
        for i in range(0, len(dev["input_ids"]), args.batch_size):
            batch = {k: torch.tensor(dev[k][i:i + args.batch_size], device=device)
                     for k in ("input_ids", "token_type_ids", "attention_mask")}
            out = model(**batch)
            starts.append(out.start_logits.float().cpu())
            ends.append(out.end_logits.float().cpu())
        predictions = best_spans(torch.cat(starts), torch.cat(ends), dev["offset_mapping"],
                                 dev["overflow_to_sample_mapping"], dev_questions)
        scores = [exact_match_and_f1(predictions.get(q["id"], ""), q["answers"])
                  for q in dev_questions]
        return {"exact_match": 100 * sum(s[0] for s in scores) / len(scores),
                "f1": 100 * sum(s[1] for s in scores) / len(scores)}

    return fine_tune(model, train, default_data_collator, evaluate, args, task="squad-v1.1")


if __name__ == "__main__":
    main()
