"""Measured times of the K-FAC kernels and of the forward/backward pass, on this machine.

Paper-scale kernels are too large to time one by one on a 2-core CPU within minutes, so each
distinct shape is timed once (cached) under a budget, and larger work is scaled:

* **GEMMs** (factor construction ``XᵀX`` and the preconditioning products) are timed with
  their long dimension (factor rows; the gradient's rows) cut so that one product is at most
  :attr:`Budget.gemm_macs` multiply-adds (never below :attr:`Budget.min_rows`), and scaled
  linearly back: GEMM time is linear in that dimension once it is a few hundred long.
* **Decompositions** (``eigh``, Cholesky + inverse, LU inverse) are timed directly up to
  :attr:`Budget.direct_dim`; above it, ``t = c·n³`` with ``c`` fitted (least squares) on
  :attr:`Budget.anchor_dims`.
* **Forward + backward** is timed at a small batch and scaled linearly to the per-GPU batch.
* **Rates** (:func:`measure_rates`): one GEMM throughput, one decomposition throughput and the
  forward/backward time per image, for models that take FLOPs at a fixed rate.

Each timing is the fastest of a few repetitions after a warm-up. Timings depend on the threads
(``torch.get_num_threads()``) and on other load on the machine; both are recorded.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from core import host_kernels
from reproductions.common.cost import (
    DECOMPOSITION_FLOPS_PER_N3,
    PRECONDITION_GEMM_PAIRS,
    FlopCost,
    KernelRates,
)
from reproductions.common.shapes import Workload


@dataclass(frozen=True)
class Budget:
    """How much measuring to do.

    Attributes:
        gemm_macs: Largest product timed, in multiply-adds.
        min_rows: Shortest cut long dimension of a timed GEMM.
        direct_dim: Largest decomposition timed directly.
        anchor_dims: Sizes the ``c·n³`` law is fitted on, for larger decompositions.
        reps: Timed repetitions after the warm-up (fewer when one takes over a second).
        ffbp_batch: Batch of the timed forward/backward pass.
    """

    gemm_macs: float = 4e8
    min_rows: int = 256
    direct_dim: int = 1024
    anchor_dims: tuple[int, ...] = (1024, 1536, 2048)
    reps: int = 3
    ffbp_batch: int = 2


QUICK_BUDGET = Budget(gemm_macs=2e6, min_rows=32, direct_dim=96, anchor_dims=(64, 96),
                      reps=1, ffbp_batch=1)
"""A budget for smoke tests: seconds, not minutes; the times are then rough."""


def timed(fn: Callable[[], object], reps: int, device: torch.device, *,
          warm_up: bool = True) -> float:
    """Fastest wall time of ``fn`` over up to ``reps`` runs (at least one; no more once a
    second has been spent), after one untimed warm-up run unless ``warm_up`` is False."""

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    if warm_up:
        once()
    best, spent = math.inf, 0.0
    for _ in range(max(1, reps)):
        if spent > 1.0:
            break
        seconds = once()
        spent += seconds
        best = min(best, seconds)
    return best


def _spd(n: int, device: torch.device) -> Tensor:
    """A well-conditioned symmetric positive definite ``n × n`` matrix."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, n, generator=generator).to(device)
    return x @ x.T / n + torch.eye(n, device=device)


def _decompose(method: str) -> Callable[[Tensor], object]:
    if method == "eigen":
        return torch.linalg.eigh
    if method == "cholesky":
        return lambda m: torch.cholesky_inverse(torch.linalg.cholesky(m))
    if method == "cholesky_solve":
        return torch.linalg.cholesky
    return torch.linalg.inv


@dataclass
class KernelTimes:
    """Measured seconds per kernel, cached per shape (a :class:`~reproductions.common.cost.
    KernelCost` in seconds).

    Args:
        method: Inversion method timed (``"eigen"``, ``"cholesky"``, ``"inverse"``,
            ``"cholesky_solve"``).
        budget: How much to measure.
        device: Where to measure.
    """

    method: str = "eigen"
    budget: Budget = field(default_factory=Budget)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _cache: dict[tuple[object, ...], float] = field(default_factory=dict, repr=False)
    _cubic: float | None = field(default=None, repr=False)
    measuring_s: float = 0.0

    def _measure(self, key: tuple[object, ...], fn: Callable[[], float]) -> float:
        if key not in self._cache:
            start = time.perf_counter()
            self._cache[key] = fn()
            self.measuring_s += time.perf_counter() - start
        return self._cache[key]

    def _cut(self, long: int, other: int) -> int:
        """The long dimension to time a GEMM with (``other`` = product of the other two)."""
        return min(long, max(self.budget.min_rows, math.ceil(self.budget.gemm_macs / other)))

    def factor(self, rows: int, n: int) -> float:
        """``XᵀX`` of a ``rows × n`` matrix."""
        cut = self._cut(rows, n * n)

        def run() -> float:
            x = torch.randn(cut, n, device=self.device)
            return timed(lambda: x.T @ x, self.budget.reps, self.device)

        return self._measure(("factor", cut, n), run) * rows / cut

    def matmul(self, m: int, k: int, n: int) -> float:
        """``(m × k) @ (k × n)``."""
        cut = self._cut(m, k * n)

        def run() -> float:
            left = torch.randn(cut, k, device=self.device)
            right = torch.randn(k, n, device=self.device)
            return timed(lambda: left @ right, self.budget.reps, self.device)

        return self._measure(("matmul", cut, k, n), run) * m / cut

    def precondition(self, g: int, a: int) -> float:
        """The preconditioning products of a ``g × a`` gradient."""
        pairs = PRECONDITION_GEMM_PAIRS[self.method]
        return pairs * (self.matmul(g, g, a) + self.matmul(g, a, a))

    def _timed_decomposition(self, n: int) -> float:
        def run() -> float:
            matrix = _spd(n, self.device)
            decompose = _decompose(self.method)
            return timed(lambda: decompose(matrix), self.budget.reps, self.device)

        return self._measure(("decomposition", n), run)

    @property
    def cubic_coefficient(self) -> float:
        """``c`` of ``t = c·n³``, fitted on the anchor sizes (seconds per n³)."""
        if self._cubic is None:
            dims = self.budget.anchor_dims
            times = [self._timed_decomposition(n) for n in dims]
            self._cubic = (sum(t * n**3 for t, n in zip(times, dims, strict=True))
                           / sum(float(n) ** 6 for n in dims))
        return self._cubic

    def decomposition(self, n: int) -> float:
        """Decomposing or inverting one ``n × n`` factor."""
        if n <= self.budget.direct_dim:
            return self._timed_decomposition(n)
        return self.cubic_coefficient * float(n) ** 3

    def describe(self) -> str:
        """How the times were made: machine, threads, load, budget, the fitted law."""
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        model = host_kernels.cpuinfo_field("model name") or "model unknown"
        name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                else f"CPU ({model}), {torch.get_num_threads()} thread(s)")
        cubic = (f"; above n = {self.budget.direct_dim}, {self.method} time = "
                 f"{self.cubic_coefficient:.3g}·n³ s fitted on n = "
                 f"{', '.join(map(str, self.budget.anchor_dims))}") if self._cubic else ""
        return (f"Kernels timed on {name} (load average {load} during the run; other jobs "
                f"shared the machine when it is above the thread count). GEMMs cut to "
                f"≤ {self.budget.gemm_macs:.2g} multiply-adds and scaled linearly; "
                f"decompositions timed up to n = {self.budget.direct_dim}{cubic}. "
                f"{len(self._cache)} shapes timed in {self.measuring_s:.0f} s.")


@dataclass(frozen=True)
class PassMeasurement:
    """A measured forward + backward pass.

    Attributes:
        seconds: Forward + backward time at the workload's per-GPU batch (scaled linearly from
            the timed batch).
        saved_bytes: Bytes autograd keeps for the backward pass at the per-GPU batch (counted at
            the timed batch, distinct storages, parameters excluded, scaled linearly).
        parameter_bytes: Bytes of the parameters.
        batch: The batch that was timed.
    """

    seconds: float
    saved_bytes: int
    parameter_bytes: int
    batch: int


def measure_pass(work: Workload, batch: int, device: torch.device, reps: int = 1
                 ) -> PassMeasurement:
    """Time forward + backward (cross-entropy on random labels) of ``work`` at ``batch``
    (fastest of ``reps``, fewer once a second is spent).

    The first pass counts the tensors saved for backward (by storage) and is the warm-up; the
    timed passes run without hooks.
    """
    torch.manual_seed(0)
    with device:
        model = work.build()
    model.train()
    x = torch.randn(batch, 3, work.image_size, work.image_size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    seconds = timed(step, reps, device, warm_up=False)
    scale = work.batch / batch
    return PassMeasurement(seconds * scale, round(sum(saved.values()) * scale),
                           sum(p.numel() * p.element_size() for p in model.parameters()), batch)


RATE_GEMM_DIM = 512
"""Factor dimension of the GEMM whose throughput stands for all GEMMs (ResNet-50's factors run
from 64 to 4,609)."""


def measure_rates(work: Workload, method: str, budget: Budget, device: torch.device
                  ) -> KernelRates:
    """GEMM and decomposition throughput, and forward/backward seconds per image of ``work``,
    measured here with the same timers as :class:`KernelTimes` and :func:`measure_pass`.

    The GEMM rate is that of one factor product ``XᵀX`` with ``n =`` :data:`RATE_GEMM_DIM` (its
    rows cut to ``budget.gemm_macs``); the decomposition rate divides
    :data:`~reproductions.common.cost.DECOMPOSITION_FLOPS_PER_N3` by the ``c`` of ``t = c·n³``
    fitted on ``budget.anchor_dims``; forward + backward is timed at ``budget.ffbp_batch``.
    """
    times = KernelTimes(method, budget, device)
    rows = 10**9  # far past the budget: the timed product is cut, and the rate is its own
    gemm = FlopCost(method).factor(rows, RATE_GEMM_DIM) / times.factor(rows, RATE_GEMM_DIM)
    decomposition = DECOMPOSITION_FLOPS_PER_N3[method] / times.cubic_coefficient
    measured = measure_pass(work, budget.ffbp_batch, device, reps=budget.reps)
    source = (f"{times.describe()} GEMM rate from XᵀX with n = {RATE_GEMM_DIM}; forward + "
              f"backward of {work.label} ({work.image_size}×{work.image_size}, fp32) timed at "
              f"batch {measured.batch} and scaled linearly.")
    return KernelRates(method, gemm, decomposition, measured.seconds / work.batch,
                       f"{work.key}@{work.image_size}", source)
