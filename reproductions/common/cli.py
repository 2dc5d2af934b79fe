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

What can be checked early is: option values when parsed (the argparse types
:func:`positive_int`, :func:`int_at_least`, :func:`float_in`, :func:`device_name`), output
directories and files named by options before any work (:func:`writable_directory`,
:func:`read_json_file`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from core.config import ConfigError
from data.paths import directory_problem
from reproductions.common.errors import USER_ERRORS, WorkerError


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer option with a floor: ``int_at_least(2)`` for a world
    size that must have a second worker to talk to.

    The returned parser raises :class:`argparse.ArgumentTypeError` (argparse names the option)
    for text that is not an integer >= ``low``.
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not >= {low}")
        return value

    return parse


positive_int = int_at_least(1)
"""An argparse ``type`` for options that count something (steps, intervals): an int >= 1."""


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


def device_name(text: str) -> str:
    """An argparse ``type`` for a ``--device`` option: ``cpu``, ``auto`` (the GPU when there is
    one), ``cuda`` or ``cuda:N``, checked against this machine, so that a device it lacks ends
    the command at once in one line instead of in torch's error after minutes of work.

    Returns:
        ``text`` unchanged (``auto`` is resolved where the device is made:
        :func:`resolve_device`, :func:`reproductions.common.launch.init_distributed`).

    Raises:
        argparse.ArgumentTypeError: not such a device name, or a CUDA device this machine does
            not have (argparse names the option).
    """
    if text == "auto":
        return text
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: expected cpu, auto, cuda "
                                         "or cuda:N")
    if device.type == "cpu":
        return text
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here; use cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s), "
                                         f"cuda:0 to cuda:{count - 1}")
    return text


def resolve_device(name: str) -> torch.device:
    """The device a :func:`device_name` option names: ``auto`` is the GPU when there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def writable_directory(path: Path, option: str) -> Path:
    """Check, before any work, that the output directory ``path`` exists or can be created, by
    creating it: a regular file in its place (or in the place of a parent), or a place that
    takes no directories, would otherwise end the command in a traceback when its first file
    is written, after the work.

    Args:
        path: The directory an option names (created here when missing).
        option: The option, named in the message (``"--out"``).

    Returns:
        ``path``.

    Raises:
        ConfigError: it cannot be created; the message names the option, the path and why.
    """
    problem = directory_problem(Path(path))
    if problem is not None:
        raise ConfigError(option, str(path), f"a directory that can be created ({problem})")
    return path


def read_error(exc: OSError | ValueError) -> str:
    """Why a file could not be read, in words for an error line: the system's reason
    (``No such file or directory``), the JSON parser's, or a loader's own message."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return f"not JSON: {exc}"
    return str(exc)


def read_json_file(path: Path, option: str) -> Any:
    """The JSON in the file an option names (a study config, a saved run), read so that a
    missing, unreadable or non-JSON file ends the command in one line.

    Raises:
        ConfigError: the file cannot be read or is not JSON; the message names ``option``,
            the path and why.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise ConfigError(option, str(path), f"a readable JSON file ({read_error(exc)})"
                          ) from None


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
