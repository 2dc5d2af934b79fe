"""The errors a user's files or settings cause, as opposed to bugs: the entry points report them in
one line (:mod:`reproductions.common.cli`), also when a worker process of a local launch
(:func:`reproductions.common.launch.run_local`) raised them."""

from __future__ import annotations

from data.errors import CorruptDataError, DataUnavailableError
from reproductions.common.checkpoint import CheckpointError
from reproductions.common.results import ResultsError

USER_ERRORS = (DataUnavailableError, CorruptDataError, CheckpointError, ResultsError)
"""Errors caused by the machine's files rather than the program, reported in one line."""


class WorkerError(RuntimeError):
    """A configuration error or one of :data:`USER_ERRORS` raised in a worker process, carried to
    the launching process as its message (the exception types need not survive pickling)."""
