"""English corpus building, WordPiece vocabulary training and tokenizer loading."""

from __future__ import annotations

from pathlib import Path

import pytest

import data.text_corpus as tc
from data.errors import DataUnavailableError

BIBLE_LINES = [
    "Ge1:1 In the beginning God created the heaven and the earth.",
    "1Sam1:1 Now there was a certain man of Ramathaimzophim, of mount Ephraim.",
    "Joh11:35 Jesus wept.",
]


@pytest.fixture
def fake_docs(tmp_path: Path) -> Path:
    """A two-file reST tree: headings, a comment, a directive, a code block and prose."""
    docs = tmp_path / "_sources"
    (docs / "tutorial").mkdir(parents=True)
    (docs / "tutorial" / "intro.rst.txt").write_text(
        ".. _tut-intro:\n\n*****\nIntro\n*****\n\n"
        "Python is an easy to learn, powerful\nprogramming language.\n\n"
        ".. note::\n\n   The interpreter is easily extended with new functions.\n\n"
        ".. a comment that spans\n   two lines of explicit markup\n",
        encoding="utf-8",
    )
    (docs / "about.rst.txt").write_text(
        "About\n=====\n\nThese documents are generated from reStructuredText sources.\n",
        encoding="utf-8",
    )
    return docs


def fake_bible(tmp_path: Path, lines: list[str], exit_code: int = 0) -> tuple[str, ...]:
    """Write an executable that prints ``lines`` then exits with ``exit_code``."""
    script = tmp_path / "fake-bible"
    body = "".join(f"echo '{line}'\n" for line in lines)
    script.write_text(f"#!/bin/sh\n{body}exit {exit_code}\n")
    script.chmod(0o755)
    return (str(script),)


def test_rest_paragraphs_keep_prose_only() -> None:
    text = "Title\n=====\n\n.. _label:\n\nOne sentence\nsplit over  lines.\n\nShort.\n"
    assert list(tc.rest_paragraphs(text)) == ["One sentence split over lines."]


def test_bible_verses_strip_references() -> None:
    assert list(tc.bible_verses("\n".join(BIBLE_LINES))) == [
        "In the beginning God created the heaven and the earth.",
        "Now there was a certain man of Ramathaimzophim, of mount Ephraim.",
    ]


def test_corpus_from_fake_sources(fake_docs: Path, tmp_path: Path, isolated_cache: Path) -> None:
    bible = fake_bible(tmp_path, BIBLE_LINES)
    corpus = tc.english_corpus(doc_sources=fake_docs, bible_command=bible)
    assert corpus == isolated_cache / "text" / tc.CORPUS_NAME
    assert corpus.read_text(encoding="utf-8").splitlines() == [
        "These documents are generated from reStructuredText sources.",
        "Python is an easy to learn, powerful programming language.",
        "The interpreter is easily extended with new functions.",
        "In the beginning God created the heaven and the earth.",
        "Now there was a certain man of Ramathaimzophim, of mount Ephraim.",
    ]


def test_corpus_is_built_once(fake_docs: Path, tmp_path: Path) -> None:
    bible = fake_bible(tmp_path, BIBLE_LINES)
    first = tc.english_corpus(doc_sources=fake_docs, bible_command=bible)
    stamp = first.stat().st_mtime_ns
    broken = fake_bible(tmp_path, [], exit_code=3)
    assert tc.english_corpus(doc_sources=tmp_path / "gone", bible_command=broken) == first
    assert first.stat().st_mtime_ns == stamp


def test_failed_build_leaves_nothing(fake_docs: Path, tmp_path: Path, isolated_cache: Path) -> None:
    broken = fake_bible(tmp_path, ["Ge1:1 partial output before a crash"], exit_code=3)
    with pytest.raises(DataUnavailableError, match="exit 3"):
        tc.english_corpus(doc_sources=fake_docs, bible_command=broken)
    text_dir = isolated_cache / "text"
    assert not text_dir.exists() or list(text_dir.iterdir()) == []


def test_write_is_atomic(
    fake_docs: Path, tmp_path: Path, isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(text: str) -> list[str]:
        raise OSError("disk full")

    monkeypatch.setattr(tc, "bible_verses", explode)
    with pytest.raises(OSError, match="disk full"):
        tc.english_corpus(doc_sources=fake_docs, bible_command=fake_bible(tmp_path, BIBLE_LINES))
    assert list((isolated_cache / "text").iterdir()) == []


def test_missing_docs_says_apt_get(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailableError, match="apt-get install -y python3.11-doc bible-kjv"):
        tc.english_corpus(doc_sources=tmp_path / "absent")


def test_missing_bible_program_says_apt_get(fake_docs: Path, tmp_path: Path) -> None:
    with pytest.raises(DataUnavailableError, match="bible-kjv") as info:
        tc.english_corpus(doc_sources=fake_docs, bible_command=(str(tmp_path / "no-bible"),))
    assert "no-bible" in str(info.value)


def test_wordpiece_vocab_and_tokenizer(tmp_path: Path, isolated_cache: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    sentence = "the quick brown fox jumps over the lazy dog while the function returns a value"
    corpus.write_text("\n".join([sentence] * 50) + "\n", encoding="utf-8")
    vocab_dir = tc.wordpiece_vocab(corpus, vocab_size=120)
    assert vocab_dir.parent == isolated_cache / "tokenizers"
    assert vocab_dir.name.endswith("-120") and (vocab_dir / "vocab.txt").is_file()
    assert tc.wordpiece_vocab(corpus, vocab_size=120) == vocab_dir
    tokenizer = tc.bert_tokenizer(vocab_dir)
    tokens = tokenizer.tokenize("The FUNCTION returns")
    assert tokens == ["the", "function", "returns"]
    assert tokenizer.unk_token not in tokens
    assert tokenizer("the fox")["input_ids"][0] == tokenizer.cls_token_id


def test_vocab_key_changes_with_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("alpha beta gamma delta\n" * 20, encoding="utf-8")
    first = tc.wordpiece_vocab(corpus, vocab_size=60)
    corpus.write_text("epsilon zeta eta theta\n" * 20, encoding="utf-8")
    assert tc.wordpiece_vocab(corpus, vocab_size=60) != first


def test_bad_vocab_size_and_missing_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        tc.wordpiece_vocab(tmp_path, vocab_size=3)
    with pytest.raises(DataUnavailableError, match="vocab.txt"):
        tc.bert_tokenizer(tmp_path)


def test_bible_output_that_is_not_utf8_is_replaced(fake_docs: Path, tmp_path: Path) -> None:
    script = tmp_path / "latin1-bible"
    verse = "Ge1:1 In the beginning God created the heaven caf\\351.\\n"
    script.write_text(f"#!/bin/sh\nprintf '{verse}'\n")
    script.chmod(0o755)
    corpus = tc.english_corpus(doc_sources=fake_docs, bible_command=(str(script),))
    text = corpus.read_text(encoding="utf-8")
    assert "In the beginning God created the heaven caf\ufffd." in text


def test_non_utf8_corpus_names_file(tmp_path: Path) -> None:
    from data.errors import CorruptDataError

    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes(b"caf\xe9 the quick brown fox jumps over the lazy dog\n" * 30)
    with pytest.raises(CorruptDataError, match=r"latin1\.txt: is not UTF-8 text.*Fix:"):
        tc.wordpiece_vocab(corpus, vocab_size=60)


def test_leftover_vocab_folder_without_vocab_txt_is_refused(tmp_path: Path,
                                                          isolated_cache: Path) -> None:
    import hashlib

    from data.errors import CorruptDataError

    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog again\n" * 50, encoding="utf-8")
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:16]
    leftover = isolated_cache / "tokenizers" / f"wordpiece-{digest}-60"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("x")
    with pytest.raises(CorruptDataError, match=rf"{leftover}.*vocab\.txt.*Fix: delete {leftover}"):
        tc.wordpiece_vocab(corpus, vocab_size=60)
