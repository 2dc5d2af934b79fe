"""Checking the alpha-beta communication term against real gloo runs on this machine.

In ``P`` local gloo processes (:func:`reproductions.common.launch.run_local`):

1. all-reduces and broadcasts of growing sizes, issued through ``core``'s communicator like
   K-FAC's, are timed (median of a few, each after a barrier), and ``α``, ``β`` of this
   machine's loopback "network" at that ``P`` are fitted to them with the model's own
   formulas (least relative squares);
2. real K-FAC steps of a small MLP run under several schemes. The strategy's three
   communication calls (and the gradient all-reduce) are each preceded by a barrier and timed,
   so a stage's time is its communication (packing and unpacking included), not waiting for
   slower ranks' computation. Each rank's median over the steps after the first, and then the
   slowest rank (the statistic of step 1), is compared with the fitted model applied to the
   real ledger.

With more processes than cores (4 on a 2-core machine) the processes also compete for the CPU,
so the fitted ``α``, ``β`` describe this machine at that ``P``, not a network.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core import KFACPreconditioner
from core.distributed import Communicator, LedgerEntry, average_gradients
from core.kfac_layer import KFACLayer
from core.preconditioner import discover_layers
from core.strategy import FactorReduction, Strategy, nothing_to_wait
from reproductions.common.launch import run_local
from reproductions.common.timemodel import LEDGER_STAGES, AlphaBeta, fit_alpha_beta
from reproductions.dpkfac.workloads import Scheme

BENCH_BYTES = tuple(4**k for k in range(6, 13))
"""Payload sizes of the timed all-reduces and broadcasts: 4 KiB to 16 MiB, steps of ×4."""

BATCH = 32
"""Examples per rank in the K-FAC steps."""

PARTS = 4
"""Tensors per timed collective (packed into one buffer, like K-FAC's bucketed factors)."""

Sample = tuple[str, int, int, float]


def validation_model() -> nn.Module:
    """The MLP of the K-FAC runs (factor dimensions 785/512, 513/512, 513/10)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10))


def _benchmark(sizes: Sequence[int], reps: int) -> list[Sample]:
    """This rank's median time of each collective and size, each after a barrier.

    Collectives go through ``core``'s :class:`~core.distributed.Communicator`, as K-FAC's do:
    the payload is :data:`PARTS` tensors packed into one buffer and unpacked again (an averaging
    all-reduce, a broadcast from rank 0).
    """
    communicator = Communicator.from_torch()
    p = communicator.world_size
    out = []
    for op in ("all_reduce", "broadcast"):
        for nbytes in sizes:
            parts = [torch.ones(nbytes // (4 * PARTS)) for _ in range(PARTS)]
            times = []
            for _ in range(reps + 1):  # the first is a warm-up
                dist.barrier()
                start = time.perf_counter()
                if op == "all_reduce":
                    communicator.all_reduce_many(parts, stage="bench", average=True)
                else:
                    communicator.start_broadcast(parts, src=0, stage="bench").wait()
                times.append(time.perf_counter() - start)
            out.append((op, nbytes, p, median(times[1:])))
    return out


def _time_communication(strategy: Strategy, times: dict[str, float]) -> None:
    """Make ``strategy``'s communication calls wait at a barrier, then time themselves into
    ``times`` (by ledger stage; the caller empties it between steps). The factor reduction
    runs whole when it is finished, not streamed while factors are built, so its time is the
    collectives' alone."""
    original_reduction = strategy.factor_reduction

    def timed_reduce(layers: list[KFACLayer]) -> Callable[[], None]:
        dist.barrier()
        start = time.perf_counter()
        reduction = original_reduction()
        for layer in layers:
            reduction.add(layer)
        reduction.finish()()
        times["factor_comm"] = time.perf_counter() - start
        return nothing_to_wait

    strategy.factor_reduction = lambda: FactorReduction(timed_reduce)  # type: ignore[method-assign]
    for method, stage in (("communicate_inverses", "inverse_comm"),
                          ("communicate_gradients", "grad_comm")):
        original = getattr(strategy, method)

        def timed(*args: Any, _original: Callable[..., None] = original,
                  _stage: str = stage) -> None:
            dist.barrier()
            start = time.perf_counter()
            _original(*args)
            times[_stage] = time.perf_counter() - start

        setattr(strategy, method, timed)


def _kfac_steps(scheme: Scheme, steps: int) -> dict[str, Any]:
    """Run ``steps`` K-FAC steps; per step, this rank's seconds per communication stage, and
    its ledger."""
    rank = dist.get_rank()
    model = validation_model()
    options = scheme.options_for(len(discover_layers(model, ())), dist.get_world_size())
    precond = KFACPreconditioner(model, strategy=scheme.strategy, **options,
                                 factor_scaling="dpkfac", damping=0.03, kl_clip=1e-3, lr=0.1)
    communicator = precond.strategy.communicator
    generator = torch.Generator().manual_seed(rank)
    stage_times = []
    times: dict[str, float] = {}
    _time_communication(precond.strategy, times)
    for _ in range(steps):
        times.clear()
        x = torch.randn(BATCH, 1, 28, 28, generator=generator)
        y = torch.randint(0, 10, (BATCH,), generator=generator)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        dist.barrier()
        start = time.perf_counter()
        average_gradients(model.parameters(), communicator)
        times["grad_allreduce"] = time.perf_counter() - start
        precond.step()
        stage_times.append(dict(times))
    return {"times": stage_times, "ledger": communicator.ledger.entries}


def gloo_worker(sizes: Sequence[int], reps: int, schemes: Sequence[Scheme], steps: int
                ) -> dict[str, Any]:
    """What one rank measures (runs inside :func:`run_local`)."""
    return {"bench": _benchmark(sizes, reps),
            "kfac": {s.label: _kfac_steps(s, steps) for s in schemes}}


@dataclass(frozen=True)
class StageCheck:
    """Model against measurement for one scheme and stage.

    Attributes:
        world_size: Processes.
        scheme: Scheme label.
        stage: Ledger stage.
        traffic_bytes: Per-worker traffic of one step (largest rank).
        predicted_s: The fitted model on the ledger (slowest rank).
        measured_s: The slowest rank's median stage time over the steps after the first.
    """

    world_size: int
    scheme: str
    stage: str
    traffic_bytes: int
    predicted_s: float
    measured_s: float


@dataclass(frozen=True)
class Validation:
    """The fitted network of each world size, its samples, the stage checks, and the load
    average when the runs ended."""

    networks: dict[int, AlphaBeta]
    samples: dict[int, list[Sample]]
    checks: list[StageCheck]
    load_average: tuple[float, float, float]

    def fit_error(self, world_size: int) -> float:
        """Median relative error of the fitted model on the collectives timed at
        ``world_size``."""
        network = self.networks[world_size]
        return median(abs(network.collective(op, n, p) - s) / s
                      for op, n, p, s in self.samples[world_size])


def _entries(ledger: Sequence[LedgerEntry], step: int, stage: str) -> list[LedgerEntry]:
    return [e for e in ledger if e.step == step and e.stage == stage]


def validate(world_sizes: Sequence[int], schemes: Sequence[Scheme], *, steps: int = 5,
             sizes: Sequence[int] = BENCH_BYTES, reps: int = 3,
             timeout: float = 600.0) -> Validation:
    """Fit ``α``, ``β`` on gloo and compare the model with real K-FAC steps.

    Args:
        world_sizes: Numbers of local processes to run (e.g. 2 and 4).
        schemes: Schemes whose steps are run.
        steps: K-FAC steps per scheme (the first is a warm-up and is not compared).
        sizes: Payload bytes of the timed collectives.
        reps: Timed repetitions per collective and size.
        timeout: Seconds per world size before the processes are killed.
    """
    networks: dict[int, AlphaBeta] = {}
    samples: dict[int, list[Sample]] = {}
    checks = []
    for p in world_sizes:
        results = run_local(gloo_worker, p, list(sizes), reps, list(schemes), steps,
                            timeout=timeout)
        samples[p] = [(op, nbytes, p, max(r["bench"][i][3] for r in results))
                      for i, (op, nbytes, _, _) in enumerate(results[0]["bench"])]
        network = networks[p] = fit_alpha_beta(samples[p], f"gloo on this machine at P = {p}")
        for scheme in schemes:
            per_rank = [r["kfac"][scheme.label] for r in results]
            for stage in LEDGER_STAGES.values():
                last = [_entries(r["ledger"], steps - 1, stage) for r in per_rank]
                if not any(last):
                    continue
                measured = max(median(r["times"][s][stage] for s in range(1, steps))
                               for r in per_rank)
                checks.append(StageCheck(
                    p, scheme.label, stage,
                    max(sum(e.traffic_bytes for e in entries) for entries in last),
                    max(network.entries(entries) for entries in last), measured))
    return Validation(networks, samples, checks, os.getloadavg())
