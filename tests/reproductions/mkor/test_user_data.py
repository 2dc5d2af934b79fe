"""Full-size user data for BERT pre-training and SQuAD, in the shapes users have it on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import huggingface_hub
import pytest

from core.config import ConfigError
from data.errors import DataUnavailableError
from reproductions.mkor import data, squad
from tests.reproductions.mkor.conftest import english_like_lines


def test_a_hub_corpus_already_in_the_hugging_face_cache_loads_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    """data/README.md: a Hub corpus needs the network or a pre-filled Hugging Face cache
    (HF_HOME). The dataset was looked up in <data-dir>/hf-datasets only, so one downloaded
    into the Hugging Face cache (on a login node with network) was not found offline."""
    lines = english_like_lines(30)
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_dict({"id": list(range(30)), "text": lines}).to_parquet(str(parquet))
    built = tmp_path / "built"
    datasets.load_dataset("parquet", data_files=str(parquet), split="train",
                          cache_dir=str(built))
    version = next(p for p in built.glob("parquet/*/0.0.0/*") if p.is_dir())
    hf_cache = tmp_path / "hf-home" / "datasets"  # as load_dataset("someone/wiki") leaves it
    cached = hf_cache / "someone___wiki" / "default" / "0.0.0" / version.name
    shutil.copytree(version, cached)
    for arrow in cached.glob("parquet-*.arrow"):
        arrow.rename(cached / arrow.name.replace("parquet-", "wiki-", 1))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hf_cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    corpus = data.load_corpus(["someone/wiki"], data_dir=data_dir)
    assert corpus.texts["text"] == lines


def test_a_folder_as_corpus_is_named_as_a_folder(tmp_path: Path, data_dir: Path) -> None:
    """A Dataset.save_to_disk folder (or a folder of text files) exists: the error said
    "existing files (missing: [])"."""
    saved = tmp_path / "wiki-saved"
    datasets.Dataset.from_dict({"text": english_like_lines(5)}).save_to_disk(str(saved))
    with pytest.raises(ConfigError, match=r"files, not folders \(\[.*wiki-saved'\]\).*"
                                          r"load_from_disk"):
        data.load_corpus([str(saved)], data_dir=data_dir)


def test_a_squad_answer_with_surrounding_whitespace_is_labelled_not_dropped(
        corpus_file: Path, data_dir: Path) -> None:
    """SQuAD answers may carry a space the context has after them ("Catholic "): no token
    covers it, so the answer was whole in no window and every window of the question was
    labelled [CLS], silently training it as unanswerable."""
    corpus = data.load_corpus([str(corpus_file)], data_dir=data_dir)
    tokenizer = data.load_tokenizer("wordpiece", corpus, vocab_size=200, max_length=64,
                                    data_dir=data_dir)
    context = "The model learns the small vector. The layer keeps every token."
    questions = [{"id": f"q{i}", "question": "What does the model learn?", "context": context,
                  "answers": [answer], "answer_start": start}
                 for i, (answer, start) in enumerate([
                     ("small vector", 21), ("small vector. ", 21), (" small vector", 20)])]
    assert all(context[q["answer_start"]:].startswith(q["answers"][0]) for q in questions)
    features = squad.training_features(tokenizer, questions, 64, 16)
    encoded = squad.windows(tokenizer, questions, 64, 16)
    spans = {}
    for i, example in enumerate(encoded["overflow_to_sample_mapping"]):
        start, end = features[i]["start_positions"], features[i]["end_positions"]
        if start:
            offsets = encoded["offset_mapping"][i]
            spans[example] = context[offsets[start][0]:offsets[end][1]]
    assert spans == {0: "small vector", 1: "small vector.", 2: "small vector"}


def test_a_cased_tokenizer_directory_is_not_lowercased(tmp_path: Path) -> None:
    """--tokenizer DIR of a cased model (vocab.txt, tokenizer_config.json with do_lower_case
    false, as a downloaded bert-base-cased has them) was lowercased: its capitalised words
    became other tokens. A bare vocab.txt (the trained WordPiece) stays lowercase."""
    vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nThe\nthe\nModel\nmodel\n.\n"
    cased, bare = tmp_path / "cased", tmp_path / "bare"
    for folder in (cased, bare):
        folder.mkdir()
        (folder / "vocab.txt").write_text(vocab, encoding="utf-8")
    (cased / "tokenizer_config.json").write_text('{"do_lower_case": false}', encoding="utf-8")
    tokenize = lambda folder: data.load_tokenizer(  # noqa: E731
        str(folder), None, vocab_size=10, max_length=16).tokenize("The Model.")
    assert tokenize(cased) == ["The", "Model", "."]
    assert tokenize(bare) == ["the", "model", "."]


def test_an_empty_tokenizer_folder_is_named_in_one_line(tmp_path: Path) -> None:
    """--tokenizer DIR of an existing folder without tokenizer files ended in transformers'
    ValueError traceback ("Couldn't instantiate the backend tokenizer"), not the one-line
    error a missing tokenizer gets."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    with pytest.raises(DataUnavailableError) as info:
        data.load_tokenizer(str(folder), None, vocab_size=10, max_length=16)
    message = str(info.value)
    assert f"tokenizer '{folder}' in the folder (" in message and "\n" not in message
    assert message.endswith("Fix: go online, or pass --tokenizer DIR (a folder with vocab.txt) "
                            "or --tokenizer wordpiece")
