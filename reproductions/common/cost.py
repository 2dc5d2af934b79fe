"""Per-worker computation of a scheme: the FLOP conventions (all in this one place) and the
accounting of which worker builds, inverts and preconditions what.

Conventions (FLOPs = floating-point operations; a multiply-add is :data:`FLOPS_PER_MAC` = 2):

* **Factor construction**, per layer and factor of dimension ``n`` (``a`` for ``A``, ``g`` for
  ``G``): the Gram product ``XᵀX`` of the ``rows × n`` row matrix, counted as a full GEMM,
  ``rows·n²`` multiply-adds = ``2·rows·n²`` FLOPs. So a layer costs ``2·rows·(a² + g²)``.
  Building the rows (im2col, scaling, symmetrising) is not counted.
* **Inversion**, per factor of dimension ``n``: ``c·n³`` with ``c`` from
  :data:`DECOMPOSITION_FLOPS_PER_N3`: ``eigen`` 9 (symmetric QR algorithm with eigenvectors,
  Golub & Van Loan, *Matrix Computations*, 4th ed., §8.3: ≈ 9n³), ``cholesky`` 1 (Cholesky
  n³/3 plus the inverse from the factor 2n³/3, i.e. ``cholesky`` + ``cholesky_inverse``),
  ``inverse`` 2 (LU 2n³/3 plus the inverse from LU 4n³/3, ``torch.linalg.inv``),
  ``cholesky_solve`` 1/3 (the Cholesky factorisation alone).
* **Preconditioning** a ``g × a`` gradient: ``eigen`` four GEMMs
  (``Q_Gᵀ·∇W̄·Q_A`` and back), ``inverse``/``cholesky`` two (``G⁻¹·∇W̄·A⁻¹``), each pair
  ``2·(g·g·a + g·a·a)`` FLOPs; ``cholesky_solve`` four triangular solves (two per factor),
  the FLOPs of one pair, timed as that pair (the solves run at about the GEMM rate).
* **Rank-1 statistics** (MKOR, Eva): a mean row of ``rows × n`` values, ``rows·n`` additions
  (:func:`mean_row_flops`); MKOR's Sherman–Morrison update of an ``n × n`` inverse factor, a
  matrix-vector product and a rank-1 update, ``n²`` multiply-adds each
  (:func:`sherman_morrison_flops`); the scalar and vector terms are not counted.

Which worker does what comes from the simulated strategy itself
(:class:`core.distributed.simulate.RankReport`: the layers a rank captures, the factors it
inverts, the layers it preconditions), so the "busiest worker" follows the scheme's assignment:
DP-KFAC builds factors only for the layers a rank owns, the other schemes for every layer.

Kernel costs come as FLOPs (:class:`FlopCost`), as seconds measured per shape
(:class:`~reproductions.common.kernels.KernelTimes`), or as FLOPs at one measured throughput per
kernel kind (:class:`KernelRates`, which a JSON file can carry from the machine that measured it,
e.g. a GPU, to the one that builds the tables).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from core.config import ConfigError, check_number
from core.distributed import SimulationReport
from data.atomic import atomic_path
from reproductions.common.shapes import LayerShape

FLOPS_PER_MAC = 2
DECOMPOSITION_FLOPS_PER_N3 = {"eigen": 9.0, "cholesky": 1.0, "inverse": 2.0,
                              "cholesky_solve": 1.0 / 3.0}
PRECONDITION_GEMM_PAIRS = {"eigen": 2, "cholesky": 1, "inverse": 1, "cholesky_solve": 1}


class KernelCost(Protocol):
    """The cost of each kernel, in FLOPs (:class:`FlopCost`) or seconds (measured)."""

    def factor(self, rows: int, n: int) -> float:
        """Building one ``n × n`` factor from ``rows`` rows."""

    def decomposition(self, n: int) -> float:
        """Decomposing or inverting one ``n × n`` factor."""

    def precondition(self, g: int, a: int) -> float:
        """Preconditioning one ``g × a`` gradient."""


@dataclass(frozen=True)
class FlopCost:
    """FLOPs of each kernel under the module's conventions.

    Attributes:
        method: ``"eigen"``, ``"cholesky"``, ``"inverse"`` or ``"cholesky_solve"``.
    """

    method: str = "eigen"

    def factor(self, rows: int, n: int) -> float:
        return float(FLOPS_PER_MAC * rows * n * n)

    def decomposition(self, n: int) -> float:
        return DECOMPOSITION_FLOPS_PER_N3[self.method] * float(n) ** 3

    def precondition(self, g: int, a: int) -> float:
        return float(PRECONDITION_GEMM_PAIRS[self.method] * FLOPS_PER_MAC * (g * g * a + g * a * a))


def mean_row_flops(rows: int, n: int) -> float:
    """A mean over ``rows`` rows of ``n`` values (a rank-1 statistic)."""
    return float(rows * n)


def sherman_morrison_flops(n: int) -> float:
    """MKOR's rank-1 update of one ``n × n`` inverse factor."""
    return float(2 * FLOPS_PER_MAC * n * n)


RATES_SCHEMA = "kfac-repro/kernel-rates/v1"
"""The ``schema`` field of a :class:`KernelRates` file."""


@dataclass(frozen=True)
class KernelRates:
    """Seconds of each kernel as its :class:`FlopCost` FLOPs at one throughput per kernel kind,
    plus the forward/backward time per image: the compute inputs of a modelled iteration.

    One rate per kind ignores that small kernels run below it, so the times are optimistic for
    the small factors of a model.

    Attributes:
        method: Decomposition the ``decomposition_flops`` rate is for.
        gemm_flops: FLOP/s of the GEMMs (factor construction and preconditioning).
        decomposition_flops: FLOP/s of the decomposition, counted as
            :data:`DECOMPOSITION_FLOPS_PER_N3` ``[method]·n³``.
        forward_backward_s_per_image: Forward plus backward seconds per image of ``workload``.
        workload: The model and input the forward/backward time is for (``"resnet50@224"``).
        source: Where and how the numbers were measured.
    """

    method: str
    gemm_flops: float
    decomposition_flops: float
    forward_backward_s_per_image: float
    workload: str
    source: str

    def factor(self, rows: int, n: int) -> float:
        return FlopCost(self.method).factor(rows, n) / self.gemm_flops

    def decomposition(self, n: int) -> float:
        return FlopCost(self.method).decomposition(n) / self.decomposition_flops

    def precondition(self, g: int, a: int) -> float:
        return FlopCost(self.method).precondition(g, a) / self.gemm_flops

    def save(self, path: Path) -> Path:
        """Write the rates as JSON (schema :data:`RATES_SCHEMA`), atomically (a run stopped
        while writing leaves the previous file); returns ``path``."""
        with atomic_path(Path(path)) as partial:
            partial.write_text(json.dumps({"schema": RATES_SCHEMA, **asdict(self)}, indent=1,
                                          ensure_ascii=False) + "\n", encoding="utf-8")
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> KernelRates:
        """Rates from a file :meth:`save` wrote.

        Raises:
            ValueError: the file is not in :data:`RATES_SCHEMA` or a field is missing or not
                positive; the message names the file and the field.
        """
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.pop("schema", None) != RATES_SCHEMA:
            raise ValueError(f"{path}: field 'schema' must be {RATES_SCHEMA!r}")
        try:
            rates = cls(**data)
        except TypeError as err:
            raise ValueError(f"{path}: {err}") from None
        for name in ("gemm_flops", "decomposition_flops", "forward_backward_s_per_image"):
            try:
                check_number(name, getattr(rates, name), low=0.0, low_inclusive=False)
            except ConfigError:
                raise ValueError(f"{path}: field {name!r} must be a positive number") from None
        if rates.method not in DECOMPOSITION_FLOPS_PER_N3:
            raise ValueError(f"{path}: field 'method' must be one of "
                             f"{', '.join(DECOMPOSITION_FLOPS_PER_N3)}")
        return rates


@dataclass(frozen=True)
class WorkerCompute:
    """One worker's computation per second-order update, in the unit of the cost used.

    Attributes:
        rank: The worker.
        factors: Factor construction.
        inversion: Decompositions / inversions.
        precondition: Preconditioning products.
    """

    rank: int
    factors: float
    inversion: float
    precondition: float

    @property
    def total(self) -> float:
        """Factor construction plus inversion: the paper's "computation" of an update."""
        return self.factors + self.inversion


def worker_compute(report: SimulationReport, shapes: Sequence[LayerShape],
                   cost: KernelCost) -> list[WorkerCompute]:
    """Each simulated worker's computation of one second-order update.

    Args:
        report: A simulation of one full update (``steps=1``).
        shapes: The model's layer shapes at the per-GPU batch.
        cost: FLOPs or measured seconds per kernel.
    """
    by_name: Mapping[str, LayerShape] = {s.name: s for s in shapes}
    out = []
    for rank in report.ranks:
        factors = sum(cost.factor(by_name[n].rows, by_name[n].a_dim)
                      + cost.factor(by_name[n].rows, by_name[n].g_dim) for n in rank.captured)
        inversion = sum(cost.decomposition(by_name[n].a_dim if side == "a" else by_name[n].g_dim)
                        for n, side in rank.inverted)
        precondition = sum(cost.precondition(by_name[n].g_dim, by_name[n].a_dim)
                           for n in rank.preconditioned)
        out.append(WorkerCompute(rank.rank, factors, inversion, precondition))
    return out


def busiest(workers: Sequence[WorkerCompute]) -> WorkerCompute:
    """The worker with the most factor construction plus inversion (lowest rank on ties)."""
    return max(workers, key=lambda w: (w.total, -w.rank))
