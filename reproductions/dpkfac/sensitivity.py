"""Damping × update-interval sensitivity of MPD-KFAC (eigen) and DP-KFAC (eigen-DP) (D6).

    python -m reproductions.dpkfac.sensitivity                  # the grid, ~35 min on 2 cores
    python -m reproductions.dpkfac.sensitivity --tables-only    # the table from results files
    python -m reproductions.dpkfac.sensitivity --quick          # 2 cells, 3 steps, ~30 s
    python -m reproductions.dpkfac.sensitivity --damping 0.01 0.1 --interval 1 100  # grows it

The DP-KFAC code's ``batch-hyper.sh`` sweeps damping ∈ {0.005, 0.01, 0.05, 0.1} × update
frequency ∈ {1, 10, 50, 100} on ResNet-110/CIFAR-10 for ``eigen`` against ``eigen_dp``
(PAPERS.md §4.3); the paper's values are not available. This is that sweep in small form: each
cell trains the Fashion-MNIST CNN of :mod:`reproductions.dpkfac.train` with that module's own
code path (:func:`~reproductions.dpkfac.train.main`, a generated config per cell), both schemes
in one launch of the same gloo workers, the update interval setting the factor and the
eigendecomposition intervals together as the script's update frequency does. The defaults
(:data:`GRID_CHOICE` says why): damping ∈ {0.003, 0.01, 0.03, 0.1, 0.3}, interval ∈
{1, 10, 50, 100}, 2 workers × 32 images, one epoch (937 steps, so the cosine schedule ends and
the epoch-end evaluation runs), seed 0; and one SGD run under the same settings as a reference.

Writes under ``results/sensitivity/``: one ``kfac-repro/results/v1`` file per run
(``fmnist-d<damping>-i<interval>-<optimizer>.json``), ``grid.json`` (the grid, the settings and
each launch's wall time or error); D6 goes into the paper's ``results/tables.json`` beside its
other tables (into ``<out>/tables.json`` for another ``--out``); prints the table. Run the same
command again to finish an interrupted grid: finished runs of the same settings are skipped, an
interrupted one resumes from its checkpoints under ``--run-dir``; other damping or interval values
under the same settings add rows to the grid. ``--quick`` writes under
``runs/dpkfac/sensitivity-quick`` unless ``--out`` says otherwise, never over the committed grid.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import mean
from typing import Any

from data.atomic import atomic_path
from data.paths import add_data_dir_argument
from reproductions.common.cli import float_in, positive_int
from reproductions.common.results import ResultsError, load_results, utc_now
from reproductions.common.tables import Table, update_tables
from reproductions.common.tracking import add_wandb_argument
from reproductions.dpkfac.train import HERE, PAPER, TrainConfig
from reproductions.dpkfac.train import main as train_main

SENSITIVITY_DIR = HERE / "results" / "sensitivity"
GRID_FILE = "grid.json"
GRID_SCHEMA = "kfac-repro/dpkfac-sensitivity/v1"
TABLE_ID = "D6"

SCHEMES = ("mpd-kfac", "dp-kfac")
"""The compared optimizers of :data:`reproductions.dpkfac.train.OPTIMIZERS`."""
LABELS = {"mpd-kfac": "MPD-KFAC", "dp-kfac": "DP-KFAC", "sgd": "SGD"}

DAMPINGS = (0.003, 0.01, 0.03, 0.1, 0.3)
INTERVALS = (1, 10, 50, 100)
WORKERS = 2
BASE = TrainConfig(experiment="fmnist", epochs=1)
"""Every cell's settings but damping and intervals: train.py's defaults for one epoch."""
GRID_CHOICE = (
    "The grid was sized to about 45 minutes of a shared 2-core machine (D5's 2-epoch runs at 4 "
    "workers took 300–590 s each with the code of 2026-11-30): 2 workers, one per core (4 "
    "oversubscribe it), and one epoch, "
    "the shortest run that reaches train.py's evaluation and the end of its cosine schedule. "
    "One cell of each scheme, timed first (60 steps, 2 workers, quiet machine), took "
    "0.13–0.15 s per step at interval 1 and 0.05 s at interval 10, so 20 cells × 2 schemes and "
    "the SGD run came to 35 minutes (18 for damping 0.003/0.03/0.3 × interval 1/10/50, then 11 "
    "for damping 0.01 and interval 100, 6 for damping 0.1). Damping spans half-decades around "
    "D5's 0.03 and holds the script's 0.01 and 0.1; the intervals are the script's.")
"""Why the default grid is this size (in the table's notes when the default grid is shown)."""

QUICK_DAMPINGS = (0.03,)
QUICK_INTERVALS = (1, 2)
QUICK_BASE = replace(BASE, max_steps=3, test_examples=200)

PAPER_CELL = "not published"
PAPER_SOURCE = ("The paper's sensitivity values are not available (PAPERS.md §4.3–4.4): only its "
                "code's `batch-hyper.sh` grid is known, damping ∈ {0.005, 0.01, 0.05, 0.1} × "
                "update frequency ∈ {1, 10, 50, 100} for `eigen` vs `eigen_dp` on "
                "ResNet-110/CIFAR-10, so the paper column has no numbers.")

LAST_FRACTION = 0.1
"""The final training loss is the mean over this last fraction of the steps (at least one)."""
CHANCE_LOSS = math.log(10)
"""Cross-entropy of a uniform guess over the 10 classes (an untrained model's loss)."""


def experiment_name(base: str, damping: float, interval: int) -> str:
    """The experiment (and results-file stem) of one cell, e.g. ``fmnist-d0.03-i10``."""
    return f"{base}-d{damping:g}-i{interval}"


def cell_config(base: TrainConfig, damping: float, interval: int) -> TrainConfig:
    """``base`` with this cell's damping, and factor and inverse intervals both ``interval``."""
    return replace(base, experiment=experiment_name(base.experiment, damping, interval),
                   damping=damping, factor_update_steps=interval, inv_update_steps=interval)


def reference_config(base: TrainConfig) -> TrainConfig:
    """The SGD reference run's settings (damping and intervals unused)."""
    return replace(base, experiment=f"{base.experiment}-reference")


def results_file(out: Path, config: TrainConfig, optimizer: str) -> Path:
    """Where :func:`reproductions.dpkfac.train.train_one` writes this run's results."""
    return Path(out) / f"{config.experiment}-{optimizer}.json"


def _done(path: Path, config: TrainConfig, optimizer: str, workers: int) -> bool:
    """Whether ``path`` holds a finished run of exactly these settings."""
    try:
        run = load_results(path)
    except ResultsError:
        return False
    want = asdict(config) | {"optimizer": optimizer, "world_size": workers}
    return bool(run["finished"]) and all(run["config"].get(k) == v for k, v in want.items())


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class Launch:
    """One call of train.py's ``main``: one cell's (or the reference's) optimizers in turn."""

    config: TrainConfig
    optimizers: tuple[str, ...]
    damping: float | None = None
    interval: int | None = None


def run_grid(dampings: Sequence[float], intervals: Sequence[int], *, base: TrainConfig,
             workers: int, out: Path, run_dir: Path, schemes: Sequence[str] = SCHEMES,
             reference: bool = True, data_dir: str | None = None, wandb: str = "auto",
             log: Any = print) -> dict[str, Any]:
    """Train every cell (skipping finished runs of the same settings) and write ``grid.json``.

    A launch that fails (a worker crashed, e.g. on a non-finite factor) is recorded with its
    error in ``grid.json`` and the grid goes on; the table marks its runs.

    Returns:
        The ``grid.json`` object.
    """
    out = Path(out)
    launches = [Launch(cell_config(base, d, i), tuple(schemes), d, i)
                for d in dampings for i in intervals]
    if reference:
        launches.append(Launch(reference_config(base), ("sgd",)))
    grid: dict[str, Any] = {
        "schema": GRID_SCHEMA, "paper": PAPER, "dampings": list(dampings),
        "intervals": list(intervals), "schemes": list(schemes), "workers": workers,
        "base_config": asdict(base), "reference": (reference_config(base).experiment + "-sgd"
                                                   if reference else None),
        "started": utc_now(), "finished": None, "load_average_start": list(os.getloadavg()),
        "launches": []}
    grid_path = out / GRID_FILE
    previous = _read_grid(grid_path)
    earlier: dict[str, Any] = {}  # launches of an earlier command, kept where this one skips
    if previous is not None and all(previous[k] == grid[k] for k in (
            "base_config", "workers", "schemes")):  # a grid of the same settings grows
        grid["dampings"] = sorted(set(previous["dampings"]) | set(dampings))
        grid["intervals"] = sorted(set(previous["intervals"]) | set(intervals))
        grid["reference"] = grid["reference"] or previous.get("reference")
        again = {launch.config.experiment for launch in launches}
        earlier = {e.get("experiment"): e for e in previous.get("launches", [])}
        grid["launches"] = [e for name, e in earlier.items() if name not in again]
    _write_json(grid_path, grid)
    for n, launch in enumerate(launches, 1):
        todo = [o for o in launch.optimizers
                if not _done(results_file(out, launch.config, o), launch.config, o, workers)]
        entry = {"experiment": launch.config.experiment, "damping": launch.damping,
                 "interval": launch.interval, "optimizers": list(launch.optimizers),
                 "trained": todo, "wall_s": 0.0, "error": None}
        if not todo:
            log(f"[{n}/{len(launches)}] {launch.config.experiment}: done already, skipped")
            entry = earlier.get(launch.config.experiment, entry)
        else:
            log(f"[{n}/{len(launches)}] {launch.config.experiment}: {', '.join(todo)} …")
            config_file = run_dir / "configs" / f"{launch.config.experiment}.json"
            _write_json(config_file, asdict(launch.config))
            args = ["--optimizer", *todo, "--workers", str(workers), "--config",
                    str(config_file), "--out", str(out), "--run-dir", str(run_dir),
                    "--wandb", wandb]
            if data_dir is not None:
                args += ["--data-dir", data_dir]
            start = time.perf_counter()
            try:
                train_main(args)
            except SystemExit as exc:  # train.py's one-line user errors (already printed)
                entry["error"] = f"train.py exited with status {exc.code}"
            except Exception as exc:  # a crashed worker: record it, go on with the grid
                entry["error"] = (f"{type(exc).__name__}: "
                                  + (str(exc).strip().splitlines() or [""])[-1])[:300]
            entry["wall_s"] = round(time.perf_counter() - start, 1)
            log(f"    {entry['wall_s']:.0f} s" + (f"; failed: {entry['error']}"
                                                   if entry["error"] else ""))
        grid["launches"].append(entry)
        _write_json(grid_path, grid)
    grid["finished"] = utc_now()
    grid["load_average_end"] = list(os.getloadavg())
    _write_json(grid_path, grid)
    return grid


@dataclass(frozen=True)
class Outcome:
    """What one run of the grid gave (numbers None where it gave none).

    Attributes:
        status: ``"ok"``, ``"missing"``, ``"failed"``, ``"interrupted"``, ``"diverged"`` or
            ``"not evaluated"`` (stopped mid-epoch: train.py evaluates at epoch ends only).
        text: How a table cell says a status other than ``"ok"``.
    """

    status: str
    text: str = ""
    accuracy: float | None = None
    train_loss: float | None = None
    spikes: int | None = None
    seconds: float | None = None
    steps: int | None = None
    load: float | None = None


def final_train_loss(steps: Sequence[dict[str, Any]]) -> float | None:
    """Mean loss over the last :data:`LAST_FRACTION` of the steps (None if any is null)."""
    if not steps:
        return None
    tail = [s["loss"] for s in steps[-max(1, math.ceil(len(steps) * LAST_FRACTION)):]]
    return None if any(v is None for v in tail) else mean(tail)


def loss_spikes(steps: Sequence[dict[str, Any]]) -> int:
    """Steps after the first :data:`LAST_FRACTION` of the run whose training loss is above
    :data:`CHANCE_LOSS` (or not finite): a stable run has none once it has started learning."""
    return sum(s["loss"] is None or s["loss"] > CHANCE_LOSS
               for s in steps[int(len(steps) * LAST_FRACTION):])


def outcome(path: Path, error: str | None = None) -> Outcome:
    """Read one run's results file (``error``: its launch's failure, from ``grid.json``)."""
    if not path.exists():
        if error:
            return Outcome("failed", f"failed ({error})")
        return Outcome("missing", "missing (not run)")
    try:
        run = load_results(path)
    except ResultsError as err:
        return Outcome("missing", f"unreadable ({str(err).split(': ', 1)[-1][:80]})")
    steps = run["steps"]
    bad = next((s["step"] for s in steps if s["loss"] is None), None)
    evals = run["evals"]
    if bad is None and evals and evals[-1].get("test_loss") is None:
        bad = evals[-1]["step"]
    seconds = run["summary"].get("train_seconds")
    if seconds is None:
        seconds = sum(s["time_s"] for s in steps) if steps else None
    load = (run["hardware"].get("load_average") or [None])[0]
    common = {"seconds": seconds, "steps": len(steps), "spikes": loss_spikes(steps),
              "train_loss": final_train_loss(steps), "load": load}
    if bad is not None:
        return Outcome("diverged", f"diverged (non-finite at step {bad})", **common)
    if not run["finished"]:
        reason = f"; {error}" if error else ""
        return Outcome("interrupted", f"unfinished after {len(steps)} steps (interrupted or "
                       f"still running{reason})", **common)
    if not evals:
        return Outcome("not evaluated", f"not evaluated (stopped mid-epoch, {len(steps)} steps)",
                       **common)
    return Outcome("ok", accuracy=100.0 * evals[-1]["test_accuracy"], **common)


def _read_grid(path: Path) -> dict[str, Any] | None:
    """``grid.json`` as written by :func:`run_grid`; None when absent or not of that schema."""
    try:
        grid = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return grid if isinstance(grid, dict) and grid.get("schema") == GRID_SCHEMA else None


def _grid_from_files(results_dir: Path) -> dict[str, Any] | None:
    """The grid as the results files in ``results_dir`` show it (no ``grid.json``)."""
    dampings, intervals, base, workers = set(), set(), None, 1
    for path in results_dir.glob("*.json"):
        try:
            run = load_results(path)
        except ResultsError:
            continue
        config = run["config"]
        if run["optimizer"] not in SCHEMES:
            continue
        dampings.add(config["damping"])
        intervals.add(config["factor_update_steps"])
        base = base or {k: config.get(k) for k in asdict(BASE)} | {
            "experiment": config["experiment"].rsplit("-d", 1)[0]}
        workers = run["hardware"]["world_size"]
    if base is None:
        return None
    return {"dampings": sorted(dampings), "intervals": sorted(intervals), "schemes": list(SCHEMES),
            "workers": workers, "base_config": base, "launches": [],
            "reference": f"{base['experiment']}-reference-sgd"}


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} %"


def sensitivity_table(results_dir: Path = SENSITIVITY_DIR) -> Table:
    """D6 from the results files in ``results_dir`` (no training).

    Rows are the grid's (damping, interval) cells, from ``grid.json`` when present (else from
    the results files found); a run that is missing, failed, interrupted, diverged or stopped
    before an evaluation says so in its accuracy and loss cells instead of a number.
    """
    results_dir = Path(results_dir)
    grid = _read_grid(results_dir / GRID_FILE) or _grid_from_files(results_dir)
    columns = ["damping λ", "update interval (steps)", "paper",
               *(f"ours: {LABELS[s]} test accuracy (%)" for s in SCHEMES),
               "ours: DP − MPD (points)",
               *(f"ours: {LABELS[s]} final train loss" for s in SCHEMES),
               *(f"ours: {LABELS[s]} loss spikes (steps)" for s in SCHEMES),
               *(f"ours: {LABELS[s]} train time (s)" for s in SCHEMES)]
    title = "Damping × update-interval sensitivity: MPD-KFAC (eigen) vs DP-KFAC (eigen-DP)"
    if grid is None:
        return Table(TABLE_ID, title, "small", columns, [],
                     f"No results in {results_dir} yet: run `python -m "
                     f"reproductions.dpkfac.sensitivity` first. {PAPER_SOURCE}")
    base = grid["base_config"]
    errors = {e["experiment"]: e["error"] for e in grid.get("launches", []) if e.get("error")}
    rows, found, loads = [], {s: [] for s in SCHEMES}, []
    for damping in grid["dampings"]:
        for interval in grid["intervals"]:
            name = experiment_name(base["experiment"], damping, interval)
            got = {s: (outcome(results_dir / f"{name}-{s}.json", errors.get(name))
                       if s in grid["schemes"] else Outcome("missing", "missing (not run)"))
                   for s in SCHEMES}
            for s, o in got.items():
                if o.load is not None:
                    loads.append(o.load)
                if o.status == "ok":
                    found[s].append((damping, interval, o.accuracy))
            accuracy = [got[s].accuracy if got[s].status == "ok" else got[s].text
                        for s in SCHEMES]
            dp, mpd = got["dp-kfac"], got["mpd-kfac"]
            difference = (dp.accuracy - mpd.accuracy
                          if dp.status == mpd.status == "ok" else None)
            losses = [got[s].train_loss if got[s].status in ("ok", "not evaluated")
                      else got[s].text for s in SCHEMES]
            rows.append([damping, interval, PAPER_CELL, *accuracy, difference, *losses,
                         *(got[s].spikes for s in SCHEMES), *(got[s].seconds for s in SCHEMES)])
    return Table(TABLE_ID, title, "small", columns, rows,
                 _notes(grid, results_dir, found, loads))


def _notes(grid: dict[str, Any], results_dir: Path,
           found: dict[str, list[tuple[float, int, float]]], loads: list[float]) -> str:
    base = grid["base_config"]
    workers = grid["workers"]
    length = (f"{base['max_steps']} steps" if base.get("max_steps")
              else f"{base['epochs']} epoch{'s' if base['epochs'] > 1 else ''}")
    text = (f"Fashion-MNIST CNN of `train.py`, {workers} gloo workers × {base['batch_size']} "
            f"images, {length}, seed {base['seed']}, one run per cell; lr {base['lr']} (cosine), "
            f"momentum {base['momentum']}, KL clip {base['kl_clip']}, factor decay "
            f"{base['factor_decay']} (the code's stat_decay 0.95), eigendecompositions, the "
            "DP-KFAC code's factor scaling; the update interval sets the factor and the "
            "eigendecomposition intervals together (the script's update frequency). MPD-KFAC is "
            "train.py's `mpd-kfac`: it all-reduces the factors and eigendecomposes them, the "
            "arithmetic of the code's `eigen` (only which worker decomposes which factor "
            "differs), so every worker's factors come from all "
            f"{workers * base['batch_size']} images; DP-KFAC builds each layer's factors on its "
            f"owner from that worker's {base['batch_size']} images only. Test accuracy is the "
            "epoch-end evaluation on the 10,000 test images"
            + (f" (first {base['test_examples']})" if base.get("test_examples") else "")
            + f"; final train loss the mean over the last {LAST_FRACTION:.0%} of the steps; "
            f"loss spikes the steps after the first {LAST_FRACTION:.0%} whose training loss was "
            f"above ln 10 = {CHANCE_LOSS:.2f}, an untrained model's (0 or 1 in a stable run); "
            "train time the summed step times"
            + (f" ({workers} processes on CPU cores shared with other jobs: 1-minute load "
               f"average {min(loads):.1f}–{max(loads):.1f} at the runs' starts, so times "
               "compare only roughly)" if loads else "")
            + ". A run that is missing, failed, interrupted or "
            "diverged (a non-finite loss) says so in its cells. " + PAPER_SOURCE)
    if base == asdict(BASE) and workers == WORKERS and set(grid["dampings"]) == set(DAMPINGS) \
            and set(grid["intervals"]) == set(INTERVALS):
        text += " " + GRID_CHOICE
    for s in SCHEMES:
        if len(found[s]) > 1:
            values = [a for *_, a in found[s]]
            best = max(found[s], key=lambda c: c[2])
            worst = min(found[s], key=lambda c: c[2])
            text += (f" {LABELS[s]}: {min(values):.1f}–{max(values):.1f} % over "
                     f"{len(values)} cells (best λ = {best[0]:g}, interval {best[1]}; worst "
                     f"λ = {worst[0]:g}, interval {worst[1]}).")
    reference = grid.get("reference")
    if reference:
        ref = outcome(results_dir / f"{reference}.json")
        if ref.status == "ok":
            text += (f" SGD under the same settings (`{reference}.json`): "
                     f"{_percent(ref.accuracy)}, final train loss {ref.train_loss:.3f}.")
        else:
            text += f" SGD reference under the same settings: {ref.text}."
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--damping", nargs="+", type=float_in(0.0, low_inclusive=False),
                        help=f"damping values (default {' '.join(map(str, DAMPINGS))}; "
                             f"quick {' '.join(map(str, QUICK_DAMPINGS))})")
    parser.add_argument("--interval", nargs="+", type=positive_int,
                        help="update intervals, factors and eigendecompositions together "
                             f"(default {' '.join(map(str, INTERVALS))}; quick "
                             f"{' '.join(map(str, QUICK_INTERVALS))})")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--workers", type=positive_int, default=WORKERS)
    parser.add_argument("--epochs", type=positive_int, help="default 1")
    parser.add_argument("--max-steps", type=positive_int,
                        help="stop each run after this many steps (no test evaluation unless "
                             "at an epoch's end)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the SGD run under the same settings")
    parser.add_argument("--quick", action="store_true",
                        help=f"damping {QUICK_DAMPINGS}, intervals {QUICK_INTERVALS}, "
                             f"{QUICK_BASE.max_steps} steps, {QUICK_BASE.test_examples} test "
                             "images, no SGD reference (for tests)")
    parser.add_argument("--tables-only", action="store_true",
                        help="build the table from the results files, train nothing")
    parser.add_argument("--out", type=Path,
                        help="results files and grid.json (default results/sensitivity; quick: "
                             "runs/dpkfac/sensitivity-quick/results)")
    parser.add_argument("--run-dir", type=Path,
                        help="checkpoints, generated configs and W&B files (default "
                             "runs/dpkfac/sensitivity; quick: runs/dpkfac/sensitivity-quick)")
    add_data_dir_argument(parser)
    add_wandb_argument(parser)
    args = parser.parse_args(argv)

    quick_dir = Path("runs") / PAPER / "sensitivity-quick"
    if args.out is None:  # a quick grid never replaces the committed one
        args.out = quick_dir / "results" if args.quick else SENSITIVITY_DIR
    if args.run_dir is None:
        args.run_dir = quick_dir if args.quick else Path("runs") / PAPER / "sensitivity"
    start = time.perf_counter()
    if not args.tables_only:
        base = QUICK_BASE if args.quick else BASE
        overrides = {k: v for k, v in (("epochs", args.epochs), ("max_steps", args.max_steps))
                     if v is not None}
        run_grid(args.damping or (QUICK_DAMPINGS if args.quick else DAMPINGS),
                 args.interval or (QUICK_INTERVALS if args.quick else INTERVALS),
                 base=replace(base, **overrides), workers=args.workers, out=args.out,
                 run_dir=args.run_dir, schemes=args.schemes,
                 reference=not (args.no_reference or args.quick), data_dir=args.data_dir,
                 wandb=args.wandb)
    table = sensitivity_table(args.out)
    print()
    print(table.markdown())
    if table.rows:
        tables = (HERE / "results" / "tables.json" if args.out == SENSITIVITY_DIR
                  else args.out / "tables.json")
        update_tables(tables, PAPER, [table])
        print(f"\nWrote {tables} in {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()
