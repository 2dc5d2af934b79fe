"""Make the built-in data sets ready: ``python -m data.prepare [--data-dir D] [--only ...]``.

Installs the Debian packages that carry the data (when running as root and they are missing),
then builds every cache the entry points use: Fashion-MNIST tensors, the English corpus and the
default WordPiece vocabulary. Caches that exist are reused, so running it again is cheap.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from data.errors import CorruptDataError, DataUnavailableError
from data.paths import add_data_dir_argument, data_root

PACKAGES = {
    "fashion-mnist": ("dataset-fashion-mnist",),
    "text": ("bible-kjv", "python3.11-doc"),
}
"""Debian packages each ``--only`` choice needs."""


def missing_packages(packages: Sequence[str]) -> list[str]:
    """Return the Debian packages among ``packages`` that are not installed.

    Args:
        packages: Debian package names.

    Returns:
        The subset dpkg does not report as installed, in the given order; empty on systems
        without dpkg, where the loaders' own errors explain what is missing.
    """
    if shutil.which("dpkg-query") is None:
        return []
    missing = []
    for package in packages:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True
        )
        if result.returncode != 0 or not result.stdout.endswith("install ok installed"):
            missing.append(package)
    return missing


def install_packages(packages: Sequence[str]) -> None:
    """Install Debian packages with apt-get, or explain the command when not root.

    Args:
        packages: Missing packages to install; nothing happens when empty.

    Raises:
        SystemExit: Not running as root (the message gives the sudo command), or apt-get failed.
    """
    if not packages:
        return
    names = " ".join(packages)
    if os.geteuid() != 0:
        raise SystemExit(
            f"data.prepare: missing Debian packages: {names}. Install them with:\n"
            f"  sudo apt-get update -qq && sudo apt-get install -y -qq {names}\n"
            "then run this command again."
        )
    print(f"data.prepare: installing {names} with apt-get", flush=True)
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        if subprocess.run(command).returncode != 0:
            raise SystemExit(f"data.prepare: `{' '.join(command)}` failed; see its output above")


def build_fashion_mnist(root: str | None) -> None:
    """Build and report the Fashion-MNIST tensor caches of both splits."""
    from data.fashion_mnist import fashion_mnist

    for train in (True, False):
        dataset = fashion_mnist(train, root)
        split = "train" if train else "test"
        print(
            f"fashion-mnist {split}: {len(dataset)} images -> "
            f"{data_root(root) / 'fashion-mnist' / (split + '.pt')}"
        )


def build_text(root: str | None) -> None:
    """Build and report the English corpus and the default WordPiece vocabulary."""
    from data.text_corpus import DEFAULT_VOCAB_SIZE, english_corpus, wordpiece_vocab

    corpus = english_corpus(root)
    with corpus.open(encoding="utf-8") as handle:
        lines = sum(1 for _ in handle)
    print(f"english corpus: {lines} lines, {corpus.stat().st_size / 1e6:.1f} MB -> {corpus}")
    vocab = wordpiece_vocab(corpus, DEFAULT_VOCAB_SIZE, root)
    print(f"wordpiece vocabulary ({DEFAULT_VOCAB_SIZE} tokens) -> {vocab / 'vocab.txt'}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status.

    Args:
        argv: Arguments without the program name; None reads ``sys.argv``.

    Returns:
        0 when every requested cache is ready, 1 when a data source is unavailable or
        damaged, or the cache directory cannot be created (one line naming it and the fix).
    """
    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__)
    add_data_dir_argument(parser)
    parser.add_argument(
        "--only", choices=[*PACKAGES, "all"], default="all", help="which data to prepare"
    )
    args = parser.parse_args(argv)
    chosen = list(PACKAGES) if args.only == "all" else [args.only]
    builders = {"fashion-mnist": build_fashion_mnist, "text": build_text}
    try:
        root = data_root(args.data_dir)  # a cache directory that cannot be made: before apt
        install_packages(missing_packages([p for name in chosen for p in PACKAGES[name]]))
        for name in chosen:
            builders[name](args.data_dir)
    except (DataUnavailableError, CorruptDataError) as exc:
        print(f"data.prepare: {exc}", file=sys.stderr)
        return 1
    print(f"data.prepare: ready in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
