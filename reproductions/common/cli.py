"""Command-line error handling shared by the entry points: a user's mistake ends the command with
one line that says what to fix, never a traceback.

* An invalid configuration value (:class:`core.config.ConfigError`: a typo in ``--set``, a bad
  config file) exits like argparse's own errors: status 2 and
  ``<prog>: error: invalid <field>=<value>: expected <allowed values>``.
* Missing or damaged data, checkpoints that cannot be read and bad results files
  (:data:`~reproductions.common.errors.USER_ERRORS`) exit with status 1 and their message, which
  names the file and the fix; so does either kind raised in a worker of a local launch
  (:class:`~reproductions.common.errors.WorkerError`).

Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from core.config import ConfigError
from reproductions.common.errors import USER_ERRORS, WorkerError


def positive_int(text: str) -> int:
    """An argparse ``type`` for options that count something (steps, intervals): an int >= 1.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not such an integer (argparse names the option).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def float_in(low: float, high: float = math.inf, *, low_inclusive: bool = True
             ) -> Callable[[str], float]:
    """An argparse ``type`` for a float option in ``[low, high]`` (``(low, high]`` without
    ``low_inclusive``): a learning rate > 0, a fraction in [0, 1].

    The returned parser raises :class:`argparse.ArgumentTypeError` (argparse names the option)
    for text that is not such a number.
    """
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = value >= low if low_inclusive else value > low
        if not (above and value <= high and math.isfinite(value)):
            span = f"{'[' if low_inclusive else '('}{low}, {high}]" if math.isfinite(high) else (
                f"{'>=' if low_inclusive else '>'} {low}")
            raise argparse.ArgumentTypeError(f"{value} is not {span}")
        return value

    return parse


@contextmanager
def exit_on_user_error(parser: argparse.ArgumentParser) -> Iterator[None]:
    """Turn configuration and data errors raised inside the block into a one-line exit.

    Args:
        parser: The entry point's parser; its ``prog`` starts the message.

    Raises:
        SystemExit: status 2 for a :class:`ConfigError`, 1 for one of :data:`USER_ERRORS` or a
            :class:`WorkerError`.
    """
    try:
        yield
    except ConfigError as exc:
        parser.error(str(exc))
    except (*USER_ERRORS, WorkerError) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
