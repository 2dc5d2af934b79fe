"""M7: time per iteration against the inversion interval (MKOR paper, Fig. 3.4a), measured.

The paper plots the average time per training iteration of MKOR and KAISA (K-FAC) on
BERT-Large against the inversion frequency: KAISA's time grows as its factors are inverted more
often, MKOR's (a rank-1 Sherman-Morrison update of the inverses) stays almost flat. Here the
default experiment's BERT (``configs/default.json``: model ``small``, 32 x 128 tokens, LAMB
base) is timed in one process, through the code path training uses
(:func:`reproductions.mkor.bert.make_optimizer`, so :func:`core.optim.build_optimizer`, with the
config's K-FAC and MKOR options):

* a whole training step (zero grad, forward, backward, preconditioner, LAMB step) of LAMB
  alone, of K-FAC and of MKOR, both as an **update step** (K-FAC: factors and their
  eigendecompositions; MKOR: the rank-1 vectors and the Sherman-Morrison update of the inverse
  factors) and as a **plain step** (precondition with the current inverses only). The
  second-order methods are built with an update every 2 steps, so their steps alternate update
  and plain; everything else comes from the config.
* methods take turns, round by round, in an order that rotates each round (so a drift of the
  machine's load falls on all of them alike); a few rounds warm up, then each time is the median
  of ``repeats`` rounds.
* the time per iteration with an update every ``f`` steps is the amortised
  ``(T_update + (f − 1) T_plain) / f`` (:func:`amortised_time`), and its ratio to LAMB's step.

``python -m reproductions.mkor.frequency`` measures (a few minutes with one thread), writes
``results/frequency/default.json`` and prints the table; :func:`table_from_results` rebuilds
the table from that file without measuring.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.config import KFACConfig
from core.mkor import MKORConfig
from reproductions.common.cli import exit_on_user_error, int_at_least, positive_int
from reproductions.common.launch import DistContext, seed_everything
from reproductions.common.results import ResultsError, git_revision, hardware_info, utc_now
from reproductions.common.tables import Table
from reproductions.mkor import data
from reproductions.mkor.bert import prepare_examples, sync_device
from reproductions.mkor.config import MODEL_PRESETS, PretrainConfig
from reproductions.mkor.measurement_files import (
    add_measurement_arguments,
    measured_config,
    measurement_output,
    read_measurement,
    report,
    write_measurement,
)
from reproductions.mkor.model import build_model, pretraining_loss

SCHEMA = "kfac-repro/mkor-frequency/v1"
"""The ``schema`` field of a results file of this measurement."""

FREQUENCIES = (1, 2, 5, 10, 20, 50, 100, 200)
"""Inversion intervals ``f`` (steps between second-order updates) of the table."""

METHODS = ("lamb", "kfac", "mkor")
"""What is timed: LAMB alone, K-FAC (KAISA) over LAMB, MKOR over LAMB."""

NAMES = {"lamb": "LAMB", "kfac": "KAISA (K-FAC)", "mkor": "MKOR"}

INTERVAL_FIELDS = {"kfac": ("factor_update_steps", "inv_update_steps"),
                   "mkor": ("inv_update_steps",)}
"""The config fields set to the timing interval: K-FAC's factors and inverses (equal in the
default config) and MKOR's rank-1 update."""

TIMING_INTERVAL = 2
"""Second-order update every this many steps while timing: update and plain steps alternate."""

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "frequency"
DEFAULT_RESULTS = RESULTS_DIR / "default.json"

PAPER_CLAIM = ("figure only, no values printed: KAISA's time per iteration rises steeply as "
               "inversions get more frequent (small f); MKOR's is almost flat")


class FrequencyError(ResultsError):
    """A results file of this measurement is missing or malformed (the message names it; the
    command line reports it in one line)."""


# ----------------------------------------------------------------------------------------------
# The arithmetic

def amortised_time(update_s: float, plain_s: float, interval: int) -> float:
    """Average seconds per iteration with one update step every ``interval`` steps.

    Args:
        update_s: Seconds of an update step (statistics and inversion, or rank-1 update).
        plain_s: Seconds of a step that only preconditions with the current inverses.
        interval: ``f >= 1``, steps per update.

    Returns:
        ``(update_s + (interval − 1) · plain_s) / interval``.

    Raises:
        ValueError: ``interval`` < 1.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    return (update_s + (interval - 1) * plain_s) / interval


def medians(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per method, the median of each kind of step's samples; for LAMB (whose steps are all
    alike) ``update`` and ``plain`` are both the median of all its steps."""
    out: dict[str, dict[str, float]] = {}
    for method, kinds in samples.items():
        if method == "lamb":
            step = statistics.median([*kinds.get("update", []), *kinds.get("plain", [])])
            out[method] = {"update": step, "plain": step}
        else:
            out[method] = {kind: statistics.median(values) for kind, values in kinds.items()
                           if values}
    return out


def amortised(step_medians: dict[str, dict[str, float]],
              frequencies: Sequence[int] = FREQUENCIES) -> dict[str, dict[str, dict[str, float]]]:
    """Per second-order method and interval: seconds per iteration and ratio to LAMB's step.

    Returns:
        ``{method: {str(f): {"seconds": s, "ratio_to_lamb": s / T_lamb}}}``.
    """
    lamb = step_medians["lamb"]["plain"]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for method, times in step_medians.items():
        if method == "lamb":
            continue
        out[method] = {}
        for f in frequencies:
            seconds = amortised_time(times["update"], times["plain"], f)
            out[method][str(f)] = {"seconds": seconds, "ratio_to_lamb": seconds / lamb}
    return out


# ----------------------------------------------------------------------------------------------
# The measurement

def timing_config(cfg: PretrainConfig, interval: int = TIMING_INTERVAL) -> PretrainConfig:
    """``cfg`` with every second-order update interval of :data:`INTERVAL_FIELDS` set to
    ``interval`` (the other options kept)."""
    options = copy.deepcopy(cfg.preconditioner)
    for method, names in INTERVAL_FIELDS.items():
        options[method] = {**options.get(method, {}), **{name: interval for name in names}}
    return replace(cfg, preconditioner=options)


def _second_order_seconds(optimizer: Any) -> tuple[float, float]:
    """Seconds the preconditioner's timer saw in its last step, in all and in its
    ``inversion`` stage (K-FAC's eigendecompositions, MKOR's Sherman-Morrison update, which
    only update steps enter); zeros for LAMB alone."""
    from reproductions.mkor.bert import preconditioner_of

    precond = preconditioner_of(optimizer)
    if precond is None:
        return 0.0, 0.0
    last = precond.timer.last
    return float(sum(last.values())), float(last.get("inversion", 0.0))


def timed_step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor],
               device: torch.device) -> tuple[float, float]:
    """One whole training step, as :func:`reproductions.mkor.bert.train` takes it (fp32, no
    accumulation): zero grad, forward, backward, preconditioner and first-order step.

    Returns:
        ``(seconds of the step, loss)``.
    """
    sync_device(device)
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = pretraining_loss(model, batch)[0]
    loss.backward()
    value = float(loss.detach())
    optimizer.step(value)
    sync_device(device)
    return time.perf_counter() - start, value


def measure_step_times(cfg: PretrainConfig, tokenizer: Any, train_examples: Any, *,
                       repeats: int = 25, warmup: int = 3, device: torch.device | None = None,
                       methods: Sequence[str] = METHODS,
                       log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time update and plain training steps of ``methods`` on ``cfg``'s BERT.

    Every method trains its own copy of one freshly initialised model (seed ``cfg.seed``), built
    by :func:`reproductions.mkor.bert.make_optimizer` from :func:`timing_config` of ``cfg``, on
    the first few training batches of ``cfg`` (the same for every method). A round gives each
    method, in an order rotated by one every round, an update step then a plain step; the first
    ``warmup`` rounds are not kept.

    Args:
        cfg: The experiment (model, batch, sequence length, optimizers' options, seed).
        tokenizer: Its tokenizer.
        train_examples: Its training examples
            (:func:`reproductions.mkor.data.pretraining_examples`).
        repeats: Rounds kept.
        warmup: Rounds discarded first.
        device: Where to run (default CPU).
        methods: Which of :data:`METHODS` to time; ``lamb`` is needed for the ratios.
        log: Called with a line after every round (progress), if given.

    Returns:
        ``{"samples": {method: {"update": [s], "plain": [s]}}``, the same for
        ``second_order_s`` (the preconditioner's own stages) and ``inversion_s`` (its
        ``inversion`` stage), ``"losses": {method: [loss per step]}``, ``"medians"`` and
        ``"second_order_medians"`` (:func:`medians`), ``"parameters": int,
        "preconditioned_layers": {method: int}}``.
    """
    from reproductions.mkor.bert import make_optimizer, preconditioner_of

    device = device or torch.device("cpu")
    tcfg = timing_config(cfg)
    seed_everything(cfg.seed)
    initial = build_model(cfg.model, len(tokenizer), cfg.dropout)
    batches = data.PretrainingBatches(train_examples, tokenizer, micro_batch=cfg.batch_size,
                                      accumulation=1, world_size=1, rank=0, seed=cfg.seed,
                                      mlm_probability=cfg.mlm_probability)
    fixed = [data.to_device(batches.batch(step), device) for step in range(4)]
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    runs: dict[str, tuple[nn.Module, Any]] = {}
    for name in methods:
        model = copy.deepcopy(initial).to(device)
        model.train()
        runs[name] = (model, make_optimizer(tcfg, name, model, scaler, 1))
    samples: dict[str, dict[str, list[float]]] = {m: {"update": [], "plain": []} for m in methods}
    second: dict[str, dict[str, list[float]]] = {m: {"update": [], "plain": []} for m in methods}
    inversion: dict[str, dict[str, list[float]]] = {m: {"update": [], "plain": []}
                                                    for m in methods}
    losses: dict[str, list[float]] = {m: [] for m in methods}
    order = list(methods)
    for round_ in range(warmup + repeats):
        for name in order[round_ % len(order):] + order[:round_ % len(order)]:
            model, optimizer = runs[name]
            for kind in ("update", "plain"):  # step 2r is an update step, 2r + 1 a plain one
                seconds, loss = timed_step(model, optimizer, fixed[len(losses[name]) % 4],
                                           device)
                losses[name].append(loss)
                if round_ >= warmup:
                    samples[name][kind].append(seconds)
                    total, inverting = _second_order_seconds(optimizer)
                    second[name][kind].append(total)
                    inversion[name][kind].append(inverting)
        if log is not None:
            kept = max(0, round_ + 1 - warmup)
            log(f"round {round_ + 1}/{warmup + repeats} ({kept} kept): " + ", ".join(
                f"{n} {samples[n]['update'][-1]:.3f}/{samples[n]['plain'][-1]:.3f} s"
                for n in order if samples[n]["update"]))
    layers = {}
    for name, (_, optimizer) in runs.items():
        precond = preconditioner_of(optimizer)
        layers[name] = 0 if precond is None else len(precond.layers)
    return {"samples": samples, "second_order_s": second, "inversion_s": inversion,
            "losses": losses,
            "medians": medians(samples),
            "second_order_medians": medians(second),
            "parameters": sum(p.numel() for p in initial.parameters()),
            "preconditioned_layers": layers}


# ----------------------------------------------------------------------------------------------
# The table

def frequency_table(results: dict[str, Any], frequencies: Sequence[int] = FREQUENCIES) -> Table:
    """M7 from a measurement (:func:`run_measurement`'s data or a loaded results file)."""
    times = results["medians"]
    per_f = amortised(times, frequencies)
    rows: list[list[Any]] = []
    for i, f in enumerate(frequencies):
        kfac, mkor = per_f["kfac"][str(f)], per_f["mkor"][str(f)]
        rows.append([f, PAPER_CLAIM if i == 0 else "(figure only)", kfac["seconds"],
                     kfac["ratio_to_lamb"], mkor["seconds"], mkor["ratio_to_lamb"],
                     kfac["seconds"] / mkor["seconds"]])
    second = results.get("second_order_medians", {})
    config = results.get("config", {})
    hw_start = results.get("hardware_start", {})
    hw_end = results.get("hardware_end", {})

    def ms(method: str, kind: str, table: dict[str, Any] = times) -> str:
        value = table.get(method, {}).get(kind)
        return "?" if value is None else f"{value * 1e3:,.0f} ms"

    kfac_opts = with_defaults(KFACConfig, config.get("preconditioner", {}).get("kfac", {}))
    mkor_opts = with_defaults(MKORConfig, config.get("preconditioner", {}).get("mkor", {}))
    shape = MODEL_PRESETS.get(config.get("model", ""), {})
    widest = (shape.get("intermediate_size", 0) + 1) if shape else "?"
    notes = (
        "Paper: Fig. 3.4a (thesis) plots the average time per iteration of MKOR and KAISA on "
        "BERT-Large-Uncased (and an autoencoder) against the inversion frequency on GPUs; it "
        "prints no values, so the paper column states its figure-level claim. "
        f"Ours ({results.get('experiment', '?')} config): BERT {config.get('model', '?')} "
        f"({results.get('parameters', 0) / 1e6:.2f} M parameters), batch "
        f"{config.get('batch_size', '?')} x {config.get('seq_len', '?')} tokens, fp32, "
        f"LAMB base, in one process on {hw_start.get('cpu', '?')} with "
        f"{hw_start.get('threads', '?')} thread(s) (1-minute load average "
        f"{(hw_start.get('load_average') or ['?'])[0]} at the start, "
        f"{(hw_end.get('load_average') or ['?'])[0]} at the end, "
        f"{hw_start.get('cpu_count', '?')} cores shared with other jobs). Each method's whole "
        "training step (forward, backward, preconditioner, LAMB) is timed through the training "
        "code (reproductions/mkor/bert.py make_optimizer), as an update step and as a plain "
        f"step; median of {results.get('repeats', '?')} rounds after "
        f"{results.get('warmup', '?')} warm-up rounds, the methods taking turns in a rotating "
        f"order. Medians: LAMB {ms('lamb', 'plain')} per step; K-FAC update "
        f"{ms('kfac', 'update')}, plain {ms('kfac', 'plain')}; MKOR update "
        f"{ms('mkor', 'update')}, plain {ms('mkor', 'plain')} (of which the preconditioner's "
        f"own stages: K-FAC {ms('kfac', 'update', second)} / {ms('kfac', 'plain', second)}, "
        f"MKOR {ms('mkor', 'update', second)} / {ms('mkor', 'plain', second)}). Time per "
        "iteration at interval f = (T_update + (f − 1) T_plain) / f; ratio = that / LAMB's "
        f"step.{_fastest_check(results)} K-FAC updates factors and inverses together "
        "every f steps (the default config has both at "
        f"{kfac_opts['inv_update_steps']}; KAISA's options: damping "
        f"{kfac_opts['damping']}, {kfac_opts['inverse_method']} "
        f"decomposition, factor decay {kfac_opts['factor_decay']}); MKOR with "
        f"{mkor_opts['inverse_dtype'] or 'float32'} inverse factors, "
        f"{mkor_opts['update_rule']} update rule. What differs from the paper and "
        "why: a CPU, not A100s (no GPU here), so the dense products of the forward and backward "
        f"pass weigh relatively more; a {shape.get('num_hidden_layers', '?')}-layer, "
        f"{shape.get('hidden_size', '?')}-wide BERT, not BERT-Large (the size the default run "
        f"trains on a CPU), whose factors are at most {widest} wide, so an eigendecomposition "
        f"costs little beside the {config.get('vocab_size', 0):,}-word decoder's forward and "
        "backward pass (left first-order by every method), which dominates every step; one "
        "process, so no factor or inverse communication "
        "(which KAISA pays on every update at 64 GPUs and MKOR barely). All three make the "
        "dependence on f weaker here than on BERT-Large."
    )
    return Table(
        id="M7", title="Time per iteration against the inversion interval f (Fig. 3.4a)",
        kind="small",
        columns=["f (steps per second-order update)", "paper (Fig. 3.4a)",
                 "ours: KAISA (K-FAC) s per iteration", "ours: KAISA / LAMB",
                 "ours: MKOR s per iteration", "ours: MKOR / LAMB", "ours: KAISA / MKOR"],
        rows=rows, notes=notes)


def with_defaults(config_type: type, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` completed with the defaults of the other fields of ``config_type`` (a
    preconditioner's config dataclass): a config file holds only the options it changes, and
    the notes name the ones the run used."""
    defaults = {f.name: f.default for f in fields(config_type) if f.default is not MISSING}
    return {**defaults, **options}


def _fastest_check(results: dict[str, Any]) -> str:
    """A sentence with the ratios computed from each kind's fastest sample instead of the
    median (a check against the load of a shared machine); empty without samples."""
    samples = results.get("samples")
    if not isinstance(samples, dict) or any(
            not samples.get(m, {}).get(k) for m in METHODS for k in ("update", "plain")):
        return ""
    fastest = {m: {k: min(v) for k, v in kinds.items()} for m, kinds in samples.items()}
    fastest["lamb"] = dict.fromkeys(("update", "plain"), min(min(v) for v in
                                                             samples["lamb"].values()))
    per_f = amortised(fastest, (1, 10, 200))
    ratios = "; ".join(
        f"{NAMES[m]} / LAMB " + ", ".join(f"{per_f[m][str(f)]['ratio_to_lamb']:.2f} at f = {f}"
                                          for f in (1, 10, 200)) for m in ("kfac", "mkor"))
    return (" From each kind's fastest sample instead of the median (a check against the "
            f"shared machine's load, which slows some steps 1.5-2x): {ratios}.")


def load_measurement(path: Path = DEFAULT_RESULTS) -> dict[str, Any]:
    """Read a results file of this measurement and check what the table needs.

    Raises:
        FrequencyError: missing, not JSON, another schema, or lacking medians of a method.
    """
    results = read_measurement(path, SCHEMA, FrequencyError,
                               "python -m reproductions.mkor.frequency")
    times = results.get("medians")
    for method in METHODS:
        entry = times.get(method) if isinstance(times, dict) else None
        if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), int | float) and entry[k] > 0
                for k in ("update", "plain")):
            raise FrequencyError(f"{path}: field 'medians.{method}' needs positive 'update' "
                                 "and 'plain' seconds")
    return results


def table_from_results(path: Path = DEFAULT_RESULTS) -> Table:
    """M7 from the committed results file, without measuring."""
    return frequency_table(load_measurement(path))


# ----------------------------------------------------------------------------------------------
# Command line

def run_measurement(cfg: PretrainConfig, *, repeats: int, warmup: int, device: torch.device,
                    data_dir: str | None, log: Callable[[str], None] | None = print
                    ) -> dict[str, Any]:
    """Load ``cfg``'s data and measure; returns the results file's data."""
    started, t0 = utc_now(), time.perf_counter()
    hw_start = hardware_info(1, device)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device, is_main=True)
    (train_examples, _), tokenizer = prepare_examples(cfg, ctx,
                                                      argparse.Namespace(data_dir=data_dir))
    measured = measure_step_times(cfg, tokenizer, train_examples, repeats=repeats,
                                  warmup=warmup, device=device, log=log)
    return {"schema": SCHEMA, "paper": "mkor", "experiment": cfg.experiment,
            "config": cfg.to_dict(), "timing_interval": TIMING_INTERVAL,
            "repeats": repeats, "warmup": warmup, "git_revision": git_revision(),
            "hardware_start": hw_start, "hardware_end": hardware_info(1, device),
            "started": started, "finished": utc_now(),
            "wall_s": time.perf_counter() - t0, **measured,
            "amortised": amortised(measured["medians"])}


def main(argv: list[str] | None = None) -> Table:
    """Measure, write the results file, print the table; returns it."""
    parser = argparse.ArgumentParser(prog="python -m reproductions.mkor.frequency",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measurement_arguments(parser)
    parser.add_argument("--repeats", type=positive_int, default=25,
                        help="rounds kept per method (default 25)")
    parser.add_argument("--warmup", type=int_at_least(0), default=3,
                        help="rounds discarded first (default 3)")
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        if args.from_results is not None:
            return report(table_from_results(args.from_results))
        cfg = measured_config(args)
        out = measurement_output(args, RESULTS_DIR, cfg.experiment)
        results = run_measurement(cfg, repeats=args.repeats, warmup=args.warmup,
                                  device=torch.device(args.device), data_dir=args.data_dir)
        write_measurement(out, results)
        return report(frequency_table(results), out, results["wall_s"])


if __name__ == "__main__":
    main()
