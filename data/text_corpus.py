"""A real English corpus and WordPiece vocabulary for BERT pretraining, built offline.

No Wikipedia or BookCorpus text can be installed on the project's machines, so the stand-in is
about 13 MB of real English from two Debian packages: the reST sources of the Python 3.11 manual
(``python3.11-doc``, technical prose) and the King James Bible (``bible-kjv``, narrative prose).
They are flattened into one UTF-8 file, one paragraph or verse per line, which ``datasets``'
``text`` loader and ``tokenizers`` both read directly. Everything is cached under
:func:`data.paths.data_root` and written atomically.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import BertWordPieceTokenizer
from transformers import BertTokenizerFast

from data.atomic import atomic_directory, atomic_path
from data.errors import CorruptDataError, DataUnavailableError
from data.paths import data_root

PYTHON_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
"""Where ``apt-get install python3.11-doc`` puts the manual's reST sources (``**/*.txt``)."""

BIBLE_COMMAND = ("bible", "-f", "gen1:1-rev22:21")
"""Prints the whole KJV, one verse per line, each prefixed by its reference (``Ge1:1 In...``)."""

APT_FIX = "apt-get install -y python3.11-doc bible-kjv (as root; or run `make data`)"

MIN_LINE_CHARS = 20
"""Shorter lines (headings, labels, ``Example::``) carry too little text for MLM and are dropped."""

CORPUS_NAME = "english-corpus-v1.txt"
"""Cache file name; the version changes whenever the extraction rules below change."""

DEFAULT_VOCAB_SIZE = 8000
"""Vocabulary size built by ``python -m data.prepare``; small enough for CPU-sized BERTs."""

WORDPIECE_MIN_FREQUENCY = 2
"""Minimum count of a merge candidate when training the WordPiece vocabulary."""

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""The tokens every BERT vocabulary holds (a vocabulary without them cannot tokenise)."""

REBUILD_FIX = "delete it and run `make data` (or `python -m data.prepare --only text`) again"

_ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1{2,}$")
_VERSE_REFERENCE = re.compile(r"^\S*\d+:\d+\s+")


def english_corpus(
    root: str | Path | None = None,
    *,
    doc_sources: Path = PYTHON_DOC_SOURCES,
    bible_command: Sequence[str] = BIBLE_COMMAND,
) -> Path:
    """Build (once) and return the English text corpus file.

    The Python manual comes first (files in sorted path order, so the output is reproducible),
    then the Bible. The file is cached by name: delete it to rebuild from different sources.

    Args:
        root: Cache directory override, passed to :func:`data.paths.data_root`.
        doc_sources: Directory searched recursively for ``*.txt`` reST sources.
        bible_command: Command whose standard output is the KJV, one verse per line.

    Returns:
        Path of the UTF-8 corpus, one paragraph or verse per line.

    Raises:
        DataUnavailableError: The manual's sources or the ``bible`` program are missing or fail.
        CorruptDataError: The cached corpus is empty.
    """
    final = data_root(root) / "text" / CORPUS_NAME
    if final.exists():
        if final.stat().st_size == 0:
            raise CorruptDataError(final, "is empty", REBUILD_FIX)
        return final
    doc_files = sorted(doc_sources.rglob("*.txt")) if doc_sources.is_dir() else []
    if not doc_files:
        raise DataUnavailableError(f"Python 3.11 manual sources (*.txt) in {doc_sources}", APT_FIX)
    bible_text = _run_bible(bible_command)
    with atomic_path(final) as tmp, tmp.open("w", encoding="utf-8") as out:
        for doc in doc_files:
            for paragraph in rest_paragraphs(doc.read_text(encoding="utf-8", errors="replace")):
                out.write(paragraph + "\n")
        for verse in bible_verses(bible_text):
            out.write(verse + "\n")
    return final


def rest_paragraphs(text: str) -> Iterator[str]:
    """Yield the paragraphs of a reST document, each joined onto one line.

    Comments and link targets (paragraphs opening with ``..`` but no ``::``) are dropped whole;
    heading adornments (``=====``) and directive lines (``.. note::``) are removed, while the prose
    inside directives is kept. Paragraphs shorter than :data:`MIN_LINE_CHARS` are dropped.

    Args:
        text: The document's contents.

    Yields:
        Paragraphs with all runs of whitespace collapsed to single spaces.
    """
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if stripped:
            block.append(stripped)
            continue
        paragraph = _join_rest_block(block)
        block = []
        if len(paragraph) >= MIN_LINE_CHARS:
            yield paragraph


def _join_rest_block(lines: list[str]) -> str:
    """Join one blank-line-separated reST block into a single line of prose ('' if markup only)."""
    if not lines or (lines[0].startswith("..") and "::" not in lines[0]):
        return ""
    prose = [ln for ln in lines if not (_ADORNMENT.match(ln) or ln.startswith(".. "))]
    return " ".join(" ".join(prose).split())


def bible_verses(text: str) -> Iterator[str]:
    """Yield the verses of ``bible -f`` output without their references.

    Args:
        text: Output of :data:`BIBLE_COMMAND`, one ``<Book><chapter>:<verse> <text>`` per line.

    Yields:
        Verse texts of at least :data:`MIN_LINE_CHARS` characters.
    """
    for line in text.splitlines():
        verse = " ".join(_VERSE_REFERENCE.sub("", line, count=1).split())
        if len(verse) >= MIN_LINE_CHARS:
            yield verse


def _run_bible(command: Sequence[str]) -> str:
    """Run the Bible dump command and return its output, or raise DataUnavailableError."""
    shown = " ".join(command)
    try:
        # Decoded leniently, like the manual's sources: one stray byte must not lose the Bible
        result = subprocess.run(list(command), capture_output=True, text=True,
                                encoding="utf-8", errors="replace", check=False)
    except FileNotFoundError as exc:
        raise DataUnavailableError(f"the `{command[0]}` program (KJV Bible)", APT_FIX) from exc
    if result.returncode != 0 or not result.stdout.strip():
        detail = result.stderr.strip() or "no output"
        raise DataUnavailableError(
            f"KJV text from `{shown}` (exit {result.returncode}: {detail})", APT_FIX
        )
    return result.stdout


def wordpiece_vocab(corpus: Path, vocab_size: int, root: str | Path | None = None) -> Path:
    """Train (once) a lowercase BERT WordPiece vocabulary on a corpus file.

    The result is cached in ``data_root()/tokenizers/wordpiece-<corpus sha256[:16]>-<size>``, so
    a changed corpus or size trains a new vocabulary and an unchanged one is reused.

    Args:
        corpus: A UTF-8 text file, e.g. from :func:`english_corpus`.
        vocab_size: Target vocabulary size including the special tokens.
        root: Cache directory override, passed to :func:`data.paths.data_root`.

    Returns:
        The directory holding ``vocab.txt``; pass it to :func:`bert_tokenizer`.

    Raises:
        ValueError: ``vocab_size`` is smaller than the five BERT special tokens.
        DataUnavailableError: ``corpus`` does not exist.
        CorruptDataError: ``corpus`` holds no text or is not UTF-8, or the cached vocabulary
            folder exists without ``vocab.txt``.
    """
    if vocab_size < 5:
        raise ValueError(f"vocab_size must be at least 5 (the special tokens), got {vocab_size}")
    if not corpus.is_file():
        raise DataUnavailableError(f"text corpus {corpus}",
                                   "run `make data` for the built-in corpus, or pass a text file")
    text = corpus.read_bytes()
    if not text.strip():
        raise CorruptDataError(corpus, "holds no text", "pass a UTF-8 text file with one "
                               "paragraph per line, or " + REBUILD_FIX + " for the built-in one")
    try:  # checked here: tokenizers' own error names no file
        text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptDataError(
            corpus, f"is not UTF-8 text (byte 0x{text[exc.start]:02x} at offset {exc.start})",
            "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or " + REBUILD_FIX
            + " for the built-in one") from None
    digest = hashlib.sha256(text).hexdigest()[:16]
    final = data_root(root) / "tokenizers" / f"wordpiece-{digest}-{vocab_size}"
    if (final / "vocab.txt").is_file():
        return final
    _check_vocab_folder(final, built=False)
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train(
        [str(corpus)],
        vocab_size=vocab_size,
        min_frequency=WORDPIECE_MIN_FREQUENCY,
        show_progress=False,
    )
    with atomic_directory(final) as tmp:
        tokenizer.save_model(str(tmp))
    _check_vocab_folder(final, built=True)  # another process's copy may have been kept instead
    return final


def _check_vocab_folder(folder: Path, built: bool) -> None:
    """Refuse a vocabulary folder that exists without ``vocab.txt``.

    :func:`~data.atomic.atomic_directory` keeps a folder already at the final name, so a leftover
    one (an interrupted copy, a hand-made folder) would otherwise be returned as a vocabulary,
    and every later run would fail the same way in :func:`bert_tokenizer`.

    Args:
        folder: The vocabulary's cache folder.
        built: True after training (the folder must now exist), False before (it may be absent).

    Raises:
        CorruptDataError: ``folder`` exists (or, after building, is missing) without vocab.txt.
    """
    if (folder / "vocab.txt").is_file() or (not built and not folder.exists()):
        return
    raise CorruptDataError(folder, "has no vocab.txt (left over from an interrupted run?)",
                           f"delete {folder} and run again; it is rebuilt from the corpus")


def bert_tokenizer(vocab_dir: Path, model_max_length: int = 512) -> BertTokenizerFast:
    """Load a BERT tokenizer from a directory holding ``vocab.txt``: lowercase, unless the
    directory's ``tokenizer_config.json`` says otherwise (a cased model's, ``do_lower_case``
    false, whose capitalised tokens lowercasing would miss).

    ``from_pretrained`` is used because transformers 5.x silently ignores ``vocab_file=`` in the
    constructor and returns a five-token vocabulary that maps every word to ``[UNK]``.

    Args:
        vocab_dir: Directory with ``vocab.txt``, e.g. from :func:`wordpiece_vocab`.
        model_max_length: Longest sequence the tokenizer will produce when truncating.

    Returns:
        The tokenizer, loaded from local files only.

    Raises:
        DataUnavailableError: ``vocab_dir/vocab.txt`` does not exist.
        CorruptDataError: ``vocab.txt`` lacks a BERT special token (e.g. it is empty).
    """
    vocab = vocab_dir / "vocab.txt"
    fix = "run `make data` or data.text_corpus.wordpiece_vocab()"
    if not vocab.is_file():
        raise DataUnavailableError(f"WordPiece vocabulary {vocab}", fix)
    tokens = set(vocab.read_text(encoding="utf-8", errors="replace").split())
    missing = [token for token in SPECIAL_TOKENS if token not in tokens]
    if missing:
        raise CorruptDataError(vocab, f"lacks the special tokens {', '.join(missing)}",
                               f"delete {vocab_dir} and {fix}")
    return BertTokenizerFast.from_pretrained(
        str(vocab_dir),
        model_max_length=model_max_length,
        local_files_only=True,
    )
