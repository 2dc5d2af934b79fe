"""One results file per run, in one schema for every reproduction (``kfac-repro/results/v1``).

The schema is documented field by field in ``reproductions/common/README.md``; in short::

    {"schema": "kfac-repro/results/v1", "paper": str, "experiment": str, "optimizer": str,
     "config": {...}, "git_revision": str | null,
     "hardware": {"cpu": str, "threads": int, "torch": str, "cuda": str | null,
                  "world_size": int, ...},
     "started": ISO-8601, "finished": ISO-8601 | null,
     "steps": [{"step": int, "loss": number, "time_s": number, "lr": number, ...}, ...],
     "evals": [{"step": int, ...}, ...],
     "optimizer_stage_time_s": {stage: seconds}, "ledger": {...} | null, "memory": {...},
     "summary": {...}, "wandb": {"project", "group", "name", "id", "mode"} | null}

:class:`RunRecorder` builds such a file during a run and writes it atomically (so it can be
rewritten at every checkpoint); :func:`load_results` reads one back and validates it, with errors
that name the file and the offending field.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from reproductions.common.scrub import scrub_secrets

SCHEMA = "kfac-repro/results/v1"
"""The ``schema`` field's value; changes whenever a field's meaning changes."""

RESULTS_FIX = ("restore the file from git (`git checkout -- <file>`) or rerun the run that "
               "writes it (the reproduction's README gives the command)")
"""How to get a good results file back, in the messages of :func:`load_results`."""

REPO_ROOT = Path(__file__).resolve().parents[2]

_REQUIRED_STEP_FIELDS = ("step", "loss", "time_s")
_WANDB_FIELDS = ("project", "group", "name", "id", "mode")
_HARDWARE_FIELDS = {"cpu": str, "threads": int, "torch": str, "world_size": int}
_UPDATABLE = ("config", "git_revision", "hardware", "finished", "optimizer_stage_time_s",
              "ledger", "memory", "summary", "wandb")


class ResultsError(ValueError):
    """A results file is missing, unreadable or does not follow the schema (message says which
    file and which field)."""


def utc_now() -> str:
    """The current time as an ISO-8601 UTC timestamp with seconds, e.g. ``2026-11-30T02:30:00Z``.
    """
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_revision(repo: Path = REPO_ROOT) -> str | None:
    """The checked-out commit, with ``-dirty`` when tracked files have uncommitted changes.

    Args:
        repo: A directory inside the git work tree.

    Returns:
        ``"<40 hex>"`` or ``"<40 hex>-dirty"``; None when git or the repository is unavailable.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        revision = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{revision}-dirty" if dirty else revision


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info(world_size: int = 1, device: torch.device | str | None = None
                  ) -> dict[str, Any]:
    """What the run ran on, for the ``hardware`` field.

    Args:
        world_size: Number of processes in the run.
        device: The run's device; a CUDA device is named, anything else gives ``cuda: null``.

    Returns:
        ``{"cpu", "cpu_count", "threads", "torch", "cuda", "world_size", "load_average"}``;
        ``cuda`` is the GPU model (e.g. ``"NVIDIA A100-SXM4-40GB"``) or None on a CPU run;
        ``load_average`` is the 1/5/15-minute system load when recorded (timings taken on a
        busy machine are not comparable with an idle one's).
    """
    dev = torch.device(device) if device is not None else None
    cuda = (torch.cuda.get_device_name(dev) if dev is not None and dev.type == "cuda"
            and torch.cuda.is_available() else None)
    return {"cpu": _cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": str(torch.__version__), "cuda": cuda, "world_size": world_size,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _json_number(value: Any) -> Any:
    """Numbers as floats, with NaN and infinities as None (strict JSON has neither)."""
    if _is_number(value):
        return float(value) if math.isfinite(value) else None
    return value


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinity inside it (in objects and lists too) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def _is_finite_number(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def _check_entries(entries: Any, name: str, required: tuple[str, ...], first_index: int = 0
                   ) -> None:
    if not isinstance(entries, list):
        raise ResultsError(f"field '{name}' must be a list, got {type(entries).__name__}")
    last = -1
    for index, entry in enumerate(entries, start=first_index):
        where = f"{name}[{index}]"
        if not isinstance(entry, dict):
            raise ResultsError(f"field '{where}' must be an object")
        for key in required:
            if key not in entry:
                raise ResultsError(f"field '{where}' lacks '{key}'")
        step = entry["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ResultsError(f"field '{where}.step' must be an integer >= 0, got {step!r}")
        if step <= last:
            raise ResultsError(f"field '{where}.step' is {step}, not after the previous {last}")
        last = step
        for key, value in entry.items():
            if key != "step" and not (_is_finite_number(value) or value is None):
                raise ResultsError(f"field '{where}.{key}' must be a finite number or null, "
                                   f"got {value!r}")
        if "time_s" in required and not (_is_finite_number(entry["time_s"])
                                         and entry["time_s"] >= 0):
            raise ResultsError(f"field '{where}.time_s' must be a finite number >= 0, got "
                               f"{entry['time_s']!r}")


def validate_results(data: Any) -> None:
    """Check a results object against the schema.

    Args:
        data: A parsed results file.

    Raises:
        ResultsError: naming the first missing or ill-typed field (e.g. ``steps[3].loss``).
    """
    if not isinstance(data, dict):
        raise ResultsError(f"a results file holds a JSON object, not {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ResultsError(f"field 'schema' must be {SCHEMA!r}, got {data.get('schema')!r}")
    for key in ("paper", "experiment", "optimizer", "started"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ResultsError(f"field '{key}' must be a non-empty string, got {data.get(key)!r}")
    for key in ("git_revision", "finished", "ledger", "wandb"):
        if key not in data:
            raise ResultsError(f"field '{key}' is missing")
    for key in ("git_revision", "finished"):
        if not isinstance(data[key], str | None):
            raise ResultsError(f"field '{key}' must be a string or null, got {data[key]!r}")
    for key in ("config", "hardware", "optimizer_stage_time_s", "memory", "summary"):
        if not isinstance(data.get(key), dict):
            raise ResultsError(f"field '{key}' must be an object, got {data.get(key)!r}")
    for key, kind in _HARDWARE_FIELDS.items():
        value = data["hardware"].get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ResultsError(f"field 'hardware.{key}' must be a {kind.__name__}, "
                               f"got {data['hardware'].get(key)!r}")
    if not isinstance(data["hardware"].get("cuda", 0), str | type(None)):
        raise ResultsError("field 'hardware.cuda' must be the GPU's name or null")
    _check_entries(data.get("steps"), "steps", _REQUIRED_STEP_FIELDS)
    _check_entries(data.get("evals"), "evals", ("step",))
    for stage, seconds in data["optimizer_stage_time_s"].items():
        if not _is_finite_number(seconds):
            raise ResultsError(f"field 'optimizer_stage_time_s.{stage}' must be a finite "
                               f"number, got {seconds!r}")
    if not isinstance(data["ledger"], dict | None):
        raise ResultsError("field 'ledger' must be an object or null")
    wandb = data["wandb"]
    if wandb is not None and (not isinstance(wandb, dict)
                              or any(k not in wandb for k in _WANDB_FIELDS)):
        raise ResultsError(f"field 'wandb' must be null or an object with "
                           f"{', '.join(_WANDB_FIELDS)}, got {wandb!r}")


def load_results(path: Path) -> dict[str, Any]:
    """Read and validate a results file.

    Args:
        path: A JSON file written by :meth:`RunRecorder.write`.

    Returns:
        The parsed results.

    Raises:
        ResultsError: the file is missing, empty, not JSON, or not in the schema; the message
            starts with the path and ends with the fix.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such results file. Fix: {RESULTS_FIX}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot be read ({exc}). Fix: {RESULTS_FIX}") from None
    if not text.strip():
        raise ResultsError(f"{path}: the results file is empty. Fix: {RESULTS_FIX}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: "
                           f"{exc.msg}); the file is truncated or corrupt. Fix: "
                           f"{RESULTS_FIX}") from None
    try:
        validate_results(data)
    except ResultsError as exc:
        raise ResultsError(f"{path}: {exc}") from None
    return data


def earlier_results(path: Path) -> dict[str, Any] | None:
    """What a run being resumed wrote to ``path``, or None if it wrote nothing readable.

    A file that cannot be read (cut short by a full disk, edited by hand) is passed over with
    a warning: the run's newest checkpoint holds its results up to that step, and the resumed
    run writes the file again. :data:`RESULTS_FIX` does not apply to a run's own output,
    which git does not keep, and rerunning without ``--resume`` would drop its checkpoints.
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        return load_results(path)
    except ResultsError as err:
        problem = str(err).removesuffix(f" Fix: {RESULTS_FIX}").rstrip(".")
        warnings.warn(f"{problem}; the run continues from its newest checkpoint, which holds "
                      "its results, and writes the file again", stacklevel=2)
        return None


def check_comparable(runs: Sequence[tuple[Path, dict[str, Any]]], *, free: Iterable[str],
                     compares: str) -> None:
    """Refuse runs that a table would present as one comparison but were not made alike: an
    unfinished run (its last steps missing), or one whose configuration differs from the
    first run's in a field outside ``free`` (the fields the runs are meant to differ in, such
    as the optimizer).

    Args:
        runs: ``(path, results)`` pairs, as :func:`load_results` read them.
        free: Configuration fields allowed to differ.
        compares: What the table compares, for the message (e.g. ``"M3"``).

    Raises:
        ResultsError: naming the file, the field and the fix.
    """
    free = set(free)
    for path, run in runs:
        if run.get("finished") is None:
            raise ResultsError(f"{path}: an unfinished run; {compares} compares finished runs: "
                               "resume it, or move it out of the results directory")
    if not runs:
        return
    first_path, first = runs[0]
    for path, run in runs[1:]:
        keys = (set(first["config"]) | set(run["config"])) - free
        for key in sorted(keys):
            if first["config"].get(key) != run["config"].get(key):
                raise ResultsError(
                    f"{path}: made with {key}={run['config'].get(key)!r}, {first_path} with "
                    f"{first['config'].get(key)!r}; {compares} compares runs of one "
                    "configuration: rerun one of them alike, or keep the two in separate "
                    "results directories")


def _write_json_atomic(path: Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, allow_nan=False)  # strict JSON
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(name, 0o644)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return path


class RunRecorder:
    """Collects one run's results in the schema and writes them.

    Args:
        paper: The reproduction (``"mkor"``, ``"osawa2018"``, ``"dpkfac"``).
        experiment: The experiment or config name (``"default"``, ``"bert_large_phase2"``).
        optimizer: The optimizer's name as the run was launched with.
        config: The run's full configuration; secret-named entries are redacted, and
            infinities (``threshold=-inf``: never switch) recorded as null, as JSON has none.
        world_size: Processes in the run (for ``hardware``).
        device: The run's device (for ``hardware.cuda``).

    Attributes:
        data: The results object being built (a plain JSON-compatible dict).
    """

    def __init__(self, *, paper: str, experiment: str, optimizer: str, config: Mapping[str, Any],
                 world_size: int = 1, device: torch.device | str | None = None) -> None:
        self.data: dict[str, Any] = {
            "schema": SCHEMA, "paper": paper, "experiment": experiment, "optimizer": optimizer,
            "config": finite_or_none(scrub_secrets(dict(config))),
            "git_revision": git_revision(),
            "hardware": hardware_info(world_size, device), "started": utc_now(),
            "finished": None, "steps": [], "evals": [], "optimizer_stage_time_s": {},
            "ledger": None, "memory": {}, "summary": {}, "wandb": None,
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any],
                  config: Mapping[str, Any] | None = None) -> RunRecorder:
        """Continue recording into an existing results object (e.g. restored from a checkpoint).

        Args:
            data: The results so far.
            config: The settings of the run continuing them, recorded in place of those
                saved (a resumed run may differ in what its resume check lets differ, such
                as ``--stop-after`` or a checkpoint interval).

        Raises:
            ResultsError: ``data`` is not in the schema.
        """
        validate_results(data)
        recorder = cls.__new__(cls)
        recorder.data = json.loads(json.dumps(data))
        if config is not None:
            recorder.update(config=config)
        return recorder

    def log_step(self, step: int, **metrics: float | None) -> None:
        """Append one training step; ``loss`` and ``time_s`` (the step's seconds) are required.

        Raises:
            ResultsError: a required metric is missing, a value is not a number, or ``step``
                does not follow the previous one.
        """
        self._append("steps", step, metrics, _REQUIRED_STEP_FIELDS)

    def log_eval(self, step: int, **metrics: float | None) -> None:
        """Append one evaluation taken after ``step`` (numbers only)."""
        self._append("evals", step, metrics, ("step",))

    def _append(self, field: str, step: int, metrics: dict[str, Any],
                required: tuple[str, ...]) -> None:
        entry = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        previous = self.data[field][-1:]
        _check_entries([*previous, entry], field, required,
                       first_index=len(self.data[field]) - len(previous))
        self.data[field].append(entry)

    def update(self, **fields: Any) -> None:
        """Set top-level fields (``summary``, ``memory``, ``ledger``, ``finished``, ...).

        Raises:
            KeyError: a field that is not in the schema or is fixed at construction.
        """
        for key, value in fields.items():
            if key not in _UPDATABLE:
                raise KeyError(f"{key!r} is not an updatable results field; choose among "
                               + ", ".join(_UPDATABLE))
            self.data[key] = finite_or_none(scrub_secrets(value, by_name=key == "config"))

    def finish(self) -> None:
        """Stamp the ``finished`` time (a file without it is an interrupted run)."""
        self.data["finished"] = utc_now()

    def write(self, path: Path) -> Path:
        """Validate and write the results atomically (temporary file, fsync, rename).

        Returns:
            ``path``.
        """
        validate_results(self.data)
        return _write_json_atomic(path, self.data)

