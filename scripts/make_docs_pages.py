"""Generate the docs site's reproduction pages from the committed results files.

For every paper in :data:`PAPERS` this reads ``reproductions/<paper>/results/**/*.json``:

* **run results** in the ``kfac-repro/results/v1`` schema (``reproductions/common/README.md``),
  read and validated with :func:`reproductions.common.results.load_results`;
* **rebuilt tables** in the ``kfac-repro/tables/v1`` schema of :mod:`reproductions.common.tables`
  (``reproductions/common/README.md``), written by the reproduction's ``tables.py`` with
  ``write_tables`` and read back, validated, with ``load_tables``;

and writes ``docs/reproductions/<paper>.md``, its figures ``docs/reproductions/img/<paper>-*.png``
(matplotlib) and the section index ``docs/reproductions/index.md``. A paper without results gets
a page that says so; nothing is invented. The pages are committed, so the site builds without
running experiments, and ``make docs`` regenerates them.

Every results table shows the paper's number, ours, and what differs and why: a table needs a
column whose name starts with "paper" (the published numbers, null where the paper gives none),
one whose name starts with "ours", and non-empty ``notes``, or the pages are not generated
(:func:`check_paper_vs_ours`). Its heading names its kind (:data:`KIND_MEANINGS`), so a modelled
or scaled-down number is never shown as the paper's; its notes are shown under it and again in the
page's deviations, after the reproduction ``README.md``'s section whose heading contains
"deviation".

Usage: ``python -m scripts.make_docs_pages [--root DIR] [--docs DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from data.paths import directory_problem
from reproductions.common import tables
from reproductions.common.results import SCHEMA as RESULTS_SCHEMA
from reproductions.common.results import ResultsError, load_results
from reproductions.common.tables import Table, TablesError, markdown_grid

REPO_ROOT = Path(__file__).resolve().parents[1]

#: What a table's "ours" numbers are, per kind of :data:`reproductions.common.tables.KINDS`.
KIND_MEANINGS = {
    "exact": "hardware-independent, computed at the paper's scale by the code that runs",
    "small": "a real run at small scale on the built-in data, same protocol, different numbers",
    "modelled": "measured parts combined by a documented model, not a measurement",
    "needs data": "script ready; runs on the user's copy of the data",
}
assert tuple(KIND_MEANINGS) == tables.KINDS, "KIND_MEANINGS must describe tables.KINDS, in order"

#: Every results table needs a column whose name starts with each of these (case-insensitive).
PAPER_VS_OURS = ("paper", "ours")

NO_RESULTS = "No results are committed for this reproduction yet"


@dataclass(frozen=True)
class Paper:
    """A reproduced paper.

    Attributes:
        slug: The reproduction's directory under ``reproductions/`` and its page's name.
        short: The page title.
        citation: Authors, title and venue.
        claim: The claim the reproduction checks, in one or two sentences.
    """

    slug: str
    short: str
    citation: str
    claim: str


PAPERS = (
    Paper("osawa2018", "Osawa et al. 2019",
          "Osawa, Tsuji, Ueno, Naruse, Yokota, Matsuoka: *Large-Scale Distributed Second-Order "
          "Optimization Using Kronecker-Factored Approximate Curvature for Deep Convolutional "
          "Neural Networks*, CVPR 2019 (arXiv 1811.12019).",
          "Distributed K-FAC trains ResNet-50 on ImageNet to 75% top-1 in 35 epochs for "
          "mini-batches up to 16,384, and to 75% with 131,072 in 978 iterations."),
    Paper("dpkfac", "DP-KFAC",
          "Zhang, Shi, Wang, Li: *Scalable K-FAC Training for Deep Neural Networks with "
          "Distributed Preconditioning*, IEEE Transactions on Cloud Computing 11(3), 2023 "
          "(arXiv 2206.15143).",
          "Building each layer's factors on one worker only keeps D-KFAC's convergence and, per "
          "second-order update on 64 GPUs, cuts computation 1.55–1.65×, communication "
          "2.79–3.15× and memory 1.14–1.47×."),
    Paper("mkor", "MKOR",
          "Mozaffari, Li, Zhang, Mehri Dehnavi: *MKOR: Momentum-Enabled Kronecker-Factor-Based "
          "Optimizer Using Rank-1 Updates*, NeurIPS 2023 (arXiv 2306.01685).",
          "Rank-1 factor updates make second-order cost quadratic in the layer width and "
          "communication linear; on BERT-Large with 64 GPUs MKOR beats LAMB by up to 2.57× and "
          "KAISA by up to 1.85×."),
)


class PagesError(ValueError):
    """A results or tables file cannot be rendered; the message names the file and field."""


# Reading ----------------------------------------------------------------------------------------
@dataclass
class PaperResults:
    """Everything committed for one paper.

    Attributes:
        runs: Validated run results, sorted by experiment, optimizer and seed.
        tables: Rebuilt tables, in file then table order.
        deviations: The reproduction README's deviations section (Markdown), or "".
        sweeps: Per results folder holding a sweep (a ``grid.json`` beside its runs: many
            short runs, one per cell, which a table summarises), how many validated runs it
            has; they get no figures of their own.
    """

    runs: list[dict[str, Any]] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    deviations: str = ""
    sweeps: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """Whether nothing at all is committed."""
        return not self.runs and not self.tables and not self.sweeps


def check_paper_vs_ours(table: Table, path: Path) -> None:
    """Check that a table shows the paper's number, ours, and what differs and why.

    Args:
        table: A table read from ``path``.
        path: Its tables file, named in the error.

    Raises:
        PagesError: no column whose name starts with "paper" or "ours" (case-insensitive), or
            empty ``notes``; the message names the file, the table id and what is missing.
    """
    where = f"{path}: table {table.id!r}"
    for prefix in PAPER_VS_OURS:
        if not any(column.strip().lower().startswith(prefix) for column in table.columns):
            raise PagesError(f"{where}: field 'columns' has no column named '{prefix}...' "
                             f"(got {table.columns}); every results table shows the paper's "
                             "number and ours")
    if not table.notes.strip():
        raise PagesError(f"{where}: field 'notes' is empty; it says how ours were made and what "
                         "differs from the paper and why")


def readme_section(text: str, keyword: str) -> str:
    """The body of the first Markdown section whose heading contains ``keyword``.

    The section runs to the next heading of the same or a higher level; its subheadings are
    shifted so that they nest under a level-2 heading of the page.

    Args:
        text: Markdown.
        keyword: Case-insensitive word to look for in headings.

    Returns:
        The section body, stripped; "" when no heading matches.
    """
    lines = text.splitlines()
    headings = _heading_matches(lines)
    for start, match in enumerate(headings):
        if not match or keyword.lower() not in match.group(2).lower():
            continue
        level = len(match.group(1))
        body = []
        for inner, sub in zip(lines[start + 1:], headings[start + 1:], strict=True):
            if sub and len(sub.group(1)) <= level:
                break
            body.append(f"{'#' * (len(sub.group(1)) - level + 2)} {sub.group(2)}" if sub
                        else inner)
        return "\n".join(body).strip()
    return ""


def _heading_matches(lines: list[str]) -> list[re.Match[str] | None]:
    """Per line, its heading match (level marks, text), or None: for a line that is not a
    heading, and for every line inside a fenced code block, where ``# comment`` is code."""
    heading = re.compile(r"^(#{1,6})\s+(.*)$")
    fence = re.compile(r"^\s*(```|~~~)")
    matches: list[re.Match[str] | None] = []
    open_fence: str | None = None
    for line in lines:
        opened = fence.match(line)
        if opened and (open_fence is None or opened.group(1) == open_fence):
            open_fence = None if open_fence else opened.group(1)
            matches.append(None)
            continue
        matches.append(None if open_fence else heading.match(line))
    return matches


def read_paper(directory: Path) -> PaperResults:
    """Read every results and tables file committed for one reproduction.

    Args:
        directory: ``reproductions/<paper>``; it may be missing.

    Raises:
        PagesError: a JSON file does not parse, or a table breaks :func:`check_paper_vs_ours`.
        reproductions.common.tables.TablesError: a tables file breaks its schema.
        reproductions.common.results.ResultsError: a run results file breaks its schema.
    """
    found = PaperResults()
    for path in sorted((directory / "results").glob("**/*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise PagesError(f"{path}: not valid JSON ({exc})") from None
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema == RESULTS_SCHEMA and (path.parent / "grid.json").is_file():
            load_results(path)  # validated like any run
            folder = str(path.parent.relative_to(directory / "results"))
            found.sweeps[folder] = found.sweeps.get(folder, 0) + 1
        elif schema == RESULTS_SCHEMA:
            found.runs.append(load_results(path))
        elif schema == tables.SCHEMA:
            _, file_tables = tables.load_tables(path)
            for table in file_tables:
                check_paper_vs_ours(table, path)
            found.tables.extend(file_tables)
        elif not (isinstance(schema, str) and schema.startswith(PROJECT_SCHEMAS)):
            # (the project's own measurement files, e.g. a sweep's grid, reach the pages
            # through the tables built from them: skipped without a note)
            print(f"make_docs_pages: skipping {path}: schema {schema!r} is neither "
                  f"{RESULTS_SCHEMA!r} nor {tables.SCHEMA!r}", file=sys.stderr)
    found.runs.sort(key=lambda r: (r["experiment"], r["optimizer"], str(run_seed(r))))
    readme = directory / "README.md"
    if readme.is_file():
        found.deviations = readme_section(readme.read_text(encoding="utf-8"), "deviation")
    return found


# Formatting -------------------------------------------------------------------------------------
def run_seed(run: Mapping[str, Any]) -> Any:
    """The run's seed from its configuration ("—" when it has none)."""
    return run["config"].get("seed", "—")


def run_label(run: Mapping[str, Any]) -> str:
    """``<optimizer>``, its batch size in a study over batch sizes (a configuration whose name
    is a ``*_large_batch*`` study), plus the seed when the configuration has one, for legends
    and columns; the label :func:`labelled` gave it, when it did."""
    if LABEL in run:
        return str(run[LABEL])
    seed = run_seed(run)
    label = run["optimizer"]
    if "large_batch" in str(run.get("experiment", "")) and "batch_size" in run["config"]:
        label += f" B={run['config']['batch_size']:,}"
    return label if seed == "—" else f"{label} (seed {seed})"


PROJECT_SCHEMAS = "kfac-repro/"
"""Prefix of the schemas of this project's files (results, tables and measurements)."""

LABEL = "_label"
"""Key of the label :func:`labelled` puts in its copies of the runs."""


def labelled(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``runs``, each with a label no other run of them has: runs whose
    :func:`run_label` is the same (a sweep over the learning rate, say) are told apart by the
    configuration values that differ among them (``kfac (seed 0) lr=10``), and by number where
    that still leaves two alike."""
    base = [run_label(run) for run in runs]
    labels = []
    for run, label in zip(runs, base, strict=True):
        group = [r for r, b in zip(runs, base, strict=True) if b == label]
        varying = sorted(k for k in run["config"]
                         if len({json.dumps(r["config"].get(k), sort_keys=True)
                                 for r in group}) > 1)
        shown = ", ".join(f"{k}={json.dumps(run['config'][k])}" for k in varying)
        labels.append(f"{label} {shown}" if shown else label)
    counts = {label: labels.count(label) for label in labels}
    labels = [f"{label} #{i + 1}" if counts[label] > 1 else label
              for i, label in enumerate(labels)]
    return [{**run, LABEL: label} for run, label in zip(runs, labels, strict=True)]


def line_styles(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Matplotlib styles, one per run: when the runs span several batch sizes, the colour
    follows the batch size (a sequential colour map) and the line style the optimizer, so a
    study's 14 curves stay readable; otherwise the default colour cycle."""
    batches = sorted({r["config"].get("batch_size") for r in runs} - {None})
    if len(batches) < 2:
        return [{} for _ in runs]
    optimizers = list(dict.fromkeys(r["optimizer"] for r in runs))
    colours = plt.get_cmap("viridis")
    dashes = ("-", "--", ":", "-.")
    return [{"color": colours(batches.index(r["config"]["batch_size"]) / (len(batches) - 1)),
             "linestyle": dashes[optimizers.index(r["optimizer"]) % len(dashes)]}
            if r["config"].get("batch_size") is not None else {} for r in runs]


def fmt(value: Any, unit: str = "") -> str:
    """A table cell: four significant digits, thousands separators, "—" for null or NaN."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        # by the value as shown: 9,999.7 rounds to 10,000, not 1e+04
        text = f"{value:,.0f}" if abs(float(f"{value:.4g}")) >= 1e4 else f"{value:.4g}"
    else:
        text = str(value)
    return f"{text} {unit}".strip() if unit else text


# Figures ----------------------------------------------------------------------------------------
def _save(fig: plt.Figure, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _numeric(mapping: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in mapping.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def plot_curves(runs: Sequence[Mapping[str, Any]], path: Path) -> str:
    """Training loss against step and against cumulative training seconds, one line per run."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, style in zip(runs, line_styles(runs), strict=True):
        steps = [s for s in run["steps"] if s["loss"] is not None]
        seconds = list(accumulate(s["time_s"] for s in run["steps"]))
        elapsed = [t for s, t in zip(run["steps"], seconds, strict=True) if s["loss"] is not None]
        losses = [s["loss"] for s in steps]
        by_step.plot([s["step"] for s in steps], losses, label=run_label(run), **style)
        by_time.plot(elapsed, losses, label=run_label(run), **style)
    by_step.set(xlabel="step", ylabel="training loss", title="loss per step")
    by_time.set(xlabel="training seconds (sum of step times)", ylabel="training loss",
                title="loss against time")
    losses = [s["loss"] for run in runs for s in run["steps"] if s["loss"] is not None]
    if losses and min(losses) > 0 and max(losses) > 100 * min(losses):  # a diverging run
        by_step.set_yscale("log")  # would flatten the others on a linear axis
        by_time.set_yscale("log")
    by_step.legend(fontsize=8)
    return _save(fig, path)


def eval_metrics(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Names of the numeric evaluation metrics any run logged, sorted (not the step or epoch)."""
    return sorted({k for run in runs for e in run["evals"] for k in _numeric(e)
                   if k not in ("step", "epoch")})


def plot_evals(runs: Sequence[Mapping[str, Any]], metrics: Sequence[str], path: Path) -> str:
    """One panel per evaluation metric (accuracy, F1, evaluation loss, ...) against the epoch
    when every evaluation records one (runs of different batch sizes then line up), else
    against the step."""
    axis = "epoch" if all("epoch" in e for run in runs for e in run["evals"]) else "step"
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for run, style in zip(runs, line_styles(runs), strict=True):
            points = [(e[axis], e[metric]) for e in run["evals"] if e.get(metric) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", markersize=3,
                        label=run_label(run), **style)
        ax.set(xlabel=axis, ylabel=metric, title=metric)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def plot_stacked(runs: Sequence[Mapping[str, Any]], parts: Sequence[dict[str, float]],
                 xlabel: str, title: str, path: Path) -> str:
    """Horizontal stacked bars, one per run, one segment per key of ``parts``."""
    keys = sorted({k for p in parts for k in p})
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(runs) + 1.6))
    rows = range(len(runs))  # positions, not labels: equal labels would share one bar
    left = [0.0] * len(runs)
    for key in keys:
        widths = [p.get(key, 0.0) for p in parts]
        ax.barh(rows, widths, left=left, label=key)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(rows, [run_label(run) for run in runs])
    ax.invert_yaxis()
    ax.set(xlabel=xlabel, title=title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, path)


def ledger_bytes(ledger: Mapping[str, Any] | None) -> dict[str, float]:
    """Bytes per communication stage from a results ``ledger``.

    The ledger maps each stage to the totals of one rank's ledger over the run
    (``core.distributed``'s ``Ledger.summary()``: ``collectives``, ``elements``, ``bytes``,
    ``traffic_bytes``); the bytes that rank received, ``traffic_bytes``, are what per-worker
    tables compare. {} when the run measured nothing (a single process).
    """
    return {stage: float(totals["traffic_bytes"]) for stage, totals in (ledger or {}).items()
            if isinstance(totals, Mapping) and "traffic_bytes" in totals}


def experiment_figures(paper: str, experiment: str, runs: Sequence[Mapping[str, Any]],
                       img_dir: Path) -> list[tuple[str, str]]:
    """Draw one experiment's figures.

    Returns:
        ``(alt text, file name)`` per figure, in page order.
    """
    stem = f"{paper}-{re.sub(r'[^A-Za-z0-9_.-]+', '-', experiment)}"
    figures = []
    if any(run["steps"] for run in runs):
        figures.append(("training loss curves", plot_curves(runs, img_dir / f"{stem}-loss.png")))
    metrics = eval_metrics(runs)
    if metrics:
        figures.append((f"evaluation curves: {', '.join(metrics)}",
                        plot_evals(runs, metrics, img_dir / f"{stem}-eval.png")))
    stage_times = [_numeric(run["optimizer_stage_time_s"]) for run in runs]
    if any(stage_times):
        figures.append(("optimizer time per stage", plot_stacked(
            runs, stage_times, "seconds over the run", "optimizer time per stage",
            img_dir / f"{stem}-time.png")))
    comm = [{k: v / 2**20 for k, v in ledger_bytes(run["ledger"]).items()} for run in runs]
    if any(comm):
        figures.append(("communication per stage", plot_stacked(
            runs, comm, "MiB received by one worker over the run", "communication per stage",
            img_dir / f"{stem}-comm.png")))
    memory = [{k: v / 2**20 for k, v in _numeric(run["memory"]).items()} for run in runs]
    if any(memory):
        figures.append(("memory", plot_memory(runs, memory, img_dir / f"{stem}-memory.png")))
    return figures


def plot_memory(runs: Sequence[Mapping[str, Any]], memory: Sequence[dict[str, float]],
                path: Path) -> str:
    """Grouped bars of each run's memory entries (they overlap, e.g. a total and its parts)."""
    keys = sorted({k for m in memory for k in m})
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.8 / len(runs)
    for i, (run, values) in enumerate(zip(runs, memory, strict=True)):
        ax.bar([k + i * width for k in range(len(keys))], [values.get(k, 0.0) for k in keys],
               width=width, label=run_label(run))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys, fontsize=8)
    ax.set(ylabel="MiB", title="memory per worker")
    ax.legend(fontsize=8)
    return _save(fig, path)


# Pages ------------------------------------------------------------------------------------------
def runs_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """One row per run: what ran, how long, on what, from which commit."""
    rows = []
    for run in runs:
        hw = run["hardware"]
        device = hw.get("cuda") or f"CPU ({hw['cpu']}, {hw['threads']} threads)"
        last = run["steps"][-1]["step"] if run["steps"] else None
        seconds = sum(s["time_s"] for s in run["steps"])
        rows.append((run_label(run), fmt(last), fmt(seconds, "s"),
                     f"{hw['world_size']} × {device}", (run["git_revision"] or "—")[:12],
                     "finished" if run["finished"] else "interrupted or in progress"))
    return markdown_grid(("run", "last step", "training time", "processes × device", "commit",
                          "state"), rows)


def summary_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """The runs' ``summary`` numbers, one row per key and one column per run."""
    summaries = [run["summary"] for run in runs]
    keys = sorted({k for s in summaries for k in s})
    if not keys:
        return ""
    return markdown_grid(("summary", *(run_label(r) for r in runs)),
                         [(k, *(fmt(s.get(k)) for s in summaries)) for k in keys])


def experiment_section(paper: str, experiment: str, runs: Sequence[Mapping[str, Any]],
                       img_dir: Path) -> str:
    """A page section for one experiment: runs, summary numbers, figures and configurations."""
    runs = labelled(runs)
    parts = [f"### {experiment}", runs_table(runs)]
    summary = summary_table(runs)
    if summary:
        parts.append(summary)
    for alt, name in experiment_figures(paper, experiment, runs, img_dir):
        parts.append(f"![{alt}](img/{name})")
    for run in runs:
        config = json.dumps(run["config"], indent=2, sort_keys=True)
        parts.append(f'??? note "Configuration of {run_label(run)}"\n\n'
                     + "\n".join(f"    {line}" for line in ["```json", *config.splitlines(),
                                                             "```"]))
    return "\n\n".join(parts)


def kinds_legend() -> str:
    """The legend of the kinds named in the tables' headings."""
    return markdown_grid(("kind of ours", "meaning"), KIND_MEANINGS.items())


def noted_with_tables(rebuilt: Sequence[Table]) -> str:
    """A Markdown list of each table's notes, continuation lines indented under their item."""
    return "\n".join(f"- **{table.id}**: " + table.notes.strip().replace("\n", "\n    ")
                     for table in rebuilt)


def paper_page(paper: Paper, results: PaperResults, img_dir: Path) -> str:
    """The Markdown page of one reproduction (figures are written to ``img_dir``)."""
    parts = [f"# {paper.short}",
             "<!-- Generated by scripts/make_docs_pages.py from the committed results files; "
             "edit the script or the results, not this page. -->",
             f"**Paper.** {paper.citation}", f"**Claim.** {paper.claim}"]
    if results.empty:
        parts.append(f'!!! warning "{NO_RESULTS}"\n\n'
                     f"    No results files are committed under `reproductions/{paper.slug}/"
                     "results/`, so this page shows no numbers. Once they land, `make docs` "
                     "regenerates it with each of the paper's tables beside ours, the runs' "
                     "curves, time, communication and memory, and the deviations.")
        return "\n\n".join(parts) + "\n"
    parts.append("## Paper vs ours")
    if results.tables:
        parts.append("Every table shows the paper's numbers (its `paper` columns; — where the "
                     "paper gives none), ours (its `ours` columns) and, under it, how ours were "
                     "made and what differs and why. Its heading names what kind of number ours "
                     "are:\n\n" + kinds_legend())
        parts += [table.markdown() for table in results.tables]
    else:
        parts.append("No rebuilt tables are committed yet (the reproduction's `tables.py` "
                     f"writes them as `{tables.SCHEMA}` files under `results/`).")
    parts.append("## Runs")
    if results.runs:
        by_experiment: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for run in results.runs:
            by_experiment[run["experiment"]].append(run)
        parts += [experiment_section(paper.slug, name, runs, img_dir)
                  for name, runs in by_experiment.items()]
    elif not results.sweeps:
        parts.append("No run results are committed yet.")
    parts += [f"The {count} runs of the sweep in `reproductions/{paper.slug}/results/{folder}/` "
              "(one per cell, with its `grid.json`) are summarised by its table above."
              for folder, count in sorted(results.sweeps.items())]
    parts.append("## Deviations")
    if results.deviations:
        parts.append(results.deviations)
    if results.tables:
        parts += ["### Noted with the tables", noted_with_tables(results.tables)]
    if not results.deviations and not results.tables:
        parts.append("None recorded yet: the reproduction's README and tables list them.")
    return "\n\n".join(parts) + "\n"


def index_page(status: Mapping[str, PaperResults]) -> str:
    """The Reproductions section's index: one line per paper with what is committed."""
    rows = []
    for paper in PAPERS:
        results = status[paper.slug]
        experiments = sorted({run["experiment"] for run in results.runs})
        swept = "".join(f", {count} runs of the {folder} sweep"
                        for folder, count in sorted(results.sweeps.items()))
        rows.append((f"[{paper.short}]({paper.slug}.md)", paper.claim,
                     f"{len(results.runs)} runs ({', '.join(experiments) or 'none'}){swept}, "
                     f"{len(results.tables)} tables"))
    return "\n\n".join([
        "# Reproductions",
        "<!-- Generated by scripts/make_docs_pages.py; edit the script, not this page. -->",
        "Each page is generated from the results files committed under "
        "`reproductions/<paper>/results/` by `scripts/make_docs_pages.py` (run by `make docs`): "
        "each of the paper's tables side by side with ours, the runs behind them with their "
        "curves, time, communication and memory, and the deviations.",
        markdown_grid(("paper", "claim", "committed"), rows),
        "What kind of number each of ours is:",
        kinds_legend(),
        "## Adding results",
        "A reproduction commits, under `reproductions/<paper>/results/`, one results file per "
        f"run in the `{RESULTS_SCHEMA}` schema (written by "
        "`reproductions.common.results.RunRecorder`) and its rebuilt tables in the "
        f"`{tables.SCHEMA}` schema (written by `reproductions.common.tables.write_tables`, "
        "described in `reproductions/common/README.md`): `{\"schema\", \"paper\", "
        "\"tables\": [{\"id\", \"title\", \"kind\", \"columns\", \"rows\", \"notes\"}]}`, "
        "where `kind` is one of the kinds above, `columns` the column names and `rows` one list "
        "of cells (string, number or null) per row. Every table shows the paper's number, ours, "
        "and what differs and why: at least one column named `paper…` (the published numbers, "
        "null where the paper gives none), one named `ours…`, and `notes` saying how ours were "
        "made, where the paper's numbers come from and what differs and why; the pages are not "
        "generated otherwise. The notes are shown under each table and listed with the "
        "deviations, after the section of the reproduction's `README.md` whose heading names "
        "deviations. "
        "`make docs` regenerates the pages; `make test` fails while a committed page is stale.",
    ]) + "\n"


def write_pages(root: Path, docs: Path) -> dict[str, PaperResults]:
    """Regenerate every reproduction page, its figures and the index.

    Args:
        root: The repository root (holding ``reproductions/``).
        docs: The docs directory (pages go to ``<docs>/reproductions``).

    Returns:
        What was read, per paper slug.

    Raises:
        PagesError, TablesError, ResultsError: ``root`` holds no reproductions, or a results or
            tables file cannot be read or rendered (the message names it); nothing is written.
    """
    if not (root / "reproductions").is_dir():
        raise PagesError(f"{root} holds no reproductions/ folder: pass --root the repository "
                         "root")
    # Every paper is read before anything is deleted or written: a bad results file then
    # leaves the pages and figures as they were.
    status = {paper.slug: read_paper(root / "reproductions" / paper.slug) for paper in PAPERS}
    out = docs / "reproductions"
    img_dir = out / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    for paper in PAPERS:
        for stale in img_dir.glob(f"{paper.slug}-*.png"):
            stale.unlink()
        (out / f"{paper.slug}.md").write_text(paper_page(paper, status[paper.slug], img_dir),
                                              encoding="utf-8")
    (out / "index.md").write_text(index_page(status), encoding="utf-8")
    return status


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point.

    Args:
        argv: Command-line arguments (``--root``, ``--docs``); ``sys.argv`` when None.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="repository root holding reproductions/ (default: this checkout)")
    parser.add_argument("--docs", type=Path, default=None,
                        help="docs directory to write into (default: <root>/docs)")
    args = parser.parse_args(argv)
    docs = args.docs or args.root / "docs"
    problem = directory_problem(Path(docs).resolve())
    if problem is not None:
        parser.exit(1, f"make_docs_pages: --docs {docs}: {problem}; pass a docs directory\n")
    try:
        status = write_pages(args.root, docs)
    except (PagesError, TablesError, ResultsError) as exc:
        parser.exit(1, f"make_docs_pages: {exc}\n")
    for slug, results in status.items():
        print(f"make_docs_pages: {slug}: {len(results.runs)} runs, {len(results.tables)} tables")


if __name__ == "__main__":
    main()
