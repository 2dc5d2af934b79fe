"""Weights & Biases runs that make a dashboard easy, offline unless the user is logged in.

Every run lands in project ``kfac-repro-<paper>``, group ``<experiment>`` (so one experiment's
optimizers sit side by side), and is named ``<experiment>-<optimizer>-<seed>``. The mode is
``online`` only when the user is logged in (``WANDB_API_KEY`` is set or ``~/.netrc`` has an
entry for the W&B server, as ``wandb login`` writes) and ``WANDB_MODE`` does not say
offline/disabled; otherwise runs are written offline under ``<directory>/wandb/offline-run-*``
(upload later with ``wandb sync``) and can be read back with :func:`read_offline_history`.
``--wandb online`` without a login is refused when parsed; an online run whose server cannot be
reached is recorded offline instead, with a warning. Configurations, logged values and the command
line W&B records are scrubbed of credentials (:mod:`reproductions.common.scrub`) before they leave
the process.
"""

from __future__ import annotations

import argparse
import json
import netrc
import os
import struct
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from reproductions.common.scrub import scrub_argv, scrub_secrets

MODES = ("auto", "online", "offline", "disabled")
"""Choices of ``--wandb``; ``auto`` resolves with :func:`resolve_mode`."""

WANDB_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")
"""The W&B cloud's API hosts in ``~/.netrc``: ``wandb login`` writes the second since wandb 0.31,
which still reads the first."""

INIT_TIMEOUT_S = 30.0
"""Seconds an online run waits for the W&B server before it is recorded offline instead (W&B's
own default, 90, kept an offline machine waiting); ``WANDB_INIT_TIMEOUT`` overrides it."""

_HEADER = struct.Struct("<4sHB")  # magic ":W&B", identifier, version
_CHUNK = struct.Struct("<IHB")    # crc32, length, type (LevelDB log framing)
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def add_wandb_argument(parser: argparse.ArgumentParser) -> None:
    """Add the shared ``--wandb {auto,online,offline,disabled}`` option (``args.wandb``)."""
    parser.add_argument(
        "--wandb", type=wandb_mode, choices=MODES, default="auto",
        help="Weights & Biases mode. auto (default): online when logged in (WANDB_API_KEY or "
             "a ~/.netrc entry from `wandb login`) and WANDB_MODE is not offline/disabled, "
             "else offline (files under wandb/ in the run's directory: --out, or --run-dir where "
             "the command has one; upload later with `wandb sync`); online needs a login, and "
             "records the run offline when the server cannot be reached; "
             "disabled writes nothing.")


def wandb_mode(text: str) -> str:
    """An argparse ``type`` for ``--wandb`` that refuses ``online`` without a W&B login when
    parsed, in one line, instead of in W&B's traceback once the data and model are built.

    Returns:
        ``text`` unchanged (argparse checks it against :data:`MODES`).

    Raises:
        argparse.ArgumentTypeError: ``online`` and :func:`wandb_logged_in` is False (argparse
            names the option).
    """
    if text == "online" and not wandb_logged_in():
        raise argparse.ArgumentTypeError(
            "online needs a W&B login: run `wandb login` (or set WANDB_API_KEY) first, or pass "
            "--wandb offline and upload the run later with `wandb sync`")
    return text


def wandb_logged_in(environ: Mapping[str, str] | None = None) -> bool:
    """Whether W&B credentials are available without asking the user.

    Args:
        environ: The environment; ``os.environ`` when None. ``NETRC`` names the netrc file
            (default ``~/.netrc``); ``WANDB_BASE_URL`` a W&B server of one's own.

    Returns:
        True when ``WANDB_API_KEY`` is non-empty or the netrc file has an entry for one of
        :data:`WANDB_HOSTS` or the host of ``WANDB_BASE_URL``.
    """
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    path = Path(env.get("NETRC") or Path.home() / ".netrc").expanduser()
    hosts = [*WANDB_HOSTS, urlsplit(env.get("WANDB_BASE_URL", "")).netloc]
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(host) is not None for host in hosts if host)


def resolve_mode(requested: str = "auto", environ: Mapping[str, str] | None = None) -> str:
    """The W&B mode a run uses.

    Args:
        requested: One of :data:`MODES`; anything but ``auto`` is used as given.
        environ: The environment; ``os.environ`` when None.

    Returns:
        ``"online"``, ``"offline"`` or ``"disabled"``.

    Raises:
        ValueError: ``requested`` is not one of :data:`MODES`.
    """
    if requested not in MODES:
        raise ValueError(f"W&B mode {requested!r} is not one of {', '.join(MODES)}")
    if requested != "auto":
        return requested
    env = os.environ if environ is None else environ
    forced = env.get("WANDB_MODE", "").strip().lower()
    if forced == "disabled":
        return "disabled"
    if forced in ("offline", "dryrun"):
        return "offline"
    return "online" if wandb_logged_in(env) else "offline"


class Tracker:
    """One W&B run, named for the dashboard (see the module docstring).

    An online run whose start fails (no network, a server that does not answer within
    :data:`INIT_TIMEOUT_S`, a key it refuses) is recorded offline instead, with a warning naming
    the ``wandb sync`` command that uploads it later: the training is not lost to the tracking.

    Args:
        paper: The reproduction; the project is ``kfac-repro-<paper>``.
        experiment: The experiment; the group.
        optimizer: The optimizer; part of the run name and the job type.
        seed: The seed; part of the run name.
        config: The run's configuration (credentials are redacted).
        directory: Where W&B writes its files (``<directory>/wandb``).
        mode: One of :data:`MODES`.
        run_id: Continue this run id (set when resuming from a checkpoint).
        enabled: False on non-main ranks, which then log nothing.
    """

    def __init__(self, *, paper: str, experiment: str, optimizer: str, seed: int,
                 config: Mapping[str, Any], directory: Path, mode: str = "auto",
                 run_id: str | None = None, enabled: bool = True) -> None:
        import wandb  # ~0.7 s; only runs that track pay for it

        self.mode = resolve_mode(mode if enabled else "disabled")
        self.project = f"kfac-repro-{paper}"
        self.group = experiment
        self.name = f"{experiment}-{optimizer}-{seed}"
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        timeout = {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": INIT_TIMEOUT_S}

        def init(mode: str) -> Any:
            return wandb.init(
                project=self.project, group=self.group, name=self.name, job_type=optimizer,
                config=scrub_secrets(dict(config)), mode=mode, dir=str(directory),
                id=run_id, resume="allow" if run_id else None,
                settings=wandb.Settings(console="off", quiet=True, **timeout),
            )

        argv = sys.argv
        sys.argv = scrub_argv(argv)  # W&B records the command line in the run's metadata
        try:
            try:
                self.run: Any = init(self.mode)
            except wandb.errors.CommError as exc:  # only an online run talks to the server
                self.mode = "offline"
                self.run = init(self.mode)
                reason = (str(exc).splitlines() or [type(exc).__name__])[0]
                warnings.warn(f"W&B could not start the online run ({reason}); it is recorded "
                              f"offline in {self.run_dir} instead: upload it later with "
                              f"`wandb sync {self.run_dir}`", stacklevel=2)
        finally:
            sys.argv = argv
        self.id: str = self.run.id

    @property
    def run_dir(self) -> Path | None:
        """The run's local directory (holding ``run-<id>.wandb``); None when disabled."""
        if self.mode == "disabled":
            return None
        return Path(self.run.dir).parent

    def info(self) -> dict[str, str]:
        """``{"project", "group", "name", "id", "mode"}`` for the results file's ``wandb``."""
        return {"project": self.project, "group": self.group, "name": self.name,
                "id": self.id, "mode": self.mode}

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log scalars at ``step`` (steps must not decrease within a run)."""
        self.run.log(scrub_secrets(dict(metrics), by_name=False), step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set run summary values (the numbers a dashboard's run table shows)."""
        self.run.summary.update(scrub_secrets(dict(values), by_name=False))

    def finish(self) -> None:
        """Close the run (flushes files); further calls do nothing."""
        if self.run is not None:
            self.run.finish()
            self.run = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.finish()


def _records(data: bytes) -> Iterator[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB-log framed chunks in
    32 KiB blocks (a block's tail shorter than a chunk header is padding).

    Raises:
        ValueError: a chunk has an unknown type (the file is damaged).
    """
    position, pending = _HEADER.size, b""
    while True:
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK.size:
            position += left
            continue
        if position + _CHUNK.size > len(data):
            return
        _, length, kind = _CHUNK.unpack_from(data, position)
        position += _CHUNK.size
        if position + length > len(data):
            return  # a run still being written (or killed mid-record): stop at the last whole one
        chunk = data[position:position + length]
        position += length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
        else:
            raise ValueError(f"chunk of unknown type {kind} at byte {position - length}")


def _item_value(item: Any) -> Any:
    kind = item.WhichOneof("value")
    if kind is None:
        return json.loads(item.value_json) if item.value_json else None
    if kind == "none":
        return None
    if kind == "json":
        return json.loads(item.json)
    return getattr(item, kind)


def read_offline_history(run_dir: Path, wait_s: float = 0.0) -> list[dict[str, Any]]:
    """Read the logged history of a local W&B run, without network or the wandb service.

    Args:
        run_dir: A run directory (``.../wandb/offline-run-<time>-<id>``) or its
            ``run-<id>.wandb`` file.
        wait_s: Seconds to keep rereading the file until it holds the run's ``exit`` record: W&B's
            service can finish writing a run just after ``run.finish()`` returns. When the time
            is up the file is read as it stands (a run in progress has no exit record).

    Returns:
        One dict per logged step, in order, with the logged keys (nested keys joined by ``.``)
        and W&B's own ``_step``, ``_runtime`` and ``_timestamp``.

    Raises:
        FileNotFoundError: no ``run-*.wandb`` file is there.
        ValueError: the file does not start with the W&B header or is damaged (names it).
    """
    from wandb.proto import wandb_internal_pb2

    path = Path(run_dir)
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb"))
        if not files:
            raise FileNotFoundError(f"{path}: no run-*.wandb file (not a W&B run directory)")
        path = files[0]
    deadline = time.monotonic() + wait_s
    while True:
        data = path.read_bytes()
        if len(data) < _HEADER.size or _HEADER.unpack_from(data)[0] != b":W&B":
            raise ValueError(f"{path}: not a W&B run file (bad header)")
        try:
            raws = list(_records(data))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        records = []
        for raw in raws:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            records.append(record)
        if time.monotonic() >= deadline or any(r.WhichOneof("record_type") == "exit"
                                               for r in records):
            break
        time.sleep(0.1)
    return [{(".".join(item.nested_key) if item.nested_key else item.key): _item_value(item)
             for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]
