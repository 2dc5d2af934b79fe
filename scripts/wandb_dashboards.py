"""W&B dashboards for the reproductions: the tables' figures as runs, a report and a workspace each.

Every reproduction logs under one naming scheme (``reproductions.common.tracking.Tracker``):
project ``kfac-repro-<paper>``, group ``<experiment>``, run ``<experiment>-<optimizer>-<seed>``,
job type ``<optimizer>``. This script adds, per paper:

* ``tables``: one run in group ``tables`` (named ``tables``, job type ``tables``) that logs every
  numeric cell of the paper's rebuilt tables (``reproductions.common.tables``) once, as
  ``<table id>/<row>/<column>`` (:func:`table_figures`), plus each table as a ``wandb.Table``;
  W&B keeps the last logged value of a key as the run's summary, so the summary carries every
  table's figures. The mode is ``online`` only when logged in (``--mode`` overrides), else the
  run is written offline under ``--dir`` (upload with ``wandb sync``).
* ``dashboards`` (needs a login): a W&B report with the paper's tables beside ours and, per
  experiment (group), a panel grid of that group's runs; and a saved workspace view with the
  same panels. The metrics shown are discovered from the project's runs with ``wandb.Api``; the
  report and the workspace are built with W&B's ``wandb-workspaces`` package (the ``dashboards``
  extra).

Usage::

    python -m scripts.wandb_dashboards tables [--paper P ...] [--mode M] [--dir DIR]
    python -m scripts.wandb_dashboards dashboards [--paper P ...] [--entity E]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import wandb
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from reproductions.common.results import git_revision
from reproductions.common.tables import Table, format_cell
from reproductions.common.tracking import MODES, resolve_mode, wandb_logged_in
from scripts.make_docs_pages import PAPERS, REPO_ROOT, Paper, read_paper

TABLES_GROUP = "tables"
WORKSPACE_NAME = "kfac-repro"
#: Per-stage seconds, drawn as one bar chart: ``time/<stage>`` under any prefix (the entry
#: points log the preconditioner's metrics as ``optimizer/time/...`` or ``kfac/time/...``).
STAGE_TIME = re.compile(r"(^|/)time/")
#: History rows :func:`discover_metrics` samples per run to learn which keys are logged per step.
HISTORY_SAMPLES = 20


def project_name(paper: str) -> str:
    """The W&B project of a reproduction (as ``Tracker`` names it)."""
    return f"kfac-repro-{paper}"


def slug(text: str) -> str:
    """A metric-name-safe form of a table's row label or column name."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def unique_slugs(texts: Sequence[str], blank: str) -> list[str]:
    """The slug of each text, made unique among them: one that repeats (two rows of one model,
    or ``ours (MB)`` beside ``ours: MB``) gets the first free ``_2``, ``_3``, ... (never one
    another text already slugs to, such as a row named ``a_2``), so no figure overwrites
    another; an empty one is ``<blank>_<n>`` (1-based)."""
    bases = [slug(text) or f"{blank}_{n}" for n, text in enumerate(texts, start=1)]
    taken = set(bases)
    keys: list[str] = []
    used: set[str] = set()
    for base in bases:
        key, n = base, 1
        while key in used or (key != base and key in taken):
            n += 1
            key = f"{base}_{n}"
        used.add(key)
        keys.append(key)
    return keys


def row_slugs(table: Table) -> list[str]:
    """Each row's key: the slug of its first cell, made unique within the table
    (:func:`unique_slugs`; an empty label is ``row_<n>``)."""
    return unique_slugs([format_cell(row[0]) for row in table.rows], "row")


def table_figures(tables: Sequence[Table]) -> dict[str, float]:
    """Every numeric cell of the tables, keyed ``<table id>/<row>/<column>``.

    ``<row>`` is the slug of the row's first cell (:func:`row_slugs`) and ``<column>`` that of
    the column's name, e.g. ``D1/resnet_50/ours_mb``.
    """
    figures = {}
    for table in tables:
        columns = unique_slugs(table.columns, "column")
        for key, row in zip(row_slugs(table), table.rows, strict=True):
            for column, value in zip(columns, row, strict=True):
                if isinstance(value, int | float):
                    figures[f"{table.id}/{key}/{column}"] = float(value)
    return figures


def log_tables(paper: Paper, tables: Sequence[Table], directory: Path, mode: str) -> Any:
    """Log one paper's tables into its ``tables`` run.

    Args:
        paper: The reproduction.
        tables: Its rebuilt tables.
        directory: Where W&B writes its files (``<directory>/wandb``).
        mode: ``online``, ``offline`` or ``disabled``.

    Returns:
        The finished ``wandb`` run (its ``dir`` locates the offline files).
    """
    directory.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=project_name(paper.slug), group=TABLES_GROUP, name=TABLES_GROUP,
                     job_type=TABLES_GROUP, mode=mode, dir=str(directory),
                     config={"git_revision": git_revision(), "tables": [t.id for t in tables]},
                     settings=wandb.Settings(console="off"))
    logged: dict[str, Any] = dict(table_figures(tables))
    for table in tables:
        logged[f"{table.id}/table"] = wandb.Table(
            columns=table.columns, data=[[format_cell(c) for c in row] for row in table.rows])
    run.log(logged, step=0)
    run.finish()
    return run


def discover_metrics(api: Any, entity: str, project: str) -> dict[str, list[str]]:
    """The numeric metrics each experiment (group) of a W&B project logs step by step.

    Keys come from a sample of each run's history (:data:`HISTORY_SAMPLES` rows), not from
    its summary, which also holds values set once at the end (``final_loss``, ``steps``):
    those have no history to plot against the step.

    Args:
        api: A logged-in ``wandb.Api``.
        entity: The W&B entity.
        project: The project.

    Returns:
        Experiment name to sorted metric names, experiments sorted; the ``tables`` group and
        W&B's own ``_``-prefixed keys are left out.
    """
    found: dict[str, set[str]] = {}
    for run in api.runs(f"{entity}/{project}"):
        if not run.group or run.group == TABLES_GROUP:
            continue
        keys = found.setdefault(run.group, set())
        for row in run.history(samples=HISTORY_SAMPLES, pandas=False):
            for key, value in row.items():
                if not key.startswith("_") and isinstance(value, int | float) \
                        and not isinstance(value, bool):
                    keys.add(key)
    return {group: sorted(keys) for group, keys in sorted(found.items())}


def panels(metrics: Sequence[str]) -> list[Any]:
    """One line plot per metric against the step; per-stage seconds as one bar chart."""
    stage_times = [m for m in metrics if STAGE_TIME.search(m)]
    out: list[Any] = [wr.LinePlot(title=m, x="Step", y=[m]) for m in metrics
                      if not STAGE_TIME.search(m)]
    if stage_times:
        out.append(wr.BarPlot(title="optimizer seconds per stage", metrics=stage_times))
    return out


def group_filter(experiment: str) -> str:
    """The runset filter selecting one experiment's runs."""
    return f"Group = '{experiment}'"


def build_report(paper: Paper, entity: str, tables: Sequence[Table],
                 experiments: Mapping[str, Sequence[str]]) -> wr.Report:
    """The report of one reproduction (not saved).

    Args:
        paper: The reproduction.
        entity: The W&B entity owning the project.
        tables: Its rebuilt tables (shown as :meth:`Table.markdown`).
        experiments: Experiment (group) to the metrics to plot, from :func:`discover_metrics`.
    """
    project = project_name(paper.slug)
    blocks: list[Any] = [wr.P(paper.claim), wr.MarkdownBlock(paper.citation)]
    if tables:
        blocks.append(wr.H2("Paper vs ours"))
        blocks += [wr.MarkdownBlock(table.markdown()) for table in tables]
    for experiment, metrics in experiments.items():
        blocks += [wr.H2(experiment), wr.PanelGrid(
            runsets=[wr.Runset(entity=entity, project=project, name=experiment,
                               filters=group_filter(experiment))],
            panels=panels(metrics))]
    return wr.Report(entity=entity, project=project, title=f"kfac-repro: {paper.short}",
                     description="Runs of the reproduction by experiment; generated by "
                                 "scripts/wandb_dashboards.py.", blocks=blocks)


def build_workspace(paper: Paper, entity: str, experiments: Mapping[str, Sequence[str]]
                    ) -> ws.Workspace:
    """A saved workspace view of one reproduction's project: a section per experiment.

    A workspace shows every run of the project in every panel; group the runs table by
    ``Group`` to read one experiment at a time.
    """
    return ws.Workspace(entity=entity, project=project_name(paper.slug), name=WORKSPACE_NAME,
                        sections=[ws.Section(name=experiment, panels=panels(metrics),
                                             is_open=True)
                                  for experiment, metrics in experiments.items()])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status.

    Args:
        argv: Command-line arguments; ``sys.argv`` when None.
    """
    papers_option = argparse.ArgumentParser(add_help=False)
    papers_option.add_argument("--paper", action="append", choices=[p.slug for p in PAPERS],
                               help="only this reproduction (repeatable; default: all)")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tables_command = commands.add_parser("tables", parents=[papers_option],
                                         help="log the rebuilt tables' figures as W&B runs")
    tables_command.add_argument("--mode", choices=MODES, default="auto", help="W&B mode")
    tables_command.add_argument("--dir", type=Path, default=REPO_ROOT / "runs" / "wandb-tables",
                                help="where the W&B files are written")
    dashboards_command = commands.add_parser(
        "dashboards", parents=[papers_option],
        help="create a report and a workspace view per reproduction (needs a W&B login)")
    dashboards_command.add_argument("--entity", help="W&B entity (default: your default)")
    args = parser.parse_args(argv)
    papers = [p for p in PAPERS if not args.paper or p.slug in args.paper]

    if args.command == "tables":
        mode = resolve_mode(args.mode)
        for paper in papers:
            tables = read_paper(REPO_ROOT / "reproductions" / paper.slug).tables
            if not tables:
                print(f"{paper.slug}: no rebuilt tables committed; nothing logged")
                continue
            run = log_tables(paper, tables, args.dir, mode)
            where = ("nothing written" if mode == "disabled"
                     else f"files in {Path(run.dir).parent}")
            print(f"{paper.slug}: {len(tables)} tables logged to {project_name(paper.slug)}/"
                  f"{TABLES_GROUP} ({mode}; {where})")
        return 0

    if not wandb_logged_in():
        print("Not logged in to W&B (no WANDB_API_KEY, no W&B server entry in ~/.netrc): no "
              "dashboards created. Run `wandb login`, sync the runs (`wandb sync <run dir>`), "
              "then run this again.", file=sys.stderr)
        return 1
    api = wandb.Api()
    entity = args.entity or api.default_entity
    for paper in papers:
        tables = read_paper(REPO_ROOT / "reproductions" / paper.slug).tables
        experiments = discover_metrics(api, entity, project_name(paper.slug))
        report = build_report(paper, entity, tables, experiments)
        report.save()
        workspace = build_workspace(paper, entity, experiments)
        workspace.save()
        print(f"{paper.slug}: report {report.url}\n{paper.slug}: workspace {workspace.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
