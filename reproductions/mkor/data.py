"""BERT pre-training data: corpus -> WordPiece tokens -> sentence pairs -> masked batches.

The corpus is the built-in English text of :mod:`data.text_corpus`, local text/parquet/json files,
or a Hugging Face dataset (when online), loaded with ``datasets``. Examples follow BERT's
pre-training format ``[CLS] A [SEP] B [SEP]`` with a next-sentence label: the token stream is cut
into segments of ``(seq_len - 3) // 2`` tokens and consecutive segments are paired; half of the
pairs (chosen at random) get a segment from elsewhere as ``B`` (label 1, "not next"). Tokenising
and pairing are ``Dataset.map`` calls, cached by ``datasets``. Masking is transformers'
``DataCollatorForLanguageModeling``.

Every batch is a pure function of ``(seed, step, micro-batch, rank)``: the example order is a
seeded permutation per epoch and the collator's masking generator is seeded per batch. So each
optimizer sees identical batches, and a resumed run sees the batches it would have seen.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, PreTrainedTokenizerBase

from core.config import ConfigError
from data.errors import CorruptDataError, DataUnavailableError
from data.paths import data_root
from data.text_corpus import bert_tokenizer, english_corpus, wordpiece_vocab

LOCAL_FORMATS = {".txt": "text", ".text": "text", ".parquet": "parquet", ".json": "json",
                 ".jsonl": "json"}
"""``datasets`` loader for each local corpus file suffix."""

PAIRING_BATCH = 1000
"""Corpus lines per pairing batch; a random ``B`` segment comes from the same batch."""


@dataclass(frozen=True)
class Corpus:
    """A loaded corpus.

    Attributes:
        texts: One column, ``text``.
        text_file: The single local text file it came from (a WordPiece vocabulary can be
            trained on it), or None.
        description: Where it came from, for logs and results.
    """

    texts: Dataset
    text_file: Path | None
    description: str


def _cache_dir(data_dir: str | Path | None) -> str:
    return str(data_root(data_dir) / "hf-datasets")


def load_corpus(sources: Sequence[str], *, text_column: str = "text",
                data_dir: str | Path | None = None) -> Corpus:
    """Load the pre-training corpus.

    Args:
        sources: ``["builtin"]``; or local files of one format (.txt, .parquet, .json, .jsonl);
            or one Hugging Face dataset ``name`` or ``name:config`` (its ``train`` split).
        text_column: Column holding the text in parquet/json/Hub data.
        data_dir: Cache directory override (see :func:`data.paths.data_root`). A Hub dataset
            is cached where ``datasets`` caches it (``HF_HOME``), so that one downloaded
            there before (e.g. on a machine with network) is found offline.

    Returns:
        The corpus with one ``text`` column (empty lines dropped).

    Raises:
        DataUnavailableError: the built-in corpus cannot be built, or a Hub dataset cannot be
            reached (offline); the message says how to fix it.
        ConfigError: mixed local formats, an unknown suffix, a folder (the files in it are
            meant) or a missing text column.
    """
    if list(sources) == ["builtin"]:
        path = english_corpus(data_dir)
        return Corpus(_load_local([path], "text", "text", data_dir), path,
                      f"built-in English corpus ({path.name})")
    paths = [Path(s).expanduser() for s in sources]
    if all(p.is_file() for p in paths):
        kinds = {LOCAL_FORMATS.get(p.suffix.lower()) for p in paths}
        if None in kinds or len(kinds) != 1:
            raise ConfigError("corpus", list(sources), "local files of one format: "
                              + ", ".join(LOCAL_FORMATS))
        kind = kinds.pop()
        texts = _load_local(paths, kind, text_column, data_dir)
        single = paths[0] if kind == "text" and len(paths) == 1 else None
        return Corpus(texts, single, f"{len(paths)} local {kind} file(s)")
    folders = [s for s, p in zip(sources, paths, strict=True) if p.is_dir()]
    if folders:
        raise ConfigError("corpus", list(sources), f"files, not folders ({folders}): pass the "
                          "files in them (e.g. DIR/*.parquet); a folder written by "
                          "Dataset.save_to_disk: datasets.load_from_disk(DIR).to_parquet(FILE) "
                          "first")
    missing = [s for s, p in zip(sources, paths, strict=True) if not p.exists()]
    if len(sources) != 1 or any(p.exists() for p in paths) or _looks_like_a_path(sources[0]):
        raise ConfigError("corpus", list(sources), f"existing files (missing: {missing}) or "
                          "one Hugging Face dataset name")
    name, _, subset = sources[0].partition(":")
    try:
        texts = load_dataset(name, subset or None, split="train")
    except (ConnectionError, FileNotFoundError, OSError, ValueError) as exc:
        raise DataUnavailableError(
            f"Hugging Face dataset {sources[0]!r} ({type(exc).__name__}: {exc})",
            "go online (unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE), fill the Hugging Face cache, "
            "or pass local files with --corpus") from None
    return Corpus(_text_only(texts, text_column), None, f"Hugging Face dataset {sources[0]}")


def _looks_like_a_path(source: str) -> bool:
    """Whether a missing ``--corpus`` source was meant as a local file (a known suffix, a
    directory part, or a leading ``.`` or ``~``) rather than a Hugging Face dataset name."""
    path = Path(source)
    return (path.suffix.lower() in LOCAL_FORMATS or source.startswith((".", "~", "/"))
            or len(path.parts) > 2)


def _load_local(paths: list[Path], kind: str, text_column: str,
                data_dir: str | Path | None) -> Dataset:
    """The non-empty texts of local files.

    Raises:
        CorruptDataError: a file is empty.
        DataUnavailableError: the files cannot be read (not UTF-8, malformed) or hold no text.
    """
    fix = ("pass UTF-8 files with text (one paragraph per line for .txt) to --corpus, or "
           "--corpus builtin")
    for path in paths:
        if path.stat().st_size == 0:
            raise CorruptDataError(path, "is empty", fix)
    names = ", ".join(map(str, paths))
    try:
        texts = load_dataset(kind, data_files=[str(p) for p in paths], split="train",
                             cache_dir=_cache_dir(data_dir))
    except DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise DataUnavailableError(f"readable {kind} data in {names} ({type(cause).__name__}: "
                                   f"{reason})", fix) from None
    texts = _text_only(texts, "text" if kind == "text" else text_column)
    if len(texts) == 0:
        raise DataUnavailableError(f"text in {names}", fix)
    return texts


def _text_only(texts: Dataset, column: str) -> Dataset:
    if column not in texts.column_names:
        raise ConfigError("text_column", column, "one of " + ", ".join(texts.column_names))
    texts = texts.select_columns([column])
    if column != "text":
        texts = texts.rename_column(column, "text")
    return texts.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]],
                        batched=True, desc="dropping empty lines")


def load_tokenizer(spec: str, corpus: Corpus, *, vocab_size: int, max_length: int,
                   data_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer: a WordPiece vocabulary trained on the corpus, a local one, or the Hub's.

    Args:
        spec: ``"wordpiece"``, a directory holding ``vocab.txt`` or a saved tokenizer (e.g. a
            model directory written by the entry point), or a Hub tokenizer name.
        corpus: The corpus (``"wordpiece"`` trains on its ``text_file``; cached).
        vocab_size: Size of a trained WordPiece vocabulary.
        max_length: The model's longest sequence.
        data_dir: Cache directory override.

    Raises:
        ConfigError: ``"wordpiece"`` for a corpus that is not one text file.
        DataUnavailableError: a Hub tokenizer cannot be reached, or a directory holds no
            tokenizer that loads.
    """
    if spec == "wordpiece":
        if corpus.text_file is None:
            raise ConfigError("tokenizer", spec, "a directory with vocab.txt or a Hub name "
                              f"(a vocabulary is trained only on one text file, not on "
                              f"{corpus.description})")
        return bert_tokenizer(wordpiece_vocab(corpus.text_file, vocab_size, data_dir),
                              model_max_length=max_length)
    local = Path(spec).expanduser()
    if (local / "vocab.txt").is_file():
        return bert_tokenizer(local, model_max_length=max_length)
    try:
        return AutoTokenizer.from_pretrained(spec, model_max_length=max_length,
                                             local_files_only=local.is_dir())
    except (OSError, ValueError) as exc:  # ValueError: a folder without a tokenizer's files
        where = "in the folder" if local.is_dir() else "from the Hugging Face Hub"
        reason = " ".join(str(exc).split())  # transformers' messages span lines
        raise DataUnavailableError(f"tokenizer {spec!r} {where} ({reason})",
                                   "go online, or pass --tokenizer DIR (a folder with "
                                   "vocab.txt) or --tokenizer wordpiece") from None


def _tokenize(batch: dict[str, list], tokenizer: PreTrainedTokenizerBase) -> dict[str, list]:
    return {"ids": tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]}


def _pair_segments(batch: dict[str, list], indices: list[int], *, segment: int, cls_id: int,
                   sep_id: int, seed: int) -> dict[str, list]:
    """Cut one batch of tokenised lines into segments and emit ``[CLS] A [SEP] B [SEP]`` pairs.
    """
    stream = list(itertools.chain.from_iterable(batch["ids"]))
    chunks = [stream[i:i + segment] for i in range(0, len(stream) - segment + 1, segment)]
    rng = np.random.default_rng([seed, indices[0]])
    out: dict[str, list] = {"input_ids": [], "token_type_ids": [], "next_sentence_label": []}
    for k in range(0, len(chunks) - 1, 2):
        if len(chunks) >= 4 and rng.random() < 0.5:
            j = int(rng.integers(len(chunks) - 2))
            b, label = chunks[j + 2 if j >= k else j], 1
        else:
            b, label = chunks[k + 1], 0
        a = chunks[k]
        out["input_ids"].append([cls_id, *a, sep_id, *b, sep_id])
        out["token_type_ids"].append([0] * (len(a) + 2) + [1] * (len(b) + 1))
        out["next_sentence_label"].append(label)
    return out


SPLIT_CHUNKS = 20
"""At least this many contiguous runs of corpus lines are what the held-out split draws from."""

SPLIT_RUN = 100
"""At most this many corpus lines per held-out run: several runs from across the corpus (its
genres) rather than one block of it."""


def held_out_lines(lines: int, *, eval_fraction: float, seed: int) -> np.ndarray:
    """Which corpus lines are held out: whole contiguous runs of lines (at most
    :data:`SPLIT_RUN` each, at least :data:`SPLIT_CHUNKS` of them), drawn at random by ``seed``
    until ``eval_fraction`` of the lines (at least one run) are held out.

    The split is of text, before any pairing: no segment, and no random ``B`` segment, of a
    training example comes from a held-out line, and it does not depend on ``seq_len`` (the
    warm start's shorter examples hold out the same lines).

    Returns:
        A boolean mask over the lines, True where held out.
    """
    size = max(1, min(SPLIT_RUN, lines // SPLIT_CHUNKS))
    chunks = math.ceil(lines / size)
    wanted = max(1, round(eval_fraction * lines))
    mask = np.zeros(lines, dtype=bool)
    held = 0
    for chunk in np.random.default_rng(seed).permutation(chunks):
        run = slice(chunk * size, min((chunk + 1) * size, lines))
        mask[run] = True
        held += run.stop - run.start
        if held >= wanted:
            break
    return mask


def _pairs(texts: Dataset, tokenizer: PreTrainedTokenizerBase, *, seq_len: int, seed: int,
           part: str) -> Dataset:
    """Tokenised sentence pairs of some corpus lines (see :func:`_pair_segments`)."""
    tokens = texts.map(_tokenize, batched=True, remove_columns=["text"],
                       fn_kwargs={"tokenizer": tokenizer}, desc=f"tokenising ({part})")
    return tokens.map(
        _pair_segments, batched=True, batch_size=PAIRING_BATCH, with_indices=True,
        remove_columns=["ids"], desc=f"pairing segments for seq_len {seq_len} ({part})",
        fn_kwargs={"segment": (seq_len - 3) // 2, "cls_id": tokenizer.cls_token_id,
                   "sep_id": tokenizer.sep_token_id, "seed": seed})


def pretraining_examples(corpus: Corpus, tokenizer: PreTrainedTokenizerBase, *, seq_len: int,
                         seed: int, eval_fraction: float) -> tuple[Dataset, Dataset]:
    """Tokenise the corpus and build the train and held-out sentence-pair examples.

    The corpus lines are split first (:func:`held_out_lines`) and each part is paired on its
    own, so the held-out examples share no text with the training examples.

    Args:
        corpus: The corpus.
        tokenizer: A BERT tokenizer (``[CLS]``, ``[SEP]``, ``[MASK]``).
        seq_len: Tokens per example including the three special tokens.
        seed: Seed of the random ``B`` segments and of the train/held-out split.
        eval_fraction: Fraction of the corpus lines held out (at least one run of lines).

    Returns:
        ``(train, held_out)`` with ``input_ids``, ``token_type_ids``, ``next_sentence_label``.

    Raises:
        DataUnavailableError: the corpus is too small for a line, or an example, on each side
            at this ``eval_fraction`` and ``seq_len``.
    """
    fix = ("use a larger corpus (--corpus), a shorter --seq-len, or an eval_fraction that leaves "
           "text on both sides (--set eval_fraction=F)")
    mask = held_out_lines(len(corpus.texts), eval_fraction=eval_fraction, seed=seed)
    train_lines, held_lines = np.flatnonzero(~mask), np.flatnonzero(mask)
    if len(train_lines) < 1 or len(held_lines) < 1:  # pairing no lines would fail in datasets
        raise DataUnavailableError(
            f"a line on each side of the train/held-out split ({corpus.description}: "
            f"{len(train_lines)} training and {len(held_lines)} held-out line(s) at "
            f"eval_fraction {eval_fraction})", fix)
    train = _pairs(corpus.texts.select(train_lines), tokenizer, seq_len=seq_len, seed=seed,
                   part="train")
    held_out = _pairs(corpus.texts.select(held_lines), tokenizer, seq_len=seq_len, seed=seed,
                      part="held out")
    if len(train) < 1 or len(held_out) < 1:
        raise DataUnavailableError(
            f"an example on each side of the train/held-out split ({corpus.description}: "
            f"{len(train)} training and {len(held_out)} held-out example(s) at seq_len "
            f"{seq_len})", fix)
    return train, held_out


def _mask_seed(*keys: int) -> int:
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])


def mlm_collator(tokenizer: PreTrainedTokenizerBase,
                 mlm_probability: float) -> DataCollatorForLanguageModeling:
    """transformers' MLM collator: masks ``mlm_probability`` of the non-special tokens (80%
    ``[MASK]``, 10% random, 10% kept) and pads to a multiple of 8."""
    return DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability,
                                           pad_to_multiple_of=8)


def collate(collator: DataCollatorForLanguageModeling, examples: Dataset,
            indices: Sequence[int], mask_seed: int) -> dict[str, torch.Tensor]:
    """One masked batch of the given examples, its masks drawn from ``mask_seed``.

    The collator draws from torch's global CPU generator; it is seeded inside ``fork_rng`` so
    that the stream everything else draws from (dropout) is left exactly as it was. (The
    collator's own ``seed`` option refuses to run in processes started by multiprocessing.)
    """
    rows = examples[list(indices)]
    features = [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(),
                                                                         strict=True)]
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(mask_seed)
        return dict(collator(features))


class PretrainingBatches:
    """The training batches of a run, each a pure function of the seed and its position.

    Step ``s`` consumes the next ``micro_batch * accumulation * world_size`` examples of a
    per-epoch seeded permutation; process ``rank`` takes its slice of each micro-batch.

    Args:
        examples: Training examples from :func:`pretraining_examples`.
        tokenizer: The tokenizer (for masking and padding).
        micro_batch: Examples per process per forward pass.
        accumulation: Micro-batches per step.
        world_size: Processes.
        rank: This process.
        seed: Seed of the order and of the masks.
        mlm_probability: Fraction of tokens masked.
    """

    def __init__(self, examples: Dataset, tokenizer: PreTrainedTokenizerBase, *,
                 micro_batch: int, accumulation: int, world_size: int, rank: int, seed: int,
                 mlm_probability: float) -> None:
        self.examples = examples
        self.collator = mlm_collator(tokenizer, mlm_probability)
        self.micro_batch = micro_batch
        self.accumulation = accumulation
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self._epoch: tuple[int, np.ndarray] | None = None

    def _example(self, k: int) -> int:
        epoch, position = divmod(k, len(self.examples))
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.seed, epoch]).permutation(
                len(self.examples)))
        return int(self._epoch[1][position])

    def indices(self, step: int, micro: int = 0) -> list[int]:
        """Example indices of micro-batch ``micro`` of ``step`` on this process."""
        per_step = self.micro_batch * self.accumulation * self.world_size
        start = step * per_step + (micro * self.world_size + self.rank) * self.micro_batch
        return [self._example(k) for k in range(start, start + self.micro_batch)]

    def batch(self, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
        """The masked micro-batch ``micro`` of ``step`` for this process."""
        return collate(self.collator, self.examples, self.indices(step, micro),
                       _mask_seed(self.seed, step, micro, self.rank))


def held_out_batches(examples: Dataset, tokenizer: PreTrainedTokenizerBase, *, batch_size: int,
                     count: int, seed: int, mlm_probability: float
                     ) -> list[dict[str, torch.Tensor]]:
    """Up to ``count`` fixed evaluation batches (the same masks for every optimizer)."""
    collator = mlm_collator(tokenizer, mlm_probability)
    batches = []
    for b in range(count):
        indices = range(b * batch_size, min((b + 1) * batch_size, len(examples)))
        if not indices:
            break
        batches.append(collate(collator, examples, indices, _mask_seed(seed, b)))
    return batches


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move a batch's tensors to ``device``."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
