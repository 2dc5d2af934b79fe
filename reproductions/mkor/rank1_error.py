"""M8: the error of MKOR's rank-1 factors during training (MKOR paper, Fig. 3.6 / A.4).

MKOR replaces a layer's batch covariance of input rows, ``A = (1/n) Σᵢ aᵢ aᵢᵀ`` over the ``n``
rows of a batch (K-FAC's batch factor), by the outer product of the mean row, ``ā āᵀ``
(``ā = (1/n) Σᵢ aᵢ``), and likewise the output-gradient covariance ``G`` by ``ḡ ḡᵀ``. The paper
shows the distribution of this approximation's error over the layers of BERT-Large and
ResNet-50 and says it decreases during training. It prints no formula for the error; here it is

    e(A) = ‖A − ā āᵀ‖_F / ‖A‖_F,

computed exactly in float64 from the rows of one batch. ``A − ā āᵀ`` is the rows' centred
covariance, so ``e`` is small when the rows' common mean dominates their spread; ``e`` is
unchanged by scaling the rows, so the per-example scaling MKOR applies to ``ḡ`` (and K-FAC's
factor scaling) does not enter. PAPERS.md §5.2 writes the approximation as ``A Aᵀ ≈ a aᵀ`` with
``a`` the batch mean; taken literally (a sum against a mean's outer product) the two sides
differ by the factor ``b``, so they are compared at the same normalisation, the one the
factors' running averages use. For reference the error of the best rank-1 approximation
(Eckart-Young, from the eigenvalues of ``A``: ``sqrt(1 − λ₁² / Σλ²)``) is recorded too; the
mean's outer product can only be worse.

The rows are those MKOR and K-FAC build (:class:`core.layers.LayerHelper`: ``a_rows`` with the
bias entry 1 appended, sequence positions and convolution patches as rows; ``g_rows``), captured
with :class:`core.capture.CaptureHooks` on the layers MKOR preconditions in the training code.

The measurement trains MKOR on the default experiment as ``python -m reproductions.mkor.bert``
does (same warm start, model, data, schedule and options; one process, fp32) and, at a few steps
of the run, takes the errors of every preconditioned layer on one fixed held-out batch (fixed
dropout masks too), without touching the run's own statistics or random state.
``python -m reproductions.mkor.rank1_error`` writes ``results/rank1_error/default.json`` and
prints the table; :func:`table_from_results` rebuilds the table from that file.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from core.capture import CaptureHooks
from core.layers import LayerHelper, helper_for
from reproductions.common.cli import exit_on_user_error, positive_int
from reproductions.common.launch import DistContext, seed_everything
from reproductions.common.results import ResultsError, git_revision, hardware_info, utc_now
from reproductions.common.tables import Table
from reproductions.mkor import data
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

SCHEMA = "kfac-repro/mkor-rank1-error/v1"
"""The ``schema`` field of a results file of this measurement."""

POINTS = (0, 25, 50, 100, 150, 200)
"""Steps of the MKOR run after which the errors are taken (0: its starting weights)."""

SIDES = ("activation", "gradient")
"""``A`` (input rows) and ``G`` (output-gradient rows)."""

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "rank1_error"
DEFAULT_RESULTS = RESULTS_DIR / "default.json"

PAPER_CLAIM = ("figure only, no values printed: the rank-1 approximation error of the "
               "activation and input-gradient covariances decreases during training")

INIT_LABEL = "random init (before the warm start)"


class Rank1ErrorError(ResultsError):
    """A results file of this measurement is missing or malformed (the message names it; the
    command line reports it in one line)."""


# ----------------------------------------------------------------------------------------------
# The error of one covariance

def _as_rows(rows: Tensor) -> Tensor:
    """``rows`` as a float64 ``(n, d)`` matrix (leading dimensions flattened)."""
    return rows.reshape(-1, rows.shape[-1]).to(torch.float64)


def second_moment(rows: Tensor) -> Tensor:
    """``A = (1/n) Σᵢ aᵢ aᵢᵀ`` of ``n`` rows (``(..., d)``, leading dimensions flattened), in
    float64."""
    flat = _as_rows(rows)
    return flat.T @ flat / flat.shape[0]


def rank1_error(rows: Tensor) -> float:
    """``‖A − ā āᵀ‖_F / ‖A‖_F`` of the rows (float64): the relative error of MKOR's rank-1
    approximation of their second moment ``A`` by the outer product of their mean ``ā``.

    Returns:
        The error in [0, 1] (``A − ā āᵀ`` is the centred covariance, whose Frobenius norm is at
        most ``A``'s); NaN when ``A`` is zero (all rows zero).
    """
    flat = _as_rows(rows)
    moment = flat.T @ flat / flat.shape[0]
    mean = flat.mean(dim=0)
    scale = torch.linalg.matrix_norm(moment)
    if scale == 0:
        return math.nan
    # at most 1 exactly (rows of mean zero reach it); rounding gave 1 + 2e-16 for such rows
    return min(1.0, float(torch.linalg.matrix_norm(moment - torch.outer(mean, mean)) / scale))


def best_rank1_error(rows: Tensor) -> float:
    """``‖A − A₁‖_F / ‖A‖_F`` for the best rank-1 approximation ``A₁ = λ₁ u₁ u₁ᵀ`` of the rows'
    second moment (Eckart-Young: ``sqrt(1 − λ₁² / Σ λ²)``), in float64; NaN when ``A`` is zero.
    """
    eigenvalues = torch.linalg.eigvalsh(second_moment(rows))
    total = float((eigenvalues ** 2).sum())
    if total == 0:
        return math.nan
    return math.sqrt(max(0.0, 1.0 - float(eigenvalues.abs().max()) ** 2 / total))


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """``min``, ``q1``, ``median``, ``q3``, ``max`` of the finite ``values`` (quartiles by
    linear interpolation between order statistics, ``statistics.quantiles`` inclusive); None
    for each when there are none."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return dict.fromkeys(("min", "q1", "median", "q3", "max"))
    q1, median, q3 = (statistics.quantiles(finite, n=4, method="inclusive") if len(finite) > 1
                      else (finite[0],) * 3)
    return {"min": finite[0], "q1": q1, "median": median, "q3": q3, "max": finite[-1]}


# ----------------------------------------------------------------------------------------------
# Capture on a model

def preconditioned_layers(optimizer: Any) -> list[str]:
    """Names of the modules the optimizer's preconditioner works on (in model order)."""
    from reproductions.mkor.bert import preconditioner_of

    precond = preconditioner_of(optimizer)
    return [] if precond is None else [layer.name for layer in precond.layers]


def layer_errors(model: nn.Module, names: Sequence[str],
                 loss_fn: Callable[[nn.Module], Tensor], *, seed: int = 0
                 ) -> list[dict[str, Any]]:
    """The rank-1 errors of the named layers on one forward and backward pass.

    Captures each layer's inputs and output gradients (:class:`core.capture.CaptureHooks`),
    builds their rows with the layer's helper (as MKOR and K-FAC do) and computes
    :func:`rank1_error` and :func:`best_rank1_error` of each side. The pass runs in training
    mode (dropout as in training) with the random state forked and seeded with ``seed``, so
    every call sees the same masks and the caller's random state is left as it was; the
    gradients it leaves are cleared. A module called several times contributes the rows of
    every call.

    Args:
        model: The model (its other hooks, e.g. a preconditioner's, should be removed first, or
            they capture this pass too).
        names: Qualified names of the layers (Linear, Conv2d).
        loss_fn: The scalar loss of ``model`` on a fixed batch.
        seed: Seed of the pass's random state (dropout).

    Returns:
        One entry per layer and side: ``{"layer", "side", "dim", "rows", "error",
        "best_rank1_error"}`` (errors None where the second moment is zero).

    Raises:
        ValueError: a name that is not a supported module of ``model``.
    """
    modules = dict(model.named_modules())
    helpers: dict[str, LayerHelper] = {}
    for name in names:
        helper = helper_for(modules[name]) if name in modules else None
        if helper is None:
            raise ValueError(f"{name!r} is not a Linear or Conv2d module of the model")
        helpers[name] = helper
    inputs: dict[str, list[Tensor]] = {name: [] for name in names}
    grads: dict[str, list[Tensor]] = {name: [] for name in names}
    hooks = [CaptureHooks(helpers[name].module, on_input=inputs[name].append,
                          on_grad_output=grads[name].append) for name in names]
    was_training = model.training
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            loss_fn(model).backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    out = []
    for name in names:
        helper = helpers[name]
        sides = {"activation": [_as_rows(helper.a_rows(x, torch.float64).rows)
                                for x in inputs[name]],
                 "gradient": [_as_rows(helper.g_rows(g).rows) for g in grads[name]]}
        for side in SIDES:
            if not sides[side]:
                raise ValueError(f"{name}: nothing was captured on the {side} side (was the "
                                 "module used in the forward pass, and did it get a gradient?)")
            rows = torch.cat(sides[side])
            error, best = rank1_error(rows), best_rank1_error(rows)
            out.append({"layer": name, "side": side, "dim": rows.shape[1], "rows": rows.shape[0],
                        "error": error if math.isfinite(error) else None,
                        "best_rank1_error": best if math.isfinite(best) else None})
    return out


def summarise(errors: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per side: :func:`quantiles` of the layers' errors, the median best rank-1 error and the
    number of layers."""
    out = {}
    for side in SIDES:
        entries = [e for e in errors if e["side"] == side]
        mine = [e["error"] for e in entries if e["error"] is not None]
        best = [e["best_rank1_error"] for e in entries if e["best_rank1_error"] is not None]
        out[side] = {**quantiles(mine), "best_rank1_median": quantiles(best)["median"],
                     "layers": len(entries)}
    return out


# ----------------------------------------------------------------------------------------------
# The measurement during training

def measure_during_training(cfg: PretrainConfig, tokenizer: Any, examples: tuple[Any, Any], *,
                            points: Sequence[int] = POINTS, init_checkpoint: str | None = None,
                            include_init: bool = False, device: torch.device | None = None,
                            log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train MKOR on ``cfg`` as :func:`reproductions.mkor.bert.train` does (one process, fp32,
    the config's schedule and options) for ``max(points)`` steps, taking the rank-1 errors of
    its preconditioned layers on the first held-out batch after each step in ``points``.

    Args:
        cfg: The experiment.
        tokenizer: Its tokenizer.
        examples: Its (training, held-out) examples.
        points: Steps after which to measure (0: the starting weights).
        init_checkpoint: Weights the run starts from (the warm start's), or None.
        include_init: Also measure the random initialisation (seed ``cfg.seed``: the weights
            the warm start starts from), as the first point.
        device: Where to run (default CPU).
        log: Called with a line per measured point, if given.

    Returns:
        ``{"points": [{"label", "step", "held_out_loss", "summary", "layers"}], "train_losses":
        [...], "layers": [names], "train_s": seconds of the training steps, "measure_s": ...}``.
    """
    from reproductions.mkor.bert import make_optimizer, make_scheduler, preconditioner_of

    device = device or torch.device("cpu")
    points = sorted(set(points))
    if not points or points[0] < 0:
        raise ValueError(f"points must be steps >= 0, got {points}")
    held_out = data.to_device(data.held_out_batches(
        examples[1], tokenizer, batch_size=cfg.batch_size, count=1, seed=cfg.seed,
        mlm_probability=cfg.mlm_probability)[0], device)

    def loss_fn(m: nn.Module) -> Tensor:
        return pretraining_loss(m, held_out)[0]

    results: list[dict[str, Any]] = []
    measure_s = 0.0

    def measure(model: nn.Module, names: Sequence[str], label: str, step: int | None) -> None:
        nonlocal measure_s
        start = time.perf_counter()
        errors = layer_errors(model, names, loss_fn, seed=cfg.seed)
        with torch.no_grad():
            model.eval()
            held = float(loss_fn(model))
            model.train()
        summary = summarise(errors)
        results.append({"label": label, "step": step, "held_out_loss": held,
                        "summary": summary, "layers": errors})
        measure_s += time.perf_counter() - start
        if log is not None:
            log(f"{label}: held-out loss {held:.4f}; median error activation "
                f"{summary['activation']['median']:.4f}, gradient "
                f"{summary['gradient']['median']:.4f}")

    seed_everything(cfg.seed)
    if include_init:
        random_init = build_model(cfg.model, len(tokenizer), cfg.dropout).to(device)
    seed_everything(cfg.seed)  # as bert.train: the run's own random state starts here
    model = build_model(cfg.model, len(tokenizer), cfg.dropout, init_checkpoint).to(device)
    seed_everything(cfg.seed)  # as bert.train's rank 0: its dropout stream starts here
    model.train()
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    optimizer = make_optimizer(cfg, "mkor", model, scaler, 1)
    scheduler = make_scheduler(cfg, optimizer)
    names = preconditioned_layers(optimizer)
    precond = preconditioner_of(optimizer)
    if include_init:
        measure(random_init, names, INIT_LABEL, None)
        del random_init
    batches = data.PretrainingBatches(examples[0], tokenizer, micro_batch=cfg.batch_size,
                                      accumulation=1, world_size=1, rank=0, seed=cfg.seed,
                                      mlm_probability=cfg.mlm_probability)
    losses: list[float] = []
    train_s = 0.0
    for step in range(points[-1] + 1):
        if step in points:
            precond.remove_hooks()  # the run's statistics see only its own batches
            measure(model, names, f"MKOR step {step}", step)
            precond.add_hooks()
        if step == points[-1]:
            break
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = pretraining_loss(model, data.to_device(batches.batch(step), device))[0]
        loss.backward()
        value = float(loss.detach())
        optimizer.step(value)
        scheduler.step()
        train_s += time.perf_counter() - start
        losses.append(value)
    return {"points": results, "train_losses": losses, "layers": names,
            "train_s": train_s, "measure_s": measure_s}


# ----------------------------------------------------------------------------------------------
# The table

def _point_name(point: dict[str, Any], steps: int | None, warm_started: bool) -> str:
    if point["step"] is None:
        return point["label"]
    name = f"MKOR step {point['step']}" + (f" of {steps}" if steps else "")
    return name + (" (the warm start's weights)" if point["step"] == 0 and warm_started else "")


def error_table(results: dict[str, Any]) -> Table:
    """M8 from a measurement (:func:`run_measurement`'s data or a loaded results file)."""
    config = results.get("config", {})
    steps = results.get("run_steps")
    rows: list[list[Any]] = []
    for i, point in enumerate(results["points"]):
        for side in SIDES:
            s = point["summary"][side]
            rows.append([_point_name(point, steps, bool(results.get("warm_started"))), side,
                         PAPER_CLAIM if i == 0 and side == SIDES[0] else "(figure only)",
                         s["min"], s["q1"], s["median"], s["q3"], s["max"],
                         s["best_rank1_median"], point["held_out_loss"]])
    hw = results.get("hardware_start", {})
    layers = results.get("layers", [])
    warm = config.get("warm_start")
    start = ("the weights of the default run's LAMB warm start "
             f"({warm.get('steps')} steps at sequence {warm.get('seq_len')}, trained here by "
             "reproductions/mkor/bert.py's warm_start)" if warm and results.get("warm_started")
             else "its random initialisation")
    mkor = config.get("preconditioner", {}).get("mkor", {})
    shape = MODEL_PRESETS.get(config.get("model", ""), {})
    sources = config.get("corpus", ["?"])
    corpus = ("the built-in English corpus" if sources == ["builtin"]
              else "the corpus " + ", ".join(sources))
    notes = (
        "Paper: Fig. 3.6 (thesis; Fig. A.4 in the appendix) shows, for BERT-Large-Uncased and "
        "ResNet-50, the distribution over layers of the error of MKOR's rank-1 approximation "
        "of the activation and input-gradient covariances at points of training, and states "
        "that the error decreases during training; it prints no values and no formula, so the "
        "paper column states the figure's claim. Ours: e = ‖A − ā āᵀ‖_F / ‖A‖_F per layer, "
        "A = (1/n) Σ a aᵀ over the n rows of one batch (K-FAC's batch factor) and ā their mean "
        "(MKOR's vector), and the same for G with the output-gradient rows; exact, in float64, "
        "from the rows core's layer helpers build for MKOR and K-FAC (bias entry appended, "
        "every sequence position a row). A − ā āᵀ is the rows' centred covariance, so e, in "
        "[0, 1], is the size of the rows' spread about their mean relative to their second "
        "moment (0: identical rows); it is scale-free "
        "(MKOR's per-example scaling of ḡ does not enter). Quartiles over the "
        f"{len(layers)} layers MKOR preconditions in the training code (every encoder Linear, "
        "the pooler, the prediction head's transform and the NSP classifier; the vocabulary "
        "decoder is left first-order; query, key and value share their input, so their "
        "activation errors coincide), on one fixed held-out batch of "
        f"{config.get('batch_size', '?')} x {config.get('seq_len', '?')} tokens with fixed "
        "dropout masks. 'best rank-1' is the median error of the best rank-1 approximation "
        "(Eckart-Young), which the mean's outer product cannot beat. The run: MKOR on the "
        f"{results.get('experiment', '?')} config (BERT {config.get('model', '?')}, LAMB base, "
        f"update every {mkor.get('inv_update_steps', '?')} steps, lr {config.get('lr', '?')} "
        f"with the {config.get('schedule', '?')} schedule over {steps} steps) from {start}, "
        "as python -m reproductions.mkor.bert trains it (one process, fp32); the measurement "
        f"does not touch the run's statistics or random state. {hw.get('threads', '?')} "
        f"thread(s) on {hw.get('cpu', '?')}: warm start {results.get('warm_start_s', 0):.0f} "
        f"s, MKOR training {results.get('train_s', 0):.0f} s, measuring "
        f"{results.get('measure_s', 0):.0f} s. What differs from the paper: a "
        f"{shape.get('num_hidden_layers', '?')}-layer, {shape.get('hidden_size', '?')}-wide "
        f"BERT on {corpus} over {steps} steps of "
        "phase 2 (the size the default run trains on a CPU), not BERT-Large on Wikipedia and "
        "BookCorpus or ResNet-50 on ImageNet over whole trainings; one batch per point, not "
        "the paper's (unstated) sample; the paper's exact error measure is not given."
    )
    return Table(
        id="M8", title="Rank-1 approximation error of the factors during training "
                       "(Fig. 3.6 / A.4)",
        kind="small",
        columns=["point of training", "side", "paper (Fig. 3.6 / A.4)", "ours: min",
                 "ours: 25%", "ours: median", "ours: 75%", "ours: max",
                 "ours: median of the best rank-1", "ours: held-out loss (that batch)"],
        rows=rows, notes=notes)


def load_measurement(path: Path = DEFAULT_RESULTS) -> dict[str, Any]:
    """Read a results file of this measurement and check what the table needs.

    Raises:
        Rank1ErrorError: missing, not JSON, another schema, or points without summaries.
    """
    results = read_measurement(path, SCHEMA, Rank1ErrorError,
                               "python -m reproductions.mkor.rank1_error")
    points = results.get("points")
    if not isinstance(points, list) or not points:
        raise Rank1ErrorError(f"{path}: field 'points' must be a non-empty list")
    for i, point in enumerate(points):
        summary = point.get("summary") if isinstance(point, dict) else None
        if not isinstance(summary, dict) or any(
                not isinstance(summary.get(side), dict) or "median" not in summary[side]
                for side in SIDES):
            raise Rank1ErrorError(f"{path}: field 'points[{i}].summary' needs the quartiles "
                                  f"of {' and '.join(SIDES)}")
    return results


def table_from_results(path: Path = DEFAULT_RESULTS) -> Table:
    """M8 from the committed results file, without measuring."""
    return error_table(load_measurement(path))


# ----------------------------------------------------------------------------------------------
# Command line

def run_measurement(cfg: PretrainConfig, *, points: Sequence[int], out: Path,
                    init_checkpoint: str | None, device: torch.device, data_dir: str | None,
                    log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """The warm start (unless ``init_checkpoint`` or the config has none), the data and the
    measurement; returns the results file's data.

    The warm start is :func:`reproductions.mkor.bert.warm_start` with ``out`` as its output
    directory (reused when it finished there before with the same settings).
    """
    from reproductions.mkor import bert

    started, t0 = utc_now(), time.perf_counter()
    hw_start = hardware_info(1, device)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device, is_main=True)
    warm_s = 0.0
    warm_started = False
    if init_checkpoint is None and cfg.warm_start is not None:
        args = argparse.Namespace(out=out, resume=True, wandb="disabled", stop_after=None,
                                  data_dir=data_dir)
        start = time.perf_counter()
        model_dir = bert.warm_start(cfg, ctx, args)
        warm_s = time.perf_counter() - start
        assert model_dir is not None
        init_checkpoint, warm_started = str(model_dir), True
    examples, tokenizer = bert.prepare_examples(cfg, ctx, argparse.Namespace(data_dir=data_dir))
    measured = measure_during_training(
        cfg, tokenizer, examples, points=[p for p in points if p <= cfg.steps],
        init_checkpoint=init_checkpoint, include_init=warm_started, device=device, log=log)
    return {"schema": SCHEMA, "paper": "mkor", "experiment": cfg.experiment,
            "config": cfg.to_dict(), "run_steps": cfg.steps, "warm_started": warm_started,
            "warm_start_s": warm_s, "git_revision": git_revision(),
            "hardware_start": hw_start, "hardware_end": hardware_info(1, device),
            "started": started, "finished": utc_now(), "wall_s": time.perf_counter() - t0,
            **measured}


def main(argv: list[str] | None = None) -> Table:
    """Measure, write the results file, print the table; returns it."""
    parser = argparse.ArgumentParser(prog="python -m reproductions.mkor.rank1_error",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measurement_arguments(parser)
    parser.add_argument("--steps", type=positive_int,
                        help="steps of the MKOR run (default: the config's; sets the schedule)")
    parser.add_argument("--points", default=",".join(map(str, POINTS)),
                        help="steps after which to measure, comma-separated (default "
                             f"{','.join(map(str, POINTS))}; those beyond the run are dropped)")
    parser.add_argument("--init-checkpoint", dest="init_checkpoint", metavar="PATH",
                        help="start the MKOR run from these weights instead of running (or "
                             "reusing) the config's warm start")
    parser.add_argument("--warm-start-out", type=Path, default=Path("runs/mkor/rank1_error"),
                        help="where the warm start is trained and kept for reuse (default "
                             "runs/mkor/rank1_error)")
    args = parser.parse_args(argv)
    with exit_on_user_error(parser):
        if args.from_results is not None:
            return report(table_from_results(args.from_results))
        cfg = measured_config(args)
        if args.steps:
            cfg = replace(cfg, steps=args.steps)
        try:
            points = [int(p) for p in args.points.split(",") if p.strip()]
        except ValueError:
            parser.error(f"--points {args.points!r}: comma-separated integers expected")
        if not [p for p in points if 0 <= p <= cfg.steps]:  # before any data or training
            parser.error(f"--points {args.points!r}: no step in 0..{cfg.steps}, the run's "
                         "steps (give points within them, or more --steps)")
        if any(p < 0 for p in points):
            parser.error(f"--points {args.points!r}: steps must be >= 0")
        out = measurement_output(args, RESULTS_DIR, cfg.experiment)
        results = run_measurement(cfg, points=points, out=args.warm_start_out,
                                  init_checkpoint=args.init_checkpoint,
                                  device=torch.device(args.device), data_dir=args.data_dir)
        write_measurement(out, results)
        return report(error_table(results), out, results["wall_s"])


if __name__ == "__main__":
    main()
