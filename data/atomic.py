"""Atomic creation of cache files and directories.

Caches are built once and then trusted, so a half-written file (an interrupted run, a full disk,
two processes racing) must never appear under the final name. Everything is written to a temporary
name in the destination directory and renamed into place, which is atomic on POSIX file systems.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data.errors import DataUnavailableError
from data.paths import DATA_DIR_ENV


def _unwritable(directory: Path, exc: OSError) -> DataUnavailableError:
    """The error for a cache directory that cannot be created or written to.

    Raised instead of ``mkdir``'s or ``mkstemp``'s traceback (an existing read-only cache
    directory, or ``KFAC_DATA_DIR=/proc/self``), so the command ends in one line naming the
    directory and the option that moves the cache.

    Args:
        directory: The directory a cache file or folder was to be created in.
        exc: What the operating system said.
    """
    reason = exc.strerror or str(exc)
    return DataUnavailableError(
        f"a writable cache directory {directory} ({reason})",
        f"pass --data-dir (or set {DATA_DIR_ENV} to) a writable directory",
    )


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary file path that is renamed to ``final`` when the block succeeds.

    The temporary file lives next to ``final`` (same file system, so the rename is atomic). If the
    block raises, the temporary file is removed and ``final`` is left untouched.

    Args:
        final: The path the finished file should have; its parent is created if needed.

    Yields:
        A path the caller writes the complete contents to.

    Raises:
        DataUnavailableError: the parent cannot be created or written to (names it and the fix).
    """
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    except OSError as exc:
        raise _unwritable(final.parent, exc) from None
    os.close(fd)
    tmp = Path(name)
    tmp.chmod(0o644)  # mkstemp makes 0600; caches are meant to be shared like ordinary files
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory that is renamed to ``final`` when the block succeeds.

    If another process created ``final`` first, its copy is kept and ours is discarded, since both
    were built from the same inputs. On failure the temporary directory is removed.

    Args:
        final: The directory the finished contents should have; its parent is created if needed.

    Yields:
        An empty directory the caller fills.

    Raises:
        DataUnavailableError: the parent cannot be created or written to (names it and the fix).
    """
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    except OSError as exc:
        raise _unwritable(final.parent, exc) from None
    tmp.chmod(0o755)  # mkdtemp makes 0700
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
