"""Rebuild Osawa et al.'s tables next to the paper's numbers (TABLES.md, O1–O5).

* **O1** iterations per (batch size, epochs), exact: ``ceil(1,281,167 · epochs / B)`` from the
  shipped ImageNet configs, against the abstract and the authors' repository table.
* **O2** the large-batch study in its small form: a small ResNet on Fashion-MNIST, K-FAC against
  momentum SGD, epochs and iterations to a test-accuracy target and final accuracy per batch size,
  read from results files (``python -m reproductions.osawa2018.study`` writes them).
* **O3** the official hyper-parameters per batch size, printed from the shipped config files.
* **O4** per-worker communication and memory of ResNet-50 at the paper's GPU counts, the paper's
  scheme against the other strategies, from ``core.distributed.simulate`` (the strategies' own
  code against a recording transport).
* **O5** a modelled per-iteration time breakdown at the same GPU counts: O4's simulated ledgers
  at an alpha-beta network, FLOPs of each stage at GEMM and Cholesky rates measured here (or
  read from a rates file measured on a GPU), forward/backward time per image measured here.

    python -m reproductions.osawa2018.tables [--results-dir DIR] [--sections O1 ... O5]
                                             [--gpus 128 256 ...] [--write FILE | -]
                                             [--rates FILE | --device cuda --save-rates FILE]

It prints the tables as Markdown and writes them to ``results/tables.json`` in the
``kfac-repro/tables/v1`` schema, which the docs site renders.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.config import ConfigError, KFACConfig
from core.distributed import Communicator, SimulationReport, make_strategy, simulate
from core.distributed.ledger import Ledger, LedgerEntry
from core.preconditioner import build_layers
from reproductions.common.cli import (
    device_name,
    exit_on_user_error,
    positive_int,
    read_error,
    resolve_device,
)
from reproductions.common.cost import KernelRates
from reproductions.common.kernels import Budget, measure_rates
from reproductions.common.results import ResultsError, load_results
from reproductions.common.shapes import LayerShape, Workload, layer_shapes, torchvision_model
from reproductions.common.tables import Table, tables_destination, update_tables
from reproductions.common.timemodel import AlphaBeta, stage_seconds
from reproductions.osawa2018.config import CONFIG_DIR, load_config

IMAGENET_TRAIN_IMAGES = 1_281_167
OFFICIAL_CONFIGS = ("imagenet_bs4k", "imagenet_bs8k", "imagenet_bs16k", "imagenet_bs32k",
                    "imagenet_bs64k", "imagenet_bs128k")
#: The authors' repository table (ResNet-50-D, not the paper's ResNet-50): batch → (iterations,
#: top-1 %). PAPERS.md §2.4; 5,478 is most likely a typo for the computed 5,474.
AUTHORS_TABLE = {4096: (10_948, 75.9), 8192: (5_478, 76.4), 16384: (2_737, 76.6),
                 32768: (1_760, 76.9), 65536: (1_173, 76.3), 131072: (782, 75.0)}
#: The abstract: 75% top-1 at batch 131,072 "which took only 978 iterations" (100 epochs).
ABSTRACT_ITERATIONS = (131072, 100, 978)
GPU_COUNTS = (128, 256, 512, 1024, 2048, 4096)
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_RESULTS = RESULTS / "fmnist_large_batch"
MB = 1e6
#: K-FAC options of the recipe, shared by every strategy in O4 (upper triangles on the wire).
RECIPE_OPTIONS: dict[str, Any] = {"factor_scaling": "kfc", "inverse_method": "cholesky",
                                  "damping_split": "pi", "symmetry_aware": True}
O4_STRATEGIES: dict[str, dict[str, Any]] = {
    "osawa": {"assignment": "contiguous"},
    "d-kfac": {},
    "comm-opt": {},
    "mem-opt": {},
    "dp-kfac": {},
}
STAGES = ("factor_comm", "inverse_comm", "grad_comm", "grad_allreduce")
#: How O4 and O5 account the osawa strategy's ledger: scheme and row label (see :func:`account`).
OSAWA_ACCOUNTINGS = (("ours", "osawa (this code)"), ("ideal", "osawa, paper's design"),
                     ("as-coded", "osawa, chainerkfac as coded"))
RESNET50 = Workload("resnet50", "ResNet-50", torchvision_model("resnet50"), 32, 224,
                    "torchvision; 32 images per GPU (the official configs, PAPERS.md §2.5)")
ASSUMED_NETWORK = AlphaBeta(
    alpha_s=10e-6, bandwidth=100e9 / 8,
    label="an assumed network: α = 10 µs per message step (a typical NCCL small-message "
          "latency), β = 12.5 GB/s per GPU (one 100 Gb/s InfiniBand line rate); the paper ran "
          "on ABCI (PAPERS.md §2.1), whose per-GPU network figures we did not source")
#: O5's stages and the stages of :func:`reproductions.common.timemodel.stage_seconds` each sums.
O5_STAGES = {"forward+backward": ("FF&BP",), "factor computation": ("factor comp",),
             "communication": ("grad all-reduce", "factor comm", "inverse comm", "P broadcast"),
             "inversion": ("inversion",), "preconditioning": ("precondition",)}


def iterations_table() -> Table:
    """O1: iterations per (batch, epochs) from the shipped configs, against the paper's."""
    rows: list[list[Any]] = []
    configs = [load_config(name) for name in OFFICIAL_CONFIGS]
    batch, epochs, abstract = ABSTRACT_ITERATIONS
    configs.append(load_config("imagenet_bs128k", {"epochs": epochs}))
    for config in configs:
        if (config.batch_size, config.epochs) == (batch, epochs):
            theirs, source = abstract, "abstract"
        else:
            theirs, source = AUTHORS_TABLE[config.batch_size][0], "authors' repository"
        rows.append([config.batch_size, config.epochs, theirs, source,
                     config.total_steps(IMAGENET_TRAIN_IMAGES)])
    return Table(
        "O1", "Iterations per (mini-batch size, epochs), ResNet-50 on ImageNet", "exact",
        ["mini-batch", "epochs", "paper (iterations)", "paper's source", "ours (iterations)"],
        rows,
        "Ours: `ceil(1,281,167 · epochs / B)`, the update count `train.py` runs for the shipped "
        "config (batches straddle epochs, as Chainer's iterator does). The paper's numbers: the "
        "abstract (978 iterations at 131,072, i.e. 100 epochs) and the authors' repository "
        "table for ResNet-50-D (PAPERS.md §2.4), whose 5,478 at 8,192 disagrees with "
        "`ceil(1,281,167 · 35 / 8,192)` = 5,474, most likely a typo.")


def hyperparameter_table() -> Table:
    """O3: the official per-batch-size hyper-parameters, printed from the config files."""
    rows: list[list[Any]] = []
    for name in OFFICIAL_CONFIGS:
        c = load_config(name)
        official = c.source.split()[1].rsplit("/", 1)[1]
        rows.append([c.batch_size, official, f"{CONFIG_DIR.name}/{name}.json", c.epochs, c.lr,
                     c.lr_decay_start_epoch, c.lr_power, c.lr_decay_end_epoch, c.momentum,
                     c.damping, c.mixup_alpha])
    return Table(
        "O3", "Hyper-parameters per mini-batch size", "exact",
        ["mini-batch", "paper (chainerkfac config)", "ours (config file)", "epochs", "lr₀",
         "e_start", "p", "e_end", "momentum", "damping", "mixup α"],
        rows,
        "Values read from our config files, which transcribe the official chainerkfac ImageNet "
        "configs (PAPERS.md §2.5; the paper's own hyper-parameter table could not be read). "
        "All: 32 images per GPU, weight rescaling, momentum adjustment, factors of the current "
        "batch only (`cov_ema_decay` 1 = our `factor_decay` 0), BatchNorm damping ×64 "
        "(`stab_coeff`), running mixup, random erasing 0.5 / [0.02, 0.25] / aspect ≥ 0.3, no "
        "weight decay. Their `epoch` field is our `epochs` + 1.")


def large_batch_table(results_dir: Path) -> Table:
    """O2: epochs and iterations to the target, and final accuracy, per batch and optimizer.

    Raises:
        ResultsError: ``results_dir`` holds no results file (or a damaged one).
    """
    files = sorted(Path(results_dir).glob("*.json"))
    if not files:
        raise ResultsError(f"{results_dir}: no results files; run "
                           "`python -m reproductions.osawa2018.study` first")
    by_batch: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    targets, epochs, widths, evals, unfinished = set(), set(), set(), set(), []
    for path in files:
        data = load_results(path)
        summary = data["summary"]
        by_batch[summary["batch_size"]][data["optimizer"]] = summary
        targets.add(summary["target_accuracy"])
        epochs.add(data["config"]["epochs"])
        widths.add(data["config"]["width"])
        evals.add(data["config"]["eval_every_epochs"])
        if data["finished"] is None:
            unfinished.append(path.name)
    rows: list[list[Any]] = []
    for batch in sorted(by_batch):
        paper = AUTHORS_TABLE.get(batch)
        row: list[Any] = [batch, None if paper is None else paper[1]]
        for optimizer in ("kfac", "sgd"):
            s = by_batch[batch].get(optimizer)
            if s is None:
                row += [None] * 3
                continue
            reached = s["epochs_to_target"] is not None
            row += [round(s["epochs_to_target"], 2) if reached else "not reached",
                    s["steps_to_target"] if reached else "not reached",
                    round(100 * s["final_test_accuracy"], 2)]
        rows.append(row)
    target = ", ".join(f"{100 * t:g}%" for t in sorted(targets))
    budget = ", ".join(f"{e:g}" for e in sorted(epochs))
    width = "/".join(f"{w:g}" for w in sorted(widths))
    try:  # named as the reproduction's folder holds it, else as given
        folder = Path(results_dir).resolve().relative_to(Path(__file__).resolve().parent)
    except ValueError:
        folder = Path(results_dir)
    every = " or ".join(f"{e:g}" for e in sorted(evals))
    unfinished_note = (f" Unfinished runs (numbers so far): {', '.join(unfinished)}."
                       if unfinished else "")
    return Table(
        "O2", f"Large-batch study, small scale: epochs and iterations to {target} test "
        f"accuracy and final accuracy after {budget} epochs", "small",
        ["mini-batch", "paper (authors' repository, ResNet-50-D ImageNet top-1 %)",
         "ours: K-FAC epochs to target", "ours: K-FAC iterations to target",
         "ours: K-FAC final (%)", "ours: SGD epochs to target", "ours: SGD iterations to target",
         "ours: SGD final (%)"],
        rows,
        f"Ours: a width-{width} ResNet on Fashion-MNIST on one CPU thread per run, the paper's "
        f"recipe with K-FAC against the same recipe without preconditioning (momentum SGD), "
        f"from the results files in `{folder.as_posix()}/` (`study.py`); test accuracy "
        f"every {every} epoch. Not the paper's experiment: same protocol, different data, model "
        f"and scale. The paper: 75% top-1 in 35 epochs for B ≤ 16,384, 75% at B = 131,072 in "
        f"978 iterations (abstract); the column holds the authors' repository's ResNet-50-D "
        f"numbers where the batch size matches.{unfinished_note}")


def resnet50_meta() -> nn.Module:
    """torchvision ResNet-50 on the ``meta`` device (shapes only)."""
    return RESNET50.meta_model()


@dataclass
class PerWorker:
    """Per-worker traffic (bytes per stage, per rank) and memory of one simulated scheme.

    Ranks that own no layer behave identically, so one of them stands for all: ``weights``
    holds how many ranks each simulated rank represents.
    """

    traffic: list[dict[str, float]]
    memory: list[dict[str, int]]
    weights: list[int]

    def mean(self, stage: str | None = None) -> float:
        """Mean over all ranks of one stage's traffic (all stages when None)."""
        values = [sum(t.values()) if stage is None else t.get(stage, 0.0) for t in self.traffic]
        return sum(v * w for v, w in zip(values, self.weights, strict=True)) / sum(self.weights)

    def max(self, stage: str | None = None) -> float:
        """Largest traffic of one stage over the ranks (all stages when None)."""
        return max(sum(t.values()) if stage is None else t.get(stage, 0.0)
                   for t in self.traffic)

    def max_memory(self, key: str) -> int:
        """Largest memory figure ``key`` over the ranks."""
        return max(m[key] for m in self.memory)


def representative_ranks(model: nn.Module, strategy: str, world_size: int,
                         options: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The ranks that own work under ``strategy``'s assignment, plus one that owns none.

    Returns:
        The ranks to simulate and how many ranks each stands for.
    """
    config = KFACConfig(strategy=strategy, **options)
    built = make_strategy(config, Communicator.simulated(0, world_size))
    built.setup(build_layers(model, config, lambda: 1.0), method=config.inverse_method,
                dtype=torch.float32)
    owners = sorted({r for p in built.assignment.placements  # type: ignore[attr-defined]
                     for r in (p.a_rank, p.g_rank)})
    idle = next((r for r in range(world_size) if r not in set(owners)), None)
    if idle is None:
        return owners, [1] * len(owners)
    return owners + [idle], [1] * len(owners) + [world_size - len(owners)]


def account(entry: LedgerEntry, scheme: str) -> LedgerEntry:
    """One ledger entry as an accounting ``scheme`` would issue it.

    * ``ours``: as recorded (DDP-style gradient all-reduce, then the strategy).
    * ``ideal``: Osawa et al.'s design, gradients reduce-scattered with the factors: the
      gradient all-reduce becomes its reduce-scatter half.
    * ``as-coded``: chainerkfac, whose "ReduceScatterV" and "AllGatherV" are each one all-reduce
      of the whole packed buffer: such a collective costs ``2(p − 1)/p`` of its buffer.
    """
    p = entry.group_size
    if scheme == "ideal" and entry.stage == "grad_allreduce":
        return replace(entry, op="reduce_scatter", traffic_bytes=entry.traffic_bytes // 2)
    if scheme == "as-coded" and entry.op in ("reduce_scatter", "all_gather"):
        return replace(entry, op="all_reduce", traffic_bytes=2 * (p - 1) * entry.bytes // p)
    return entry


def accounted(report: SimulationReport, scheme: str) -> SimulationReport:
    """``report`` with every rank's ledger rewritten by :func:`account`."""
    ranks = [replace(r, ledger=Ledger(r.rank, r.ledger.step,
                                      [account(e, scheme) for e in r.ledger.entries]))
             for r in report.ranks]
    return replace(report, ranks=ranks)


def per_worker(report: SimulationReport, weights: list[int]) -> PerWorker:
    """Per-rank traffic per stage and memory from the simulated ledgers."""
    stages = []
    for rank in report.ranks:
        totals: dict[str, float] = defaultdict(float)
        for entry in rank.ledger.entries:
            totals[entry.stage] += entry.traffic_bytes
        stages.append(dict(totals))
    memory = [{**r.memory, "captured": r.captured_bytes} for r in report.ranks]
    return PerWorker(stages, memory, weights)


@functools.cache
def simulated(strategy: str, world_size: int) -> tuple[SimulationReport, list[int]]:
    """One second-order update of ``strategy`` at ``world_size`` on ResNet-50 (cached: O4 and O5
    read the same simulation), with the weight of each simulated rank."""
    model = resnet50_meta()
    options = {**RECIPE_OPTIONS, **O4_STRATEGIES[strategy]}
    ranks, weights = representative_ranks(model, strategy, world_size, options)
    return simulate(model, strategy, world_size, ranks=ranks, **options), weights


def schemes(world_size: int) -> Iterator[tuple[str, SimulationReport, list[int]]]:
    """The rows of O4 and O5 at ``world_size``: label, accounted report, rank weights."""
    for strategy in O4_STRATEGIES:
        report, weights = simulated(strategy, world_size)
        for scheme, label in (OSAWA_ACCOUNTINGS if strategy == "osawa"
                              else (("ours", strategy),)):
            yield label, accounted(report, scheme), weights


def communication_table(gpu_counts: tuple[int, ...] = GPU_COUNTS) -> Table:
    """O4: per-worker traffic per second-order update and K-FAC memory, ResNet-50."""
    rows: list[list[Any]] = []
    for world_size in gpu_counts:
        for label, report, weights in schemes(world_size):
            stats = per_worker(report, weights)
            rows.append([world_size, label, None]
                        + [round(stats.mean(s) / MB, 1) for s in STAGES]
                        + [round(stats.mean() / MB, 1), round(stats.max() / MB, 1),
                           round(stats.max_memory("total") / MB, 1),
                           round(stats.max_memory("captured") / MB, 1)])
    return Table(
        "O4", "Per-worker communication per second-order update and K-FAC memory, ResNet-50",
        "exact",
        ["GPUs", "scheme", "paper (MB)", "ours: factor comm (MB)", "ours: inverse comm (MB)",
         "ours: preconditioned-gradient comm (MB)", "ours: gradient all-reduce (MB)",
         "ours: total, mean (MB)", "ours: total, max (MB)", "ours: K-FAC state, max (MB)",
         "ours: batch factors (MB)"],
        rows,
        "MB = 10⁶ bytes, per worker per second-order update. "
        "From `core.distributed.simulate`: the strategies' own code against a recording "
        "transport (torchvision ResNet-50 on the meta device; fp32 on the wire; upper "
        "triangles of the factors; Cholesky inverses; π damping; every strategy updates "
        "factors and inverses in the step). Traffic is what a worker receives under the "
        "bandwidth-optimal algorithm of each collective, averaged over workers; 'max' is the "
        "busiest worker. Workers that own no layer are identical, so one is simulated for all "
        "of them. 'osawa (this code)' is what `train.py` does: a DDP gradient all-reduce, "
        "factors reduce-scattered to their owners, preconditioned gradients all-gathered. "
        "'paper's design' reduce-scatters the gradients with the factors (the all-reduce's "
        "reduce-scatter half only). 'chainerkfac as coded' runs both V-collectives as "
        "all-reduces of the whole packed buffer (PAPERS.md §2.3). 'K-FAC state' = running "
        "factors, inverses and communication buffers; 'batch factors' = the current batch's "
        "factors every worker builds before they are reduced. BatchNorm's Fisher blocks "
        "(26,560 channels) are not included. The paper gives no numbers for this table.")


def layers_owned(report: SimulationReport) -> int:
    """Most layers any worker inverts a factor of (every layer under D-KFAC)."""
    return max(len({name for name, _ in r.inverted}) for r in report.ranks)


def iteration_seconds(report: SimulationReport, shapes: Sequence[LayerShape],
                      rates: KernelRates, network: AlphaBeta, batch: int) -> dict[str, float]:
    """Modelled seconds of each of :data:`O5_STAGES` in one iteration with a full update.

    Forward + backward is ``batch`` times the per-image time of ``rates``; the K-FAC kernels
    are their FLOPs at ``rates`` on the slowest worker; every collective of the (accounted)
    ledger costs its alpha-beta time; each stage takes its slowest worker and stages add
    (:func:`reproductions.common.timemodel.stage_seconds`).

    Args:
        report: A simulation of one full update, its ledger accounted (:func:`accounted`).
        shapes: The model's layer shapes at ``batch``.
        rates: Kernel throughputs and forward/backward seconds per image.
        network: The alpha-beta network.
        batch: Images per GPU.
    """
    seconds = stage_seconds(report, shapes, rates, network,
                            rates.forward_backward_s_per_image * batch)
    return {stage: sum(seconds[part] for part in parts) for stage, parts in O5_STAGES.items()}


def breakdown_table(rates: KernelRates, origin: str, gpu_counts: tuple[int, ...] = GPU_COUNTS,
                    network: AlphaBeta = ASSUMED_NETWORK) -> Table:
    """O5: modelled per-iteration time per stage against the GPU count, ResNet-50.

    Args:
        rates: Kernel throughputs and forward/backward seconds per image of ResNet-50.
        origin: Where ``rates`` come from, for the notes ("measured on this machine").
        gpu_counts: The GPU counts.
        network: The alpha-beta network.
    """
    shapes = layer_shapes(resnet50_meta(), RESNET50.batch, RESNET50.image_size)
    latency_only = AlphaBeta(network.alpha_s, math.inf, "latency only")
    rows: list[list[Any]] = []
    for world_size in gpu_counts:
        for label, report, weights in schemes(world_size):
            stages = iteration_seconds(report, shapes, rates, network, RESNET50.batch)
            latency = iteration_seconds(report, shapes, rates, latency_only,
                                        RESNET50.batch)["communication"]
            total = sum(stages.values())
            rows.append([world_size, label, None, layers_owned(report), *stages.values(), total,
                         100 * stages["communication"] / total, latency,
                         round(per_worker(report, weights).max() / MB, 1)])
    return Table(
        "O5", "Modelled per-iteration time per stage against the GPU count, ResNet-50 at 32 "
        "images per GPU", "modelled",
        ["GPUs", "scheme", "paper (s)", "ours: layers owned per worker, max",
         *(f"ours: {stage} (s)" for stage in O5_STAGES), "ours: total (s)",
         "ours: communication share (%)", "ours: communication, latency α part (s)",
         "ours: traffic per worker, max (MB)"],
        rows,
        "Modelled, not measured: no iteration was timed at these GPU counts. The paper's "
        "per-iteration time breakdown against the GPU count could not be read (PAPERS.md §2.4 "
        "marks its figures [NF]), so there is no paper number to compare and 'paper (s)' is "
        "empty. Each row is one second-order update (factors, Cholesky inverses and "
        "preconditioning every iteration, as the official configs do) of O4's simulation: "
        "the same ledgers and the same three accountings of the osawa strategy, so 'traffic "
        "per worker, max' equals O4's 'total, max'. Communication: every collective of the "
        f"ledger at {network.label}; ring all-reduce 2(p−1)α + 2(p−1)/p·n/β, ring "
        "reduce-scatter and all-gather (p−1)α + (p−1)/p·n/β, tree broadcast ⌈log₂p⌉α + n/β "
        "(`reproductions/common/timemodel.py`). Ring latency grows linearly with p (NCCL "
        "switches to trees at this scale), so the 'latency α part' column shows how much of "
        "the communication that assumption carries. Compute: factor construction 2·rows·n² "
        "and preconditioning 2·(g²a + ga²) FLOPs at the GEMM rate, Cholesky plus inverse n³ "
        "FLOPs per factor at the Cholesky rate (`reproductions/common/cost.py`), on the "
        "slowest worker; every worker builds every layer's batch factors except under "
        "dp-kfac. Rates and forward/backward time per image "
        f"({rates.forward_backward_s_per_image:.3g} s, the named input "
        f"`forward_backward_s_per_image`) are {origin}: GEMM "
        f"{rates.gemm_flops / 1e9:.1f} GFLOP/s, Cholesky {rates.decomposition_flops / 1e9:.1f} "
        f"GFLOP/s. {rates.source} Measured on a CPU they are one to two orders of magnitude "
        "slower than the paper's V100 GPUs, so compute dominates and the communication share "
        "is far below what GPUs would show; `--rates FILE` takes rates measured on a GPU "
        "(`--device cuda --save-rates FILE` writes them there). Each stage takes its slowest "
        "worker and stages add. Left out: overlap of communication with computation "
        "(chainerkfac can reduce A factors during the backward pass), stragglers and "
        "contention, network topology and intra-node links, fp16 compute and communication "
        "(the paper reportedly used half precision; all fp32 here), BatchNorm Fisher blocks, "
        "the optimizer update, im2col and data loading; one rate per kernel kind makes small "
        "kernels optimistic.")


SECTIONS = ("O1", "O2", "O3", "O4", "O5")


def read_rates(path: Path) -> KernelRates:
    """The kernel-rates file ``--rates`` names.

    Raises:
        ConfigError: missing, unreadable, not JSON or not a kernel-rates file (named as
            ``--rates``, with why).
    """
    try:
        return KernelRates.load(path)
    except (OSError, ValueError) as exc:  # JSON and field errors are ValueErrors
        raise ConfigError("--rates", str(path), f"a kernel-rates file ({read_error(exc)})"
                          ) from None


def o5_rates(args: argparse.Namespace) -> tuple[KernelRates, str]:
    """O5's rates and where they come from: read from ``--rates``, or measured on ``--device``
    (one thread on a CPU: one worker's view); written to ``--save-rates`` when given.

    Raises:
        ConfigError: the rates file cannot be read, is not one, or is for another model or
            decomposition (named as ``--rates``).
    """
    method = RECIPE_OPTIONS["inverse_method"]
    workload = f"{RESNET50.key}@{RESNET50.image_size}"
    if args.rates is not None:
        rates, origin = read_rates(args.rates), f"read from `{args.rates.name}`"
        if (rates.workload, rates.method) != (workload, method):
            raise ConfigError("--rates", str(args.rates),
                              f"rates for {workload} / {method}, which O5 needs (the file "
                              f"holds {rates.workload} / {rates.method})")
    else:
        torch.set_num_threads(1)
        rates = measure_rates(RESNET50, method, Budget(), resolve_device(args.device))
        origin = "measured on this machine"
    if args.save_rates is not None:
        rates.save(args.save_rates)
    return rates, origin


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS,
                        help="directory of the study's results files (O2)")
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--gpus", nargs="*", type=positive_int, default=list(GPU_COUNTS),
                        help="GPU counts of O4 (each simulated; 4,096 takes about a minute)")
    parser.add_argument("--write", type=Path, default=None,
                        help="tables file to write (kfac-repro/tables/v1; the sections built "
                             "replace theirs, the others are kept; default: the committed "
                             "results/tables.json with the paper-scale defaults, "
                             "runs/osawa2018/tables.json for any other option but --sections "
                             "and --save-rates); '-' writes none")
    parser.add_argument("--rates", type=Path, default=None,
                        help="O5: kernel rates and forward/backward time per image from a file "
                             "(e.g. measured on a GPU); default: measure here (about 5 s)")
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="O5: where rates are measured (cpu, auto, cuda or cuda:N)")
    parser.add_argument("--save-rates", type=Path, default=None,
                        help="O5: write the rates used to this file (kfac-repro/kernel-rates/v1)")
    args = parser.parse_args(argv)
    args.write = tables_destination(args, parser, output="write",
                                    committed=RESULTS / "tables.json", paper="osawa2018",
                                    selectors=("sections", "save_rates"))
    with exit_on_user_error(parser):
        _build(args)


def _build(args: argparse.Namespace) -> None:
    """The body of :func:`main`: build the chosen sections, print them, update the file."""
    builders = {"O1": iterations_table, "O2": lambda: large_batch_table(args.results_dir),
                "O3": hyperparameter_table,
                "O4": lambda: communication_table(tuple(args.gpus)),
                "O5": lambda: breakdown_table(*o5_rates(args), tuple(args.gpus))}
    built = [builders[s]() for s in args.sections]
    print("\n\n".join(table.markdown() for table in built))
    if str(args.write) != "-":
        update_tables(args.write, "osawa2018", built)


if __name__ == "__main__":
    main()
