"""Atomic training checkpoints that survive a crash mid-write, loaded with ``weights_only``.

A checkpoint is ``<directory>/checkpoint-<step:09d>.pt``. It is written to a temporary file in the
same directory, flushed and fsynced, renamed into place (atomic on POSIX), and the directory is
fsynced so the rename itself is durable. So a file under the final name is always complete; a
damaged one (a copied-in truncated file, a bad disk) is detected at load time, reported, and the
previous checkpoint is used instead. Only the newest ``keep`` checkpoints are kept. A directory has
one writer (a distributed run keeps one per rank), so a save deletes the temporary files that
writes killed midway left there. :func:`load_agreed_checkpoint` finds the newest step that every
rank can read, and refuses checkpoints that a run of another world size saved.

States are loaded with ``torch.load(weights_only=True)``, which cannot run code from the file, so
states must consist of tensors, dicts, lists, tuples, numbers, strings, booleans and None;
:func:`save_checkpoint` checks this before writing, naming the first offending entry.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reproductions.common.results import finite_or_none
from reproductions.common.scrub import scrub_secrets

_NAME = re.compile(r"^checkpoint-(\d{9,})\.pt$")
_TEMPORARY = re.compile(r"^\.checkpoint-\d{9,}\.pt\..+\.tmp$")
_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)


class CheckpointError(RuntimeError):
    """No checkpoint in a directory can be loaded; the message names every file tried."""


def checkpoint_path(directory: Path, step: int) -> Path:
    """The file name of the checkpoint taken after ``step`` (zero-padded so names sort by step).
    """
    return Path(directory) / f"checkpoint-{step:09d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest step first (temporary files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def check_weights_only(value: Any, where: str = "state") -> None:
    """Raise TypeError unless ``value`` can be loaded by ``torch.load(weights_only=True)``.

    Types are checked exactly: subclasses of ``str`` or ``float`` (``torch.__version__``, numpy
    scalars) and of containers (named tuples) are refused by the loader, so they are here too.

    Args:
        value: The object to check, recursively.
        where: How to name ``value`` in the error, e.g. ``"state"``.

    Raises:
        TypeError: naming the first entry (``state['optimizer']['x']``) of another type.
    """
    kind = type(value)
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            check_weights_only(key, f"{where} key {key!r}")
            check_weights_only(item, f"{where}[{key!r}]")
    elif kind in (list, tuple):
        for index, item in enumerate(value):
            check_weights_only(item, f"{where}[{index}]")
    elif not (kind in _SCALARS or isinstance(value, torch.Tensor)):
        raise TypeError(f"{where} is a {kind.__module__}.{kind.__qualname__}, which "
                        "torch.load(weights_only=True) refuses; store tensors, numbers, "
                        "strings, lists, tuples and dicts only")


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(exc: Exception) -> str:
    """The informative line of a load error (torch's weights_only errors bury it mid-text)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    return (detail or lines or [""])[0]


def _check_crc(path: Path) -> None:
    """Raise ValueError when a member of the checkpoint's zip archive fails its CRC-32.

    ``torch.load`` does not check the CRCs, so bytes damaged inside a tensor (a bad disk or copy)
    would load as wrong numbers without any error. What has no CRC-32 to check passes: a file in
    torch's legacy format (``_use_new_zipfile_serialization=False``, not a zip archive), and
    members recorded with a CRC-32 of 0, as ``torch.save`` writes them all after
    ``torch.serialization.set_crc32_options(False)``.

    Raises:
        ValueError: naming the first member whose bytes do not match their CRC-32.
    """
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":
            return
    with zipfile.ZipFile(path) as archive:
        for member in archive.infolist():
            if member.CRC == 0:
                continue
            try:
                with archive.open(member) as data:
                    while data.read(1 << 20):  # the CRC-32 is checked at the end
                        pass
            except zipfile.BadZipFile:
                raise ValueError(f"{member.filename} fails its CRC-32 check: the file is "
                                 "damaged") from None


def save_checkpoint(directory: Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically, then keep only the newest.

    Temporary files of earlier saves that were killed mid-write are deleted first: nothing else
    would ever remove them, and each can be as large as a checkpoint. This assumes that no other
    process saves into ``directory`` at the same time (each rank has its own).

    Args:
        directory: Where checkpoints live (created if needed).
        step: The training step the state was taken after; names the file.
        state: What to save; only types ``weights_only`` loading accepts (module docstring).
        keep: How many of the newest checkpoints to keep (>= 1).

    Returns:
        The path of the new checkpoint.

    Raises:
        ValueError: ``step`` < 0 or ``keep`` < 1.
        TypeError: ``state`` holds a type ``weights_only`` loading refuses (named).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    check_weights_only(state)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.iterdir():
        if _TEMPORARY.match(stale.name):
            stale.unlink(missing_ok=True)
    final = checkpoint_path(directory, step)
    fd, name = tempfile.mkstemp(dir=directory, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(name, final)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    for old in list_checkpoints(directory)[:-keep]:
        if old != final:  # below newer ones (left by another run): never the one just written
            old.unlink(missing_ok=True)
    return final


def require_same_config(saved: dict[str, Any] | None, config: dict[str, Any],
                        directory: Path, *, fix: str, ignore: tuple[str, ...] = (),
                        together: bool = True) -> None:
    """Refuse to continue from a checkpoint that a run of other settings saved.

    Resuming it under ``config`` would train on with the old settings (or mix the two) and label
    the result with the new ones. Both are compared as the results file records them (secrets
    redacted, infinities as null, tuples as lists).

    Args:
        saved: The configuration the checkpoint's run recorded (None: not recorded, accepted).
        config: This run's configuration.
        directory: Where the checkpoint was found (named in the error).
        fix: What the user can do instead, ending the error message.
        ignore: Keys that may differ (when to stop, not what to train).
        together: Every rank of a distributed run makes this same check at this point (it
            then waits for the others before refusing); False where only some may.

    Raises:
        CheckpointError: naming up to five settings that differ, with both values.
    """
    if saved is None:
        return
    now = json.loads(json.dumps(finite_or_none(scrub_secrets(dict(config))), default=str))
    saved = json.loads(json.dumps(finite_or_none(saved), default=str))
    differ = sorted(k for k in saved.keys() | now.keys()
                    if k not in ignore and saved.get(k) != now.get(k))
    if differ:
        shown = "; ".join(f"{k}: {saved.get(k)!r} saved, {now.get(k)!r} now" for k in differ[:5])
        if together and dist.is_available() and dist.is_initialized():
            # Every rank compares the same settings and refuses alike: they leave together, so
            # none tears its group down while another's gloo threads still run (an abort).
            dist.barrier()
        raise CheckpointError(f"the checkpoint in {directory} was saved by a run with other "
                              f"settings ({shown}); {fix}")


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint file was taken after, read from its name.

    Raises:
        ValueError: ``path`` is not named like a checkpoint.
    """
    match = _NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named checkpoint-<step>.pt")
    return int(match.group(1))


def load_newest_checkpoint(directory: Path, map_location: str | torch.device = "cpu", *,
                           at_most: int | None = None) -> tuple[int, dict] | None:
    """Load the newest readable checkpoint in ``directory`` (of a step <= ``at_most``).

    A newer file that cannot be read (truncated, corrupt, bytes that fail the archive's CRC-32,
    not a dict, or holding objects that ``weights_only`` loading refuses, such as pickled
    callables) produces a warning naming it, and the next older one is tried.

    Args:
        directory: Where :func:`save_checkpoint` wrote.
        map_location: Where tensors are loaded to.
        at_most: Ignore checkpoints of later steps (None: consider all).

    Returns:
        ``(step, state)``, or None when the directory holds no (eligible) checkpoint at all.

    Raises:
        CheckpointError: eligible checkpoints exist but none can be read; the message names each
            file, why it failed, and what to do.
    """
    failures: list[str] = []
    for path in reversed(list_checkpoints(directory)):
        step = checkpoint_step(path)
        if at_most is not None and step > at_most:
            continue
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
            if not isinstance(state, dict):
                raise TypeError(f"holds a {type(state).__name__}, not a dict")
            _check_crc(path)
        except Exception as exc:  # noqa: BLE001 - any failure means "this file is unusable"
            reason = f"{type(exc).__name__}: {_reason(exc)}"
            failures.append(f"{path} ({reason})")
            warnings.warn(f"checkpoint {path} cannot be loaded ({reason}); trying the previous "
                          "one", RuntimeWarning, stacklevel=2)
            continue
        return step, state
    if failures:
        raise CheckpointError(f"no checkpoint in {directory} can be loaded: "
                              + "; ".join(failures) + "; restore them from a copy to continue the "
                              "run, or move them away (or pass another run directory) to start "
                              "afresh")
    return None


def load_latest_checkpoint(directory: Path, map_location: str | torch.device = "cpu"
                           ) -> dict | None:
    """The state of :func:`load_newest_checkpoint` (None when there is no checkpoint).

    Raises:
        CheckpointError: checkpoints exist but none can be read (each file named).
    """
    found = load_newest_checkpoint(directory, map_location)
    return None if found is None else found[1]


def _distributed() -> bool:
    """Whether this process belongs to a process group."""
    return dist.is_available() and dist.is_initialized()


def _newest_usable(directory: Path, map_location: str | torch.device, at_most: int | None,
                   world_size: int, fix: str) -> tuple[int, dict | None, CheckpointError | None]:
    """This rank's newest readable checkpoint (of a step <= ``at_most``) that a run of
    ``world_size`` processes can continue.

    Returns:
        ``(step, state, None)``; ``(-1, None, None)`` when there is no checkpoint; ``(-1, None,
        error)`` when none can be read or the newest was saved by another world size.
    """
    try:
        found = load_newest_checkpoint(directory, map_location, at_most=at_most)
    except CheckpointError as exc:
        return -1, None, exc
    if found is None:
        return -1, None, None
    step, state = found
    saved = state.get("world_size")
    if saved is not None and saved != world_size:
        return -1, None, CheckpointError(
            f"the checkpoint {checkpoint_path(directory, step)} was saved by a run of world size "
            f"{saved}, not {world_size} like this one (each rank's state depends on it): resume "
            f"with world size {saved}, or {fix}")
    return step, state, None


def _agree(step: int, error: CheckpointError | None, device: str | torch.device) -> int:
    """The smallest ``step`` of all ranks, or the error of the lowest rank that has one, raised
    on every rank.

    Every rank takes part, also one whose own load failed: raising there alone would leave the
    others waiting in the collective until its process group went away, and they would fail
    with a lost gloo connection instead of the message. Without a process group: ``step``, or
    ``error`` raised.

    Raises:
        CheckpointError: some rank has ``error`` (the lowest such rank's message, on every rank).
    """
    if not _distributed():
        if error is not None:
            raise error
        return step
    world_size = dist.get_world_size()
    values = torch.tensor([step, world_size if error is None else dist.get_rank()],
                          dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    lowest, failed = values.tolist()
    if failed < world_size:
        message = [None if error is None else str(error)]
        dist.broadcast_object_list(message, src=failed)
        raise CheckpointError(message[0])
    return lowest


def load_agreed_checkpoint(directory: Path, map_location: str | torch.device = "cpu", *,
                           fix: str = "start afresh in another output directory"
                           ) -> dict | None:
    """This rank's readable checkpoint of the newest step that every rank can load.

    Every rank of the process group calls this with its own directory. Ranks save one after the
    other, and a file may be damaged, so the newest readable step can differ between ranks; all
    ranks then step back until they agree. A state's ``world_size`` entry, where it has one, is
    the number of processes that saved it: a run of another world size cannot continue it (its
    ranks would start afresh, or a rank would load another rank's state, and overwrite the
    checkpoints), so every rank raises instead. Without a process group this is
    :func:`load_latest_checkpoint` for a world size of 1.

    Args:
        directory: This rank's checkpoint directory.
        map_location: Where tensors are loaded to (this rank's device, which the collective
            also uses).
        fix: What else the user can do when the world size differs, ending that error message
            (after "resume with world size <saved>, or").

    Returns:
        The state, or None when some rank has no usable checkpoint (all start afresh).

    Raises:
        CheckpointError: on every rank alike, with the message of the lowest rank whose
            checkpoints of the agreed step and older cannot be read, or whose newest checkpoint
            a run of another world size saved.
    """
    world_size = dist.get_world_size() if _distributed() else 1
    step, state, error = _newest_usable(directory, map_location, None, world_size, fix)
    agreed = _agree(step, error, map_location)
    while True:
        if step > agreed:
            step, state, error = _newest_usable(directory, map_location, agreed, world_size, fix)
        lowest = _agree(step, error, map_location)
        if lowest == agreed:  # every step is <= agreed and the smallest equals it: all agree
            return state
        agreed = lowest
