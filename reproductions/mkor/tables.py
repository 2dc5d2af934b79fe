"""The MKOR paper's tables rebuilt beside its numbers: ``python -m reproductions.mkor.tables``.

* **M1, Table 1 (complexity)**, exact: per-layer state memory and communication of MKOR, K-FAC
  (KAISA), Eva and LAMB for a ``d x d`` layer, measured (:mod:`reproductions.mkor.measure`) at
  64 GPUs for several ``d`` including BERT-Large's 1024, with the fitted exponent of ``d``;
  plus the update and preconditioning time on this machine.
* **M2, per-GPU memory**, exact for optimizer state: BERT-Large (LAMB, KAISA, MKOR, Eva) and
  ResNet-50 (SGD, KAISA, MKOR) at 64 GPUs.
* **M3, Table 2's speed-up columns**, small: steps and time for each optimizer to reach LAMB's
  final pre-training loss, from the committed results of the default run
  (:mod:`reproductions.mkor.report` defines the measure).
* **M4, SQuAD / GLUE fine-tuning** (Tables 2-4), needs data: the paper's scores (SQuAD F1, GLUE
  average and per task) and the commands that produce ours from the user's copy of the data.
* **M5, Figure 6 in small** and **M6, Table A.2 in small**: epochs and time to a test-accuracy
  target for MKOR, KAISA and SGD on a small ResNet on Fashion-MNIST, and against the learning
  rate, from the committed runs of :mod:`reproductions.mkor.cnn_study`.
* **M7, time per iteration against the inversion interval** (Fig. 3.4a), small: from the
  committed measurement of :mod:`reproductions.mkor.frequency` on the default BERT.
* **M8, rank-1 approximation error of the factors during training** (Fig. 3.6 / A.4), small:
  from the committed measurement of :mod:`reproductions.mkor.rank1_error`.

The tables are printed as Markdown and written in the ``kfac-repro/tables/v1`` schema to
``reproductions/mkor/results/tables.json`` (``--sections`` rebuilds some and keeps the rest).
Measuring BERT-Large and ResNet-50 (M1, M2) takes a minute or a few on a CPU (one real update
step of each method; ``--model`` and ``--cnn`` pick smaller shapes); the other tables read
committed results.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from core.rank1 import BERT_DECODER_PATTERN
from reproductions.common.cli import exit_on_user_error, positive_int
from reproductions.common.cost import FlopCost, mean_row_flops, sherman_morrison_flops
from reproductions.common.results import SCHEMA as RESULTS_SCHEMA
from reproductions.common.results import ResultsError, check_comparable, load_results
from reproductions.common.tables import Table, tables_destination, update_tables
from reproductions.mkor import cnn_study, frequency, rank1_error
from reproductions.mkor.config import MODEL_PRESETS, load_config
from reproductions.mkor.measure import (
    METHODS,
    TABLE1_ROWS,
    Cost,
    image_classifier,
    linear_layer,
    measure_costs,
    update_times,
)
from reproductions.mkor.model import build_model, pretraining_loss
from reproductions.mkor.report import BASELINE, compare, speedups

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = RESULTS_DIR.parents[2]

NAMES = {"lamb": "LAMB", "kfac": "KAISA (K-FAC)", "mkor": "MKOR", "mkor-h": "MKOR-H",
         "eva": "Eva", "sgd": "SGD"}

PAPER_TABLE1 = {  # memory, communication, computation, as printed (PAPERS.md §5.3)
    "mkor": ("O(2d²/2)", "O(2d/2)", "O(d² + bd)"),
    "kfac": ("O(4d²)", "O(4d²)", "O(d³)"),
    "eva": ("O(2d)", "O(2d)", "O(d² + bd)"),
    "lamb": ("O(d²)", "(blank)", "(blank)"),
}
# The paper's numbers are kept as printed (strings), so no digit is lost to formatting.
PAPER_MEMORY_GB = {"lamb": "12.80", "kfac": "29.97", "mkor": "23.34", "eva": None}
"""Thesis Table 3.5, BERT row: per-GPU memory (GB) at 64 A100s; no Eva entry."""
PAPER_RESNET_MEMORY_GB = {"sgd": "3.01", "kfac": "5.83", "mkor": "3.88"}
"""Thesis Table 3.5, ResNet-50 row: per-GPU memory (GB) at 64 V100s (ImageNet)."""
PAPER_BERT, PAPER_CNN = "bert-large", "resnet50"
"""The paper's models: Table 3.5's numbers are shown beside these shapes only."""
CNN_CHOICES = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
"""torchvision CNNs M2's second half can measure (``--cnn``)."""
RESNET50_OPTIONS: dict[str, dict[str, Any]] = {
    # KAISA's ImageNet example defaults, which the MKOR repo's ResNet-50 example keeps
    # (PAPERS.md §3.4): comm-opt, factors every 10 steps, inverses every 100, damping 1e-3,
    # factor decay 0.95, kl_clip 1e-3, factors reduced in the backward hooks, eigenvalues
    # pre-divided (KAISA's compute_eigenvalue_outer_product=True).
    "kfac": {"strategy": "comm-opt", "factor_update_steps": 10, "inv_update_steps": 100,
             "damping": 0.001, "factor_decay": 0.95, "kl_clip": 0.001,
             "factor_scaling": "kaisa", "inverse_method": "eigen", "prediv_eigenvalues": True,
             "factors_in_backward": True},
    # MKOR every 10 steps (PAPERS.md §5.5), fp16 inverse factors and wire (half_precision).
    "mkor": {"inv_update_steps": 10, "stat_decay": 0.95, "update_rule": "exact",
             "inverse_dtype": "float16", "comm_dtype": "float16"},
    # SGD with momentum 0.9 and weight decay 5e-5 (KAISA's example): one momentum buffer.
    "sgd": {"lr": 0.0125, "momentum": 0.9, "weight_decay": 5e-5},
}
"""The ResNet-50 half of M2: options of the methods as the MKOR repo's ImageNet example."""
KAISA_MODES = {
    "comm-opt": "every GPU holds all factors, eigen-decompositions and communication buffers",
    "mem-opt": "every GPU holds all factors, but each layer's eigen-decompositions are kept "
               "only by the GPU that computes them, which broadcasts the preconditioned "
               "gradient; plus communication buffers",
    "hybrid-opt": "every GPU holds all factors, but each layer's eigen-decompositions are kept "
                  "only by a group of GPUs; plus communication buffers",
    "d-kfac": "every GPU holds and computes all factors and eigen-decompositions",
}
"""What one GPU holds under each K-FAC strategy M2 may be given."""
RUNNER_MODE = (", as the official MKOR BERT runner builds KAISA (comm_method=MEM_OPT in "
               "Mohammad-Mozaffari/mkor examples/bert/run_pretraining.py)")
PAPER_TABLE2 = {  # iterations, hours, speed-up, SQuAD v1.1 F1 (paper Table 2)
    "lamb": ("1,563", "7.97", "1.00", "90.44"), "kfac": ("1,000", "5.71", "1.39", "90.44"),
    "mkor": ("1,000", "5.25", "1.51", "90.50"), "mkor-h": ("600", "3.10", "2.57", "90.64"),
    "eva": ("1,000", "5.24", "1.52", "90.55")}
#: Table 3 prints two MKOR rows (1,500 and 600 iterations); both are quoted, labelled.
GLUE_ROWS = {"lamb": "LAMB", "kfac": "KAISA (K-FAC)", "mkor-1500": "MKOR (1,500 iterations)",
             "mkor-600": "MKOR (600 iterations)", "mkor-h": "MKOR-H", "eva": "Eva"}
PAPER_GLUE_AVERAGE = {  # paper Table 3 (PAPERS.md §5.6)
    "lamb": "0.8023", "kfac": "0.796", "mkor-1500": "0.8214", "mkor-600": "0.8078",
    "mkor-h": "0.811", "eva": "0.809"}
GLUE_TASKS = ("MNLI (acc)", "QQP (F1)", "QNLI (acc)", "SST-2 (acc)", "CoLA (mcc)",
              "STS-B (corr)", "MRPC (F1)", "RTE (acc)")
PAPER_GLUE_TASKS = {  # paper Table 4, per task in GLUE_TASKS' order (PAPERS.md §5.6)
    "lamb": ("0.841", "0.878", "0.913", "0.919", "0.516", "0.875", "0.812", "0.664"),
    "kfac": ("0.821", "0.854", "0.900", "0.921", "0.489", "0.878", "0.888", "0.617"),
    "mkor-1500": ("0.844", "0.879", "0.916", "0.923", "0.523", "0.892", "0.905", "0.690"),
    "mkor-600": ("0.833", "0.878", "0.904", "0.921", "0.494", "0.886", "0.893", "0.653"),
    "mkor-h": ("0.838", "0.877", "0.911", "0.921", "0.502", "0.886", "0.898", "0.657"),
    "eva": ("0.839", "0.877", "0.907", "0.914", "0.499", "0.890", "0.904", "0.650")}
GB = 1e9
SECTIONS = ("M1", "M2", "M3", "M4", "M5", "M6", "M7", "M8")
"""The tables :func:`main` builds, in the file's order."""


# ----------------------------------------------------------------------------------------------
# M1 and M2: measured

def second_order_options() -> dict[str, dict[str, Any]]:
    """The paper-scale preconditioner options (bert_large_phase2.json) as the training code
    composes them (``reproductions.mkor.bert``): the vocabulary decoder skipped unless the
    config names its own ``skip_layers`` (K-FAC's skips the whole LM-prediction head)."""
    options = load_config("bert_large_phase2").preconditioner
    return {name: {"skip_layers": (BERT_DECODER_PATTERN,), **opts}
            for name, opts in options.items()}


def fitted_exponent(dims: Sequence[int], values: Sequence[float | None]) -> float | None:
    """Least-squares slope of log(value) against log(d); None unless every value is > 0."""
    if len(dims) < 2 or any(v is None or v <= 0 for v in values):
        return None
    xs = [math.log(d) for d in dims]
    ys = [math.log(v) for v in values]  # type: ignore[arg-type]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)


def update_flops(method: str, d: int, kfac_inverse_method: str,
                 rows: int = TABLE1_ROWS) -> int | None:
    """Counted FLOPs of one update of a ``d x d`` layer's statistics on ``rows`` rows, under
    :mod:`reproductions.common.cost`'s conventions (the input side has ``d + 1`` entries, the
    bias's); None for a first-order method.

    K-FAC builds both factors and decomposes them; MKOR takes both mean rows and updates both
    inverse factors by Sherman–Morrison; Eva takes both mean rows (its running averages of two
    vectors are not counted)."""
    a, g = d + 1, d
    if method == "kfac":
        cost = FlopCost(kfac_inverse_method)
        return round(cost.factor(rows, a) + cost.factor(rows, g)
                     + cost.decomposition(a) + cost.decomposition(g))
    if method not in ("mkor", "eva"):
        return None
    statistics = mean_row_flops(rows, d) + mean_row_flops(rows, g)  # ā's bias entry is 1
    if method == "eva":
        return round(statistics)
    return round(statistics + sherman_morrison_flops(a) + sherman_morrison_flops(g))


def complexity_table(dims: Sequence[int], world_size: int, kfac_ranks: int) -> Table:
    """M1: Table 1 measured per ``d x d`` layer at ``world_size`` GPUs."""
    options = {method: {k: v for k, v in opts.items() if k != "skip_layers"}  # BERT's heads
               for method, opts in second_order_options().items()}
    strategy = options["kfac"].get("strategy", "comm-opt")
    inverse_method = options["kfac"].get("inverse_method", "eigen")
    costs, times = [], []
    for d in dims:
        layer, loss = linear_layer(d)
        costs.append(measure_costs(layer, loss, world_size=world_size, options=options,
                                   kfac_ranks=kfac_ranks))
        times.append({m: update_times(m, *linear_layer(d), options[m])
                      for m in ("kfac", "mkor", "eva")})
    rows: list[list[Any]] = []
    for method in METHODS:
        memory = [c[method].state_bytes for c in costs]
        comm = [c[method].comm_bytes or None for c in costs]
        flops = [update_flops(method, d, inverse_method) for d in dims]
        update = [t[method]["update"] * 1e3 if method in t else None for t in times]
        apply = [t[method]["precondition"] * 1e3 if method in t else None for t in times]
        paper = PAPER_TABLE1[method]
        for quantity, cited, values in (
                ("memory (bytes)", paper[0], memory),
                ("communication per update (bytes)", paper[1], comm),
                (f"update: statistics + inversion (FLOPs counted, {TABLE1_ROWS} rows)",
                 paper[2], flops),
                ("update: statistics + inversion (ms, this CPU)", paper[2], update),
                ("preconditioning L⁻¹∇WR⁻¹ (ms, this CPU)", "(not in the table)", apply)):
            rows.append([NAMES[method], quantity, cited, *values,
                         fitted_exponent(dims, values)])
    return Table(
        id="M1", title="Table 1: per-layer memory, communication and computation against d",
        kind="exact", columns=["method", "quantity", "paper (Table 1)",
                               *[f"ours: d = {d}" for d in dims],
                               "ours: fitted exponent of d"],
        rows=rows,
        notes=(
            f"One d x d linear layer (bias included: the input side has d + 1 rows), measured "
            f"by the training code at {world_size} GPUs (reproductions/mkor/measure.py) with the "
            f"paper-scale options of configs/bert_large_phase2.json: K-FAC (KAISA {strategy}"
            f"{', as the official MKOR BERT runner' if strategy == 'mem-opt' else ''}; "
            "memory on the GPU that decomposes the layer) via core.distributed.simulate; MKOR "
            "(fp16 inverse factors and wire, as the paper) and Eva stepped once with a "
            "simulated communicator; LAMB stepped once. Memory: the state the method keeps for "
            "the layer (LAMB: its two moments). Communication: payload bytes of the method's "
            "own collectives in one update step on the busiest GPU (the gradient all-reduce "
            "every method shares is left out; LAMB has none else, shown as —); K-FAC's is the "
            "factor all-reduce plus, in mem-opt, the broadcast of the preconditioned gradient "
            "(comm-opt broadcasts the eigen-decompositions instead: 5/3 as many bytes with KAISA's "
            "pre-divided eigenvalues, 4/3 without). FLOPs are counted as "
            "reproductions/common/cost.py defines them: K-FAC's two factor GEMMs and its "
            f"{inverse_method} decompositions, MKOR's two mean rows and two Sherman–Morrison "
            "updates, Eva's two mean rows (Eva's d² is its preconditioning). The "
            "exponents are hardware-independent for memory, communication and FLOPs; the times are "
            "this CPU's (single process, best of 3) and only their growth with d is comparable "
            "with the paper's column. The paper's computation column counts the update; "
            "preconditioning, a product of d x d matrices for K-FAC and MKOR, is shown "
            "separately. SNGD (HyLo) is not implemented here. The paper's SGD (Momentum) row "
            "(no second-order work or communication; O(d²) memory, its momentum buffer, which "
            "the second-order methods' base optimizers hold too) is not rebuilt. d = 1024 is "
            "BERT-Large's hidden size."))


def _memory_rows(model_label: str, costs: Mapping[str, Cost], first: str,
                 methods: Sequence[str], paper: Mapping[str, str | None] | None,
                 kfac_mode: str) -> list[list[Any]]:
    """M2's rows of one model: ``first`` (the first-order optimizer), then ``methods`` over it."""
    first_order = costs[first].state_bytes
    base = None if paper is None else paper.get(first)
    rows = []
    for method in (first, *methods):
        second = 0 if method == first else costs[method].state_bytes
        cited = None if paper is None else paper.get(method)
        extra = (None if cited is None or base is None
                 else f"{float(cited) - float(base):.2f}")
        name = f"{NAMES[method]} {kfac_mode}" if method == "kfac" else NAMES[method]
        rows.append([model_label, name, cited, (first_order + second) / GB, second / GB,
                     first_order / GB, extra, second / GB])
    return rows


def memory_table(model_name: str, world_size: int, kfac_ranks: int,
                 cnn_name: str = PAPER_CNN) -> Table:
    """M2: optimizer-state bytes per GPU of a BERT (``bert-large``: the paper's) and of a
    torchvision CNN (``resnet50``: the paper's) at ``world_size`` GPUs.

    The BERT half runs the paper-scale options of bert_large_phase2.json (K-FAC in its
    ``strategy``, mem-opt as the official runner), over LAMB; the CNN half the options of
    :data:`RESNET50_OPTIONS` (K-FAC comm-opt, KAISA's ImageNet defaults), over SGD with
    momentum. The paper's numbers are shown beside the paper's shapes only.
    """
    torch.manual_seed(0)
    model = build_model(model_name, vocab_size=30522, dropout=0.0)
    ids = torch.randint(5, 30000, (1, 16))
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
             "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "next_sentence_label": torch.tensor([0])}
    options = second_order_options()
    costs = measure_costs(model, lambda m: pretraining_loss(m, batch)[0],
                          world_size=world_size, options=options, kfac_ranks=kfac_ranks,
                          methods=("lamb", "kfac", "mkor", "eva"))
    skip = options["kfac"]["skip_layers"]
    head_skipped = tuple(skip) != (BERT_DECODER_PATTERN,)
    if head_skipped:  # K-FAC's state had it skipped only the vocabulary decoder, as MKOR does
        decoder_only = {**options["kfac"], "skip_layers": (BERT_DECODER_PATTERN,)}
        decoder_only_bytes = measure_costs(
            model, lambda m: pretraining_loss(m, batch)[0], world_size=world_size,
            options={"kfac": decoder_only}, kfac_ranks=kfac_ranks,
            methods=("kfac",))["kfac"].state_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    bert_mode = options["kfac"].get("strategy", "comm-opt")
    rows = _memory_rows(model_name, costs, "lamb", ("kfac", "mkor", "eva"),
                        PAPER_MEMORY_GB if model_name == PAPER_BERT else None, bert_mode)
    del model

    cnn, cnn_loss = image_classifier(cnn_name)
    cnn_costs = measure_costs(cnn, cnn_loss, world_size=world_size, options=RESNET50_OPTIONS,
                              kfac_ranks=kfac_ranks, methods=("sgd", "kfac", "mkor"))
    cnn_params = sum(p.numel() * p.element_size() for p in cnn.parameters())
    cnn_mode = RESNET50_OPTIONS["kfac"]["strategy"]
    rows += _memory_rows(cnn_name, cnn_costs, "sgd", ("kfac", "mkor"),
                         PAPER_RESNET_MEMORY_GB if cnn_name == PAPER_CNN else None, cnn_mode)

    shape = MODEL_PRESETS[model_name]
    hidden = shape["hidden_size"]
    skip_note = (
        f"it leaves the whole LM-prediction head first-order (skip_layers {list(skip)}: the "
        f"head's {hidden} x {hidden} transform and the vocabulary decoder), as the official "
        "runner skips BertLMPredictionHead (its embeddings are not preconditioned here either); "
        "skipping only the vocabulary decoder, as MKOR and Eva do, it would hold "
        f"{decoder_only_bytes / GB:.3f} GB "
        f"({(decoder_only_bytes - costs['kfac'].state_bytes) / 1e6:+.1f} MB)"
        if head_skipped else
        "it skips the vocabulary decoder only, as MKOR and Eva do")
    return Table(
        id="M2", title=f"Per-GPU memory, {model_name} and {cnn_name} at {world_size} GPUs "
                       "(GB = 10⁹ bytes)",
        kind="exact",
        columns=["model", "method", "paper: GB per GPU", "ours: optimizer state GB per GPU",
                 "ours: second-order state", "ours: first-order state (LAMB moments / SGD "
                 "momentum)", "derived from paper: extra over LAMB/SGD",
                 "ours: extra over LAMB/SGD"],
        rows=rows,
        notes=(
            "The paper's numbers (thesis Table 3.5) are the measured peak per GPU (A100 for "
            "BERT, V100 for ResNet-50) and include parameters, gradients, activations and "
            "framework buffers; ours count optimizer state only, exactly, as the training code "
            "holds it (reproductions/mkor/measure.py: K-FAC through core.distributed.simulate, "
            f"the largest of {kfac_ranks} simulated ranks; MKOR and Eva stepped once with a "
            "simulated communicator; the first-order optimizer stepped once). Every "
            "second-order method runs over the first-order optimizer, so its state is that "
            "optimizer's plus its own. The comparable figure is the extra over the first-order "
            "optimizer; the paper prints no such column: 'derived from paper' is its method's "
            "number minus its LAMB or SGD number. "
            f"{model_name}: {shape['num_hidden_layers']} layers x {shape['hidden_size']}, "
            f"{params / 4 / 1e6:.1f} M parameters ({params / GB:.2f} GB in fp32, and as much "
            "again for gradients), over LAMB (two moments per parameter), with the options of "
            f"configs/bert_large_phase2.json. K-FAC: KAISA {bert_mode}"
            f"{RUNNER_MODE if bert_mode == 'mem-opt' else ''}: "
            f"{KAISA_MODES.get(bert_mode, bert_mode)}; "
            f"{skip_note}. MKOR: two fp16 inverse factors per layer (as the paper) and its "
            "rank-1 vectors. Eva: two vectors per layer (no paper number). "
            f"{cnn_name} (torchvision, 1,000 classes): {cnn_params / 4 / 1e6:.1f} M parameters "
            f"({cnn_params / GB:.3f} GB in fp32), over SGD (one fp32 momentum buffer per "
            "parameter), with the options of the MKOR repo's ImageNet example "
            "(reproductions/mkor/tables.py RESNET50_OPTIONS: KAISA's ImageNet defaults, MKOR "
            f"every 10 steps). K-FAC: KAISA {cnn_mode}, KAISA's default there "
            f"({KAISA_MODES.get(cnn_mode, cnn_mode)}; Conv2d and Linear layers, BatchNorm "
            "first-order). MKOR: fp16 inverse factors of every Conv2d and Linear layer (as the "
            "paper), and its rank-1 vectors."))


# ----------------------------------------------------------------------------------------------
# M3 and M4: from results files, and the fine-tuning scripts

#: Configuration fields in which the runs of one M3 comparison may differ: which optimizer,
#: the list the command ran, how often it checkpointed, and the config's prose (its
#: description and the launch command it suggests). The starting weights' path is not among
#: them: runs from other weights are not one comparison.
RUN_SPECIFIC = ("optimizer", "optimizers", "checkpoint_every", "description", "launch")


def load_runs(results_dir: Path, experiment: str) -> list[dict[str, Any]]:
    """Validated results of ``experiment`` found under ``results_dir`` (any depth), in the
    paper's optimizer order: finished, one per optimizer, made with one configuration.

    Raises:
        ResultsError: a results file breaks its schema, a run is unfinished or repeated, the
            runs' configurations differ, or there is no LAMB run.
    """
    found: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(Path(results_dir).glob("**/*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if (isinstance(data, dict) and data.get("schema") == RESULTS_SCHEMA
                and data.get("paper") == "mkor" and data.get("experiment") == experiment):
            found.append((path, load_results(path)))
    check_comparable(found, free=RUN_SPECIFIC, compares="M3")
    seen: dict[str, Path] = {}
    for path, run in found:
        if run["optimizer"] in seen:
            raise ResultsError(f"{path}: a second {run['optimizer']} run of experiment "
                               f"{experiment!r} (the first: {seen[run['optimizer']]}); M3 "
                               "compares one run per optimizer: move one away")
        seen[run["optimizer"]] = path
    runs = [run for _, run in found]
    if not any(run["optimizer"] == BASELINE for run in runs):
        found = ", ".join(sorted({r["optimizer"] for r in runs})) or "no runs"
        raise ResultsError(f"{results_dir}: no {BASELINE} run of experiment {experiment!r} "
                           f"({found}); M3 compares every optimizer with it: pass --results "
                           "a directory holding the runs of python -m reproductions.mkor.bert "
                           "and --experiment their experiment")
    order = list(NAMES)
    return sorted(runs, key=lambda r: (order.index(r["optimizer"]) if r["optimizer"] in order
                                       else len(order), r["optimizer"]))


def speedup_table(runs: list[dict[str, Any]], experiment: str, source: str) -> Table:
    """M3: the speed-up columns of Table 2 in their small-scale form."""
    window = runs[0]["config"]["smooth_window"] if runs else 1
    target, rows = compare(runs, window)
    base = next((r for r in rows if r.optimizer == BASELINE), None)
    table_rows = []
    for row in rows:
        paper = PAPER_TABLE2.get(row.optimizer, (None, None, None, None))
        by_steps, by_time = speedups(base, row)
        table_rows.append([NAMES.get(row.optimizer, row.optimizer), paper[0], paper[1],
                           paper[2], row.steps_to_target, by_steps, row.time_to_target_s,
                           by_time, row.steps, row.final_loss, row.final_eval_loss])
    config = runs[0]["config"] if runs else {}
    hardware = runs[0]["hardware"] if runs else {}
    loads = [r["hardware"].get("load_average", [None])[0] for r in runs]
    start = ("the same LAMB warm start" if config.get("warm_start")
             else "the same initial weights")
    return Table(
        id="M3", title="Table 2: iterations, time and speed-up to LAMB's result",
        kind="small",
        columns=["optimizer", "paper: iterations", "paper: time (h)", "paper: speed-up",
                 "ours: steps to LAMB's final loss", "ours: speed-up in steps",
                 "ours: time to it (s)", "ours: speed-up in time", "ours: steps run",
                 "ours: final loss", "ours: held-out loss"],
        rows=table_rows,
        notes=(
            f"Ours: experiment '{experiment}' from {source} — BERT "
            f"{config.get('model', '?')}, {config.get('steps', '?')} steps of "
            f"{config.get('batch_size', '?')} x {config.get('seq_len', '?')} tokens, corpus "
            f"{', '.join(config.get('corpus', ['?']))}, every optimizer from {start} on identical "
            f"batches; {hardware.get('cpu', '?')}, {hardware.get('threads', '?')} threads, "
            f"1-minute load average at the start of each run {loads}. The paper's target is "
            "LAMB's SQuAD F1 after phase 2 on 64 A100s (hours); ours is LAMB's final training "
            "loss (MLM + NSP, trailing mean over "
            f"{window} steps = {'n/a' if target is None else f'{target:.4f}'}), reached when "
            "an optimizer's trailing mean first gets there; time sums the training steps. "
            "The paper's speed-up is a ratio of times on dedicated GPUs; on a shared CPU our "
            "seconds follow the machine's load, so the speed-up in steps is the one to read. "
            "The paper's columns are Table 2 (SQuAD v1.1; PAPERS.md §5.6); LAMB's 1,563 "
            "iterations are the thesis's (the repository's image of the table reads 1,536). "
            "Table 3 (GLUE) prints other iterations and times: KAISA 1,563 / 8.93 h / 0.89×, "
            "MKOR 1,500 / 7.88 h / 1.01× and 600 / 3.10 h / 2.57×, MKOR-H 600 / 3.10 h / "
            "2.57×, Eva 1,000 / 5.24 h / 1.52×."))


def finetune_table() -> Table:
    """M4: SQuAD v1.1 F1, GLUE average and GLUE per task of the paper, with the commands for
    ours."""
    rows: list[list[Any]] = []
    for method, (_, _, _, f1) in PAPER_TABLE2.items():
        rows.append(["SQuAD v1.1 F1", NAMES[method], f1, None])
    for method, average in PAPER_GLUE_AVERAGE.items():
        rows.append(["GLUE average", GLUE_ROWS[method], average, None])
    for index, task in enumerate(GLUE_TASKS):
        for method, scores in PAPER_GLUE_TASKS.items():
            rows.append([f"GLUE {task}", GLUE_ROWS[method], scores[index], None])
    return Table(
        id="M4", title="Tables 2-4: SQuAD v1.1 and GLUE after phase 2", kind="needs data",
        columns=["benchmark", "optimizer", "paper", "ours"], rows=rows,
        notes=(
            "Needs the data and the pre-trained models: fine-tune each optimizer's phase-2 "
            "model (<out>/bert_large_phase2/<optimizer>-s0/model) with "
            "`python -m reproductions.mkor.squad --data-dir DIR --model MODEL` (DIR holds the "
            "official train-v1.1.json and dev-v1.1.json; the paper's recipe: lr 3e-5, 2 "
            "epochs, sequence 384, stride 128) and `python -m reproductions.mkor.glue "
            "--data-dir DIR --task TASK --model MODEL` (DIR holds the official GLUE folders "
            "with train.tsv / dev.tsv). Both are tested here on tiny files in the official "
            "formats only; no GLUE or SQuAD data is available offline, so no scores are "
            "claimed. The paper's numbers (PAPERS.md §5.6): SQuAD F1 from Table 2 (MKOR at "
            "1,000 iterations); the GLUE average from Table 3 and per task from Table 4, which "
            "print two MKOR rows, after 1,500 and after 600 iterations of phase 2, both shown."))


# ----------------------------------------------------------------------------------------------

def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (tables files are committed)."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> list[Table]:
    """Build, print and write the tables; returns them."""
    parser = argparse.ArgumentParser(prog="python -m reproductions.mkor.tables",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR,
                        help="directory searched (recursively) for run results files "
                             "(default: the committed reproductions/mkor/results)")
    parser.add_argument("--experiment", default="default",
                        help="experiment whose runs make M3 (default: default)")
    parser.add_argument("--model", default="bert-large", choices=list(MODEL_PRESETS),
                        help="BERT shape of M2 (default: the paper's bert-large)")
    parser.add_argument("--cnn", default=PAPER_CNN, choices=CNN_CHOICES,
                        help="torchvision CNN of M2's second half (default: the paper's "
                             "resnet50)")
    parser.add_argument("--world-size", type=positive_int, default=64,
                        help="GPUs simulated for M1 and M2 (default: the paper's 64)")
    parser.add_argument("--dims", type=_widths, default=[256, 512, 1024, 2048],
                        help="layer widths d of M1, comma-separated (default: 256,512,1024,2048)")
    parser.add_argument("--kfac-ranks", type=positive_int, default=16,
                        help="K-FAC ranks simulated (evenly spread; the largest is reported)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="tables to build (default: all); the others in --out are kept")
    parser.add_argument("--out", type=Path, default=None,
                        help="tables file to write (default: reproductions/mkor/results/"
                             "tables.json with the paper-scale defaults, runs/mkor/tables.json "
                             "for any other option but --sections)")
    args = parser.parse_args(argv)
    args.out = tables_destination(args, parser, output="out",
                                  committed=RESULTS_DIR / "tables.json", paper="mkor",
                                  selectors=("sections",))
    with exit_on_user_error(parser):
        return _build(args)


def _widths(text: str) -> list[int]:
    """An argparse ``type``: comma-separated layer widths, each an integer >= 2."""
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers") from None
    if any(d < 2 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r}: every width must be >= 2")
    return dims


def _build(args: argparse.Namespace) -> list[Table]:
    """The body of :func:`main`: build the chosen tables, print and write them."""
    dims = args.dims
    study = functools.cache(cnn_study.study_tables)  # M5 and M6 come from one reading
    builders: dict[str, Callable[[], Table]] = {
        "M1": lambda: complexity_table(dims, args.world_size, args.kfac_ranks),
        "M2": lambda: memory_table(args.model, args.world_size, args.kfac_ranks, args.cnn),
        "M3": lambda: speedup_table(load_runs(args.results, args.experiment), args.experiment,
                                    _shown(args.results)),
        "M4": finetune_table,
        "M5": lambda: study()[0],
        "M6": lambda: study()[1],
        "M7": frequency.table_from_results,
        "M8": rank1_error.table_from_results,
    }
    tables = [builders[section]() for section in args.sections]
    for table in tables:
        print(table.markdown(), end="\n\n")
    update_tables(args.out, "mkor", tables)
    print(f"written: {args.out}")
    return tables


if __name__ == "__main__":
    main()
