"""What the MKOR figure measurements (``frequency``, ``rank1_error``) share: their results files
and the options every one of them takes.

Each measurement writes one strict-JSON file in a schema of its own (not a training run's
results file) and builds its table from it, so the committed file makes the table without
measuring again.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_path
from data.paths import add_data_dir_argument
from reproductions.common.cli import device_name, positive_int, writable_directory
from reproductions.common.results import ResultsError
from reproductions.common.tables import Table, read_schema_file
from reproductions.mkor.config import PretrainConfig, load_config


def write_measurement(path: Path, results: dict[str, Any]) -> Path:
    """Write ``results`` as strict JSON (no NaN or infinity), atomically; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def read_measurement(path: Path, schema: str, error: type[ResultsError], command: str
                     ) -> dict[str, Any]:
    """A measurement's results file, checked to be a JSON object of ``schema``.

    Args:
        path: The file.
        schema: The ``schema`` field it must have.
        error: The measurement's error type (a :class:`ResultsError`, which the command
            lines report in one line).
        command: The command that writes the file, named in the fix.

    Raises:
        ResultsError: ``error``, when the file is missing, not JSON or of another schema.
    """
    return read_schema_file(path, schema, error, f"; rerun `{command}`")


def report(table: Table, out: Path | None = None, seconds: float | None = None) -> Table:
    """Print ``table`` (and, after a measurement, where its results went and how long it
    took); returns it."""
    print(table.markdown())
    if out is not None:
        print(f"\nwritten: {out}" + ("" if seconds is None else f" ({seconds:.0f} s)"))
    return table


def add_measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every measurement: config, corpus, threads, device, output file, a
    results file to print instead of measuring, and the data directory."""
    parser.add_argument("--config", default="default",
                        help="experiment file or name in reproductions/mkor/configs/ "
                             "(default: default)")
    parser.add_argument("--corpus", nargs="+", metavar="SOURCE",
                        help="override the config's corpus (e.g. a small .txt file)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="CPU threads (default 1)")
    parser.add_argument("--device", type=device_name, choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default: the measurement's results/ folder, "
                             "<experiment>.json)")
    parser.add_argument("--from-results", type=Path, metavar="FILE",
                        help="print the table of an existing results file; measure nothing")
    add_data_dir_argument(parser)


def measurement_output(args: argparse.Namespace, results_dir: Path, experiment: str) -> Path:
    """The results file ``--out`` names (default ``<results_dir>/<experiment>.json``), its
    folder checked before anything is measured (a file in its place failed after minutes of
    measuring).

    Raises:
        ConfigError: the folder cannot be created (names ``--out``).
    """
    out = args.out or results_dir / f"{experiment}.json"
    writable_directory(out.parent, "--out")
    return out


def measured_config(args: argparse.Namespace) -> PretrainConfig:
    """The experiment the options name (its corpus overridden by ``--corpus``), with torch's
    thread count set from ``--threads``."""
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    return replace(cfg, corpus=args.corpus) if args.corpus else cfg
