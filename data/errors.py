"""Errors raised when a data set cannot be found or read.

The messages are written for the person running a command: they say what is missing or broken and
the exact command that fixes it, so nobody has to read the loader's source to recover.
"""

from __future__ import annotations

from pathlib import Path


class DataUnavailableError(RuntimeError):
    """A data set (or a program that produces it) is not present on this machine.

    Attributes:
        what: The missing thing, e.g. ``"Fashion-MNIST IDX files in /usr/share/datasets/..."``.
        fix: The command or action that makes it available, e.g. ``"make data"``.
    """

    def __init__(self, what: str, fix: str) -> None:
        """Build the message ``"<what> is not available. Fix: <fix>"``.

        Args:
            what: The missing thing, specific enough to locate it (include paths).
            fix: The exact command or action that provides it.
        """
        super().__init__(f"{what} is not available. Fix: {fix}")
        self.what = what
        self.fix = fix


class CorruptDataError(ValueError):
    """A data file exists but its contents are not what its format promises.

    Attributes:
        path: The offending file.
    """

    def __init__(self, path: Path, problem: str, fix: str) -> None:
        """Build the message ``"<path>: <problem>. Fix: <fix>"``.

        Args:
            path: The file that failed validation.
            problem: What is wrong with it.
            fix: How to get a good copy.
        """
        super().__init__(f"{path}: {problem}. Fix: {fix}")
        self.path = path
