"""The large-batch study in its small, honest form: K-FAC against momentum SGD on Fashion-MNIST.

For every batch size of the study config (256 … 16,384; batches above the micro-batch cap are
accumulated) and both optimizers, one ordinary training run
(``python -m reproductions.osawa2018.train``) with the study's per-batch-size settings. Runs are
independent processes (``--jobs`` at a time, one thread each), resume from their checkpoints when
the study is restarted, and skip runs that already finished. Each run's results file (schema
``kfac-repro/results/v1``) is copied to ``--results-dir`` and table O2 is printed from there.

    python -m reproductions.osawa2018.study            # the whole study (under an hour, 2 cores)
    python -m reproductions.osawa2018.study --quick    # batch 256 and 2,048, short (minutes)

The study config (``configs/fmnist_study.json``) holds: ``base`` (the train config the runs
start from), ``common`` (overrides for every run), ``max_micro_batch``, ``batch_sizes``,
``runs`` (per optimizer and batch size: overrides such as ``lr``, ``momentum``, ``damping``) and
``quick`` (a name, the batch sizes and the overrides of the quick subset).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ConfigError
from reproductions.common.checkpoint import require_same_config
from reproductions.common.cli import (
    exit_on_user_error,
    positive_int,
    read_json_file,
    writable_directory,
)
from reproductions.common.results import ResultsError, load_results
from reproductions.osawa2018.config import CONFIG_DIR, load_config
from reproductions.osawa2018.tables import large_batch_table

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class StudyRun:
    """One training run of the study."""

    name: str
    base: str
    overrides: dict[str, Any]

    def command(self, out: Path, wandb: str, data_dir: str | None) -> list[str]:
        """The ``train`` command line of this run (resuming from ``out`` when it exists)."""
        settings = [f"{key}={json.dumps(value)}" for key, value in self.overrides.items()]
        command = [sys.executable, "-m", "reproductions.osawa2018.train", "--config", self.base,
                   "--out", str(out), "--resume", "--no-progress", "--wandb", wandb]
        if data_dir is not None:
            command += ["--data-dir", data_dir]
        return command + ["--set", *settings]


def _run_settings(study: dict[str, Any], optimizer: str, batch: int) -> dict[str, Any]:
    """The study's overrides of ``optimizer`` at ``batch``.

    Raises:
        ConfigError: the study has no runs of ``optimizer`` (named as ``--optimizers``) or
            none at ``batch`` (named as ``--batch-sizes``, with the sizes it has).
    """
    runs = study["runs"]
    if optimizer not in runs:
        raise ConfigError("--optimizers", optimizer,
                          f"an optimizer of the study: {', '.join(runs)}")
    if str(batch) not in runs[optimizer]:
        raise ConfigError("--batch-sizes", batch, f"a batch size of the study's {optimizer} "
                          f"runs: {', '.join(runs[optimizer])}")
    return runs[optimizer][str(batch)]


def plan(study: dict[str, Any], *, quick: bool, batch_sizes: list[int] | None = None,
         optimizers: list[str] | None = None) -> tuple[str, list[StudyRun]]:
    """The study's name and runs, validated against the train configuration.

    Raises:
        ConfigError: a batch size or optimizer without settings in ``runs``, or a run's
            configuration is invalid (checked before anything starts).
    """
    name = study["quick"]["name"] if quick else study["name"]
    common = {**study["common"], **(study["quick"]["common"] if quick else {})}
    sizes = batch_sizes or (study["quick"]["batch_sizes"] if quick else study["batch_sizes"])
    runs = []
    for optimizer in optimizers or list(study["runs"]):
        for batch in sizes:
            overrides = {**common, "name": name, "optimizer": optimizer, "batch_size": batch,
                         "micro_batch_size": min(batch, study["max_micro_batch"]),
                         **_run_settings(study, optimizer, batch)}
            load_config(study["base"], overrides)
            runs.append(StudyRun(f"{optimizer}_bs{batch}", study["base"], overrides))
    return name, runs


def finished(run: StudyRun, out: Path) -> bool:
    """Whether ``out`` holds the results of ``run`` completed with the study's settings.

    Raises:
        CheckpointError: ``out`` holds a completed run of other settings (the study config was
            edited since): it would be reused under the new settings' name otherwise. Settings
            the saved run does not record (added to the configuration since) are not compared.
    """
    try:
        results = load_results(out / "results.json")
    except ResultsError:
        return False
    if results["finished"] is None:
        return False
    saved, now = results["config"], load_config(run.base, run.overrides).to_dict()
    require_same_config(saved, now, out, together=False, ignore=tuple(set(now) - set(saved)),
                        fix=f"delete {out} to run it again with the study's settings, or "
                            "restore the study config")
    return True


def execute(runs: list[StudyRun], out_root: Path, *, jobs: int, wandb: str,
            data_dir: str | None) -> list[str]:
    """Run what is not finished yet, ``jobs`` at a time; returns the names that failed.

    Raises:
        CheckpointError: a finished run's settings differ from the study's (see
            :func:`finished`); checked for every run before any starts.
    """
    pending = [run for run in runs if not finished(run, out_root / run.name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    active: list[tuple[StudyRun, subprocess.Popen[bytes], float]] = []
    failed: list[str] = []
    main_thread = threading.current_thread() is threading.main_thread()  # signals go there
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        _run_pending(pending, active, failed, out_root, jobs=jobs, env=env, wandb=wandb,
                     data_dir=data_dir)
    finally:
        try:
            _stop([process for _, process, _ in active])
        finally:
            if previous is not None:  # None: a handler not set from Python, left as it was
                signal.signal(signal.SIGTERM, previous)
    return failed


def _run_pending(pending: list[StudyRun],
                 active: list[tuple[StudyRun, subprocess.Popen[bytes], float]],
                 failed: list[str], out_root: Path, *, jobs: int, env: dict[str, str],
                 wandb: str, data_dir: str | None) -> None:
    """Start ``pending`` runs ``jobs`` at a time until all have ended, keeping ``active`` and
    ``failed`` up to date (the caller stops what is still active if this is interrupted)."""
    while pending or active:
        while pending and len(active) < jobs:
            run = pending.pop(0)
            out = out_root / run.name
            out.mkdir(parents=True, exist_ok=True)
            with (out / "train.log").open("ab") as log:  # the run writes to its own copy
                process = subprocess.Popen(run.command(out, wandb, data_dir), cwd=REPO,
                                           env=env, stdout=log, stderr=subprocess.STDOUT)
                active.append((run, process, time.perf_counter()))  # stopped if interrupted
            print(f"started {run.name} (log: {out / 'train.log'})", flush=True)
        time.sleep(1.0)
        for entry in list(active):
            run, process, started = entry
            if process.poll() is None:
                continue
            active.remove(entry)
            status = "done" if process.returncode == 0 else f"FAILED ({process.returncode})"
            print(f"{status}: {run.name} in {time.perf_counter() - started:.0f} s", flush=True)
            if process.returncode != 0:
                failed.append(run.name)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Leave through ``finally`` blocks on SIGTERM, as on Ctrl-C."""
    raise SystemExit(128 + signum)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Stop the runs still going when the study is interrupted (Ctrl-C reaches them too; a
    SIGTERM to the study alone did not, and they went on writing beside a study started
    again). Each resumes from its last checkpoint when the study runs again."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def collect(runs: list[StudyRun], out_root: Path, results_dir: Path) -> None:
    """Copy each run's results file to ``results_dir/<run name>.json``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    for run in runs:
        source = out_root / run.name / "results.json"
        if source.exists():
            shutil.copyfile(source, results_dir / f"{run.name}.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", type=Path, default=CONFIG_DIR / "fmnist_study.json",
                        help="study config file")
    parser.add_argument("--quick", action="store_true",
                        help="the quick subset (two batch sizes, short)")
    parser.add_argument("--batch-sizes", nargs="*", type=positive_int, default=None,
                        help="only these batch sizes (of the study's)")
    parser.add_argument("--optimizers", nargs="*", choices=("kfac", "sgd"), default=None)
    parser.add_argument("--jobs", type=positive_int, default=2,
                        help="runs at a time (one thread each)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "osawa2018" / "study",
                        help="where runs write checkpoints, logs and results")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where results files are collected "
                             "(default: reproductions/osawa2018/results/<study name>)")
    parser.add_argument("--wandb", default="auto",
                        choices=("auto", "online", "offline", "disabled"))
    parser.add_argument("--data-dir", default=None, help="cache directory of the built-in data")
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        study = read_json_file(args.study, "--study")
        try:
            name, runs = plan(study, quick=args.quick, batch_sizes=args.batch_sizes,
                              optimizers=args.optimizers)
        except (KeyError, TypeError, AttributeError) as exc:  # JSON of another shape
            raise ConfigError("--study", str(args.study), "a study file like "
                              f"configs/fmnist_study.json (it lacks or misshapes {exc})"
                              ) from None
        out_root = writable_directory(args.out / name, "--out")
        results_dir = writable_directory(args.results_dir or RESULTS_ROOT / name,
                                         "--results-dir")
        failed = execute(runs, out_root, jobs=args.jobs, wandb=args.wandb,
                         data_dir=args.data_dir)
        collect(runs, out_root, results_dir)
        print(large_batch_table(results_dir).markdown())
    if failed:
        raise SystemExit(f"failed runs: {', '.join(failed)} (see their train.log)")


if __name__ == "__main__":
    main()
