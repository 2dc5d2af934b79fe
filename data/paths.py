"""Where prepared data sets are cached.

Every loader in this package writes its derived files (tensor caches, the text corpus, trained
vocabularies) under one cache directory, so that a user can move all of them at once with a flag or
an environment variable, and so that tests can point them at a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from data.errors import DataUnavailableError

DATA_DIR_ENV = "KFAC_DATA_DIR"
"""Environment variable that overrides the default cache directory."""

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the parent directory of the ``data`` package."""


def data_root(override: str | Path | None = None) -> Path:
    """Return the cache directory for prepared data.

    The first of these that is set wins: ``override`` (typically a ``--data-dir`` flag), the
    ``KFAC_DATA_DIR`` environment variable, then ``<repo>/.cache/data``. The directory is
    created here (writers create the sub-directories they need), so that one that cannot be
    (a file in its place) ends the command in one line (naming ``--data-dir``) instead of a
    traceback from the first cache written.

    Args:
        override: An explicit directory, or None to fall back to the environment and default.

    Returns:
        The absolute cache directory, with ``~`` expanded.

    Raises:
        DataUnavailableError: the directory neither exists nor can be created, or its path
            cannot be resolved (a symlink loop).
    """
    if override is not None and str(override) != "":
        chosen = Path(override)
    elif os.environ.get(DATA_DIR_ENV):
        chosen = Path(os.environ[DATA_DIR_ENV])
    else:
        chosen = REPO_ROOT / ".cache" / "data"
    fix = (f"pass --data-dir (or set {DATA_DIR_ENV} to) a directory that exists or can be "
           "created")
    try:
        root = chosen.expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop: RuntimeError before Python 3.13
        raise DataUnavailableError(f"the data cache directory {chosen} ({exc})", fix) from None
    problem = directory_problem(root)
    if problem is not None:
        raise DataUnavailableError(f"the data cache directory {root} ({problem})", fix)
    return root


def directory_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a directory on this machine: a file (or a broken link) in its
    place or in a parent's, or a directory that cannot be created (no permission, a file
    system such as ``/proc`` that takes no new entries).

    A missing ``path`` is created (with its parents), so that an entry point can refuse an
    output or cache directory before any work: only creating it tells, since permission bits
    say nothing for root. An existing directory is accepted as it is (a cache may be read-only
    once built).

    Args:
        path: The directory.

    Returns:
        The reason, naming the path at fault, or None when ``path`` is a directory (now).
    """
    for candidate in (path, *path.parents):
        try:
            mode = candidate.stat().st_mode
        except FileNotFoundError:
            if candidate.is_symlink():
                return f"{candidate} is a broken link"
            continue
        except NotADirectoryError:  # a parent is a file: found further up
            continue
        except OSError as exc:
            return f"{candidate}: {exc.strerror}"
        if not stat.S_ISDIR(mode):
            return f"{candidate} is not a directory"
        if candidate == path:
            return None
        break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {exc.filename or path}: {exc.strerror or exc}"
    return None


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
