"""A modelled iteration time at ``P`` workers: measured compute plus alpha-beta communication.

Every collective in a simulated rank's ledger costs ``c_α·α + c_β·n/β`` (``n`` payload bytes,
``p`` ranks in the group, ``α`` seconds per message step, ``β`` bytes per second per link):

==================  ==================  =====================  ===============================
op                  ``c_α``             ``c_β``                algorithm assumed
==================  ==================  =====================  ===============================
``all_reduce``      ``2(p − 1)``        ``2(p − 1)/p``         ring (reduce-scatter+all-gather)
``broadcast``       ``⌈log₂ p⌉``        ``1``                  pipelined tree
``all_gather``      ``p − 1``           ``(p − 1)/p``          ring
``reduce_scatter``  ``p − 1``           ``(p − 1)/p``          ring
==================  ==================  =====================  ===============================

The bandwidth terms are the ledger's per-worker traffic (``core.distributed.ledger``). A stage
takes as long as its slowest worker (each stage ends in collectives that wait for everyone), and
stages add up (no overlap of computation and communication): a bulk-synchronous model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from core.distributed import LedgerEntry, SimulationReport
from reproductions.common.cost import KernelCost, worker_compute
from reproductions.common.shapes import LayerShape


def coefficients(op: str, nbytes: float, p: int) -> tuple[float, float]:
    """``(c_α, c_β·n)`` of one collective of ``nbytes`` over ``p`` ranks (module table)."""
    if p <= 1:
        return 0.0, 0.0
    if op == "all_reduce":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes
    if op == "broadcast":
        return float(math.ceil(math.log2(p))), float(nbytes)
    if op in ("all_gather", "reduce_scatter"):
        return float(p - 1), (p - 1) / p * nbytes
    raise ValueError(f"no cost model for collective {op!r}")


@dataclass(frozen=True)
class AlphaBeta:
    """An alpha-beta network.

    Attributes:
        alpha_s: Latency per message step, seconds.
        bandwidth: Bytes per second per link.
        label: Where the parameters come from.
    """

    alpha_s: float
    bandwidth: float
    label: str

    def collective(self, op: str, nbytes: float, p: int) -> float:
        """Seconds of one collective."""
        c_alpha, c_beta = coefficients(op, nbytes, p)
        return c_alpha * self.alpha_s + c_beta / self.bandwidth

    def entries(self, entries: Iterable[LedgerEntry]) -> float:
        """Seconds of a rank's ledger entries, one after the other."""
        return sum(self.collective(e.op, e.bytes, e.group_size) for e in entries)


def fit_alpha_beta(samples: Sequence[tuple[str, float, int, float]], label: str) -> AlphaBeta:
    """``α`` and ``β`` that minimise the squared relative error on measured collectives.

    Args:
        samples: ``(op, payload bytes, ranks, seconds)`` per measurement.
        label: Describes where the samples come from.

    Returns:
        The fitted network. A coefficient that fits negative (noise on a loaded machine) is
        clamped at 0 and the other refitted alone: ``α = 0``, or an infinite bandwidth when
        the payload size explains none of the measured time.
    """
    seconds = torch.tensor([s for *_, s in samples], dtype=torch.float64)
    rows = torch.tensor([coefficients(op, n, p) for op, n, p, _ in samples],
                        dtype=torch.float64) / seconds.unsqueeze(1)
    ones = torch.ones_like(seconds)
    alpha, inverse_bandwidth = torch.linalg.lstsq(rows, ones.unsqueeze(1)).solution.flatten()
    if alpha < 0:
        alpha = torch.zeros((), dtype=torch.float64)
        inverse_bandwidth = (rows[:, 1] @ ones) / (rows[:, 1] @ rows[:, 1])
    elif inverse_bandwidth <= 0:
        inverse_bandwidth = torch.zeros((), dtype=torch.float64)
        alpha = (rows[:, 0] @ ones) / (rows[:, 0] @ rows[:, 0])
    bandwidth = math.inf if float(inverse_bandwidth) == 0.0 else 1.0 / float(inverse_bandwidth)
    return AlphaBeta(float(alpha), bandwidth, label)


STAGES = ("FF&BP", "grad all-reduce", "factor comp", "factor comm", "inversion",
          "inverse comm", "precondition", "P broadcast")
"""The modelled stages, in order."""

LEDGER_STAGES = {"grad all-reduce": "grad_allreduce", "factor comm": "factor_comm",
                 "inverse comm": "inverse_comm", "P broadcast": "grad_comm"}
"""Communication stages and the ledger stage each reads."""


def stage_seconds(report: SimulationReport, shapes: Sequence[LayerShape], kernels: KernelCost,
                  network: AlphaBeta, forward_backward_s: float) -> dict[str, float]:
    """The modelled seconds of each of :data:`STAGES` for one iteration with a full
    second-order update.

    Args:
        report: A simulation of one update with the gradient all-reduce (``steps=1``,
            ``average_grads=True``).
        shapes: The model's layer shapes at the per-GPU batch.
        kernels: Seconds per kernel (measured).
        network: The communication model.
        forward_backward_s: Measured forward + backward seconds at the per-GPU batch.
    """
    workers = worker_compute(report, shapes, kernels)
    out = {"FF&BP": forward_backward_s,
           "factor comp": max(w.factors for w in workers),
           "inversion": max(w.inversion for w in workers),
           "precondition": max(w.precondition for w in workers)}
    for stage, ledger_stage in LEDGER_STAGES.items():
        out[stage] = max(network.entries(r.ledger.select(stage=ledger_stage))
                         for r in report.ranks)
    return {stage: out[stage] for stage in STAGES}
