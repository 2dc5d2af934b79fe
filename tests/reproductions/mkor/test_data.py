"""Pre-training data: corpus formats, sentence pairs, deterministic sharded masked batches."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch

from core.config import ConfigError
from data.errors import DataUnavailableError
from reproductions.mkor import data
from tests.reproductions.mkor.conftest import english_like_lines


@pytest.fixture(scope="module")
def prepared(corpus_file: Path, data_dir: Path):
    corpus = data.load_corpus([str(corpus_file)], data_dir=data_dir)
    tokenizer = data.load_tokenizer("wordpiece", corpus, vocab_size=200, max_length=32,
                                    data_dir=data_dir)
    train, held_out = data.pretraining_examples(corpus, tokenizer, seq_len=32, seed=0,
                                                eval_fraction=0.1)
    return tokenizer, train, held_out


def test_examples_are_bert_sentence_pairs(prepared) -> None:
    tokenizer, train, held_out = prepared
    assert len(held_out) >= 1 and len(train) > 20
    segment = (32 - 3) // 2
    for example in train.select(range(10)):
        ids, types = example["input_ids"], example["token_type_ids"]
        assert len(ids) == len(types) == 2 * segment + 3
        assert ids[0] == tokenizer.cls_token_id
        assert [i for i, t in enumerate(ids) if t == tokenizer.sep_token_id] == [
            segment + 1, 2 * segment + 2]
        assert types == [0] * (segment + 2) + [1] * (segment + 1)
    assert set(train["next_sentence_label"]) == {0, 1}


def test_batches_are_deterministic_and_sharded(prepared) -> None:
    tokenizer, train, _ = prepared

    def batches(world: int, rank: int, micro: int) -> data.PretrainingBatches:
        return data.PretrainingBatches(train, tokenizer, micro_batch=micro, accumulation=2,
                                       world_size=world, rank=rank, seed=3,
                                       mlm_probability=0.15)

    one = batches(1, 0, 4)
    first, again = one.batch(5, 1), one.batch(5, 1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert set(first) == {"input_ids", "token_type_ids", "attention_mask", "labels",
                          "next_sentence_label"}
    assert (first["labels"] != -100).any()
    assert not torch.equal(first["input_ids"], one.batch(6, 1)["input_ids"])
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    one.batch(0)
    assert torch.equal(torch.rand(3), expected)  # masking leaves the global stream (dropout) alone
    # Two processes with half the micro-batch see the same examples as one process.
    ranks = [batches(2, r, 2) for r in (0, 1)]
    for step in (0, 7):
        for micro in (0, 1):
            split = ranks[0].indices(step, micro) + ranks[1].indices(step, micro)
            assert sorted(split) == sorted(one.indices(step, micro))
    epoch = [i for s in range(len(train) // 8) for m in (0, 1) for i in one.indices(s, m)]
    assert len(set(epoch)) == len(epoch)  # no example repeats within an epoch


def test_held_out_batches_are_fixed(prepared) -> None:
    tokenizer, _, held_out = prepared
    make = lambda: data.held_out_batches(held_out, tokenizer, batch_size=2, count=2,  # noqa: E731
                                         seed=0, mlm_probability=0.15)
    a, b = make(), make()
    assert len(a) == min(2, -(-len(held_out) // 2))
    assert all(torch.equal(x["labels"], y["labels"]) for x, y in zip(a, b, strict=True))


def test_local_parquet_and_json_corpora(tmp_path: Path, data_dir: Path) -> None:
    lines = english_like_lines(20)
    rows = [{"body": line, "id": i} for i, line in enumerate(lines)] + [{"body": "", "id": -1}]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    for path in (jsonl, parquet):
        corpus = data.load_corpus([str(path)], text_column="body", data_dir=data_dir)
        assert corpus.texts.column_names == ["text"] and corpus.texts["text"] == lines
        assert corpus.text_file is None
        with pytest.raises(ConfigError, match="tokenizer"):
            data.load_tokenizer("wordpiece", corpus, vocab_size=100, max_length=32)
    with pytest.raises(ConfigError, match="text_column"):
        data.load_corpus([str(jsonl)], text_column="missing", data_dir=data_dir)
    with pytest.raises(ConfigError, match="one format"):
        data.load_corpus([str(jsonl), str(parquet)], data_dir=data_dir)


def test_hub_names_need_the_network(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataUnavailableError, match="no-such-user/no-such-corpus.*--corpus"):
        data.load_corpus(["no-such-user/no-such-corpus"], data_dir=data_dir)
    with pytest.raises(ConfigError, match="missing"):
        data.load_corpus(["no-such-file.txt", "other.txt"], data_dir=data_dir)


@pytest.mark.parametrize("source", ["nope.txt", "./corpus", "~/corpus", "/data/a/corpus",
                                    "data/wiki/corpus"])
def test_a_missing_local_corpus_is_named_as_missing_not_looked_up_online(
        source: str, data_dir: Path, tmp_path: Path) -> None:
    """A mistyped file path gets the missing-file error, not advice to go online."""
    source = str(tmp_path / source[1:]) if source.startswith("/") else source
    with pytest.raises(ConfigError, match=r"existing files \(missing: \["):
        data.load_corpus([source], data_dir=data_dir)


def _contains(stream: list[int], segment: list[int]) -> bool:
    n = len(segment)
    return any(stream[i:i + n] == segment for i in range(len(stream) - n + 1))


def test_held_out_examples_share_no_text_with_training_examples(prepared, corpus_file: Path,
                                                                data_dir: Path) -> None:
    """The split was of sentence pairs, after pairing: a held-out example's segments, and the
    random B segments of training pairs, came from the same lines (45% of the default run's
    held-out examples held text it trained on). Now whole runs of lines are held out first,
    the same ones at every seq_len."""
    tokenizer, train, held_out = prepared
    corpus = data.load_corpus([str(corpus_file)], data_dir=data_dir)
    mask = data.held_out_lines(len(corpus.texts), eval_fraction=0.1, seed=0)
    assert 0.1 <= mask.mean() < 0.2 and mask.sum() % 15 == 0  # runs of 300 // 20 lines
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert all(mask[s:s + 15].all() for s in starts)
    ids = tokenizer(list(corpus.texts["text"]), add_special_tokens=False)["input_ids"]
    held_stream = [t for line, held in zip(ids, mask, strict=True) if held for t in line]
    segment = (32 - 3) // 2

    def segments(example: dict) -> list[list[int]]:
        tokens = example["input_ids"]
        return [tokens[1:1 + segment], tokens[2 + segment:2 + 2 * segment]]

    assert all(_contains(held_stream, s) for e in held_out for s in segments(e))
    assert not any(_contains(held_stream, s) for e in train for s in segments(e))
    again = data.held_out_lines(len(corpus.texts), eval_fraction=0.1, seed=0)
    assert (again == mask).all() and not (data.held_out_lines(
        len(corpus.texts), eval_fraction=0.1, seed=1) == mask).all()


@pytest.mark.parametrize(("lines", "eval_fraction", "says"), [
    (25, 0.1, r"an example on each side of the train/held-out split \(1 local text file\(s\): "
              r"\d+ training and 0 held-out example\(s\) at seq_len 32\)"),
    (1, 0.1, r"a line on each side .*: 0 training and 1 held-out line\(s\) at eval_fraction "
             r"0\.1\)"),
    (25, 0.99, r"a line on each side .*: 0 training and 25 held-out line\(s\) at eval_fraction "
               r"0\.99\)"),
])
def test_a_corpus_too_small_for_both_sides_of_the_split_is_a_data_error(
        prepared, tmp_path: Path, data_dir: Path, lines: int, eval_fraction: float,
        says: str) -> None:
    """25 short lines gave no held-out example: a ValueError traceback. One line (or every
    line held out) left no training lines, and pairing none failed inside datasets ("Column
    name ['ids'] not in the dataset"). Now each is a one-line data error naming the fix."""
    tokenizer, _, _ = prepared
    small = tmp_path / "small.txt"
    small.write_text("".join(f"fox jumps {i} over\n" for i in range(lines)), encoding="utf-8")
    corpus = data.load_corpus([str(small)], data_dir=data_dir)
    with pytest.raises(DataUnavailableError, match=says + r" is not available\. Fix: use a "
                                                          r"larger corpus \(--corpus\)"):
        data.pretraining_examples(corpus, tokenizer, seq_len=32, seed=0,
                                  eval_fraction=eval_fraction)
