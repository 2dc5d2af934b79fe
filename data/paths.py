"""Where prepared data sets are cached.

Every loader in this package writes its derived files (tensor caches, the text corpus, trained
vocabularies) under one cache directory, so that a user can move all of them at once with a flag or
an environment variable, and so that tests can point them at a temporary directory.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DATA_DIR_ENV = "KFAC_DATA_DIR"
"""Environment variable that overrides the default cache directory."""

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the parent directory of the ``data`` package."""


def data_root(override: str | Path | None = None) -> Path:
    """Return the cache directory for prepared data.

    The first of these that is set wins: ``override`` (typically a ``--data-dir`` flag), the
    ``KFAC_DATA_DIR`` environment variable, then ``<repo>/.cache/data``. The directory is not
    created here; writers create the sub-directories they need.

    Args:
        override: An explicit directory, or None to fall back to the environment and default.

    Returns:
        The absolute cache directory, with ``~`` expanded.
    """
    if override is not None and str(override) != "":
        chosen = Path(override)
    elif os.environ.get(DATA_DIR_ENV):
        chosen = Path(os.environ[DATA_DIR_ENV])
    else:
        chosen = REPO_ROOT / ".cache" / "data"
    return chosen.expanduser().resolve()


def add_data_dir_argument(parser: argparse.ArgumentParser) -> None:
    """Add the shared ``--data-dir`` option to a command-line parser.

    All entry points use the same option so that one flag moves every cache; its value is meant to
    be passed straight to :func:`data_root`.

    Args:
        parser: The parser to extend; the parsed value lands in ``args.data_dir`` (None if absent).
    """
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help=f"cache directory for prepared data (default: ${DATA_DIR_ENV} or <repo>/.cache/data)",
    )
