"""Errors raised when a data set cannot be found or read.

The messages are written for the person running a command: they say what is missing or broken and
the exact command that fixes it, so nobody has to read the loader's source to recover.
"""

from __future__ import annotations

from pathlib import Path


def _own_line(text: str, name: str) -> str:
    """The error's own message in ``text``, which may be a whole worker traceback.

    A DataLoader worker's exception reaches the main process rebuilt from one string, the
    worker's formatted traceback (torch calls ``type(exc)(text)``); its last line
    ``"<module>.<name>: <message>"`` is the message the worker raised.
    """
    marker = f"{name}: "
    tail = text.rstrip().rsplit("\n", 1)[-1]
    return tail.split(marker, 1)[1] if marker in tail else text


class DataUnavailableError(RuntimeError):
    """A data set (or a program that produces it) is not present on this machine.

    Attributes:
        what: The missing thing, e.g. ``"Fashion-MNIST IDX files in /usr/share/datasets/..."``.
        fix: The command or action that makes it available, e.g. ``"make data"``.
    """

    def __init__(self, what: str, fix: str | None = None) -> None:
        """Build the message ``"<what> is not available. Fix: <fix>"``.

        Args:
            what: The missing thing, specific enough to locate it (include paths); alone, a
                finished message (or a DataLoader worker's traceback ending in one).
            fix: The exact command or action that provides it.
        """
        if fix is None:
            message = _own_line(what, type(self).__name__)
            what, _, fix = message.partition(" is not available. Fix: ")
        else:
            message = f"{what} is not available. Fix: {fix}"
        super().__init__(message)
        self.what = what
        self.fix = fix


class CorruptDataError(ValueError):
    """A data file exists but its contents are not what its format promises.

    Attributes:
        path: The offending file.
    """

    def __init__(self, path: Path | str, problem: str | None = None,
                 fix: str | None = None) -> None:
        """Build the message ``"<path>: <problem>. Fix: <fix>"``.

        Args:
            path: The file that failed validation; alone, a finished message (or a DataLoader
                worker's traceback ending in one).
            problem: What is wrong with it.
            fix: How to get a good copy.
        """
        if problem is None:
            message = _own_line(str(path), type(self).__name__)
            path = message.split(": ", 1)[0]
        else:
            message = f"{path}: {problem}. Fix: {fix}"
        super().__init__(message)
        self.path = Path(path)
