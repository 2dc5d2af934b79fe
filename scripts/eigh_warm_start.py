"""Is a warm-started eigendecomposition worth it for K-FAC's eigen method? Time and accuracy.

Distributed Shampoo and SOAP refresh their eigenbases by reusing the previous one: one subspace
(power) iteration ``Q ← qr(F Q)`` instead of a full ``eigh``. For K-FAC that would mean, at each
inverse update, ``Q = qr(F Q_old)`` and Rayleigh-quotient eigenvalues ``d = diag(Qᵀ F Q)``. This
script measures, per factor size, in one run and with the same clock as ``scripts/bench.py``:

* the time of a full ``eigh`` and of the warm start (one GEMM, a QR, one more GEMM for ``d``);
* the accuracy of ``(F + λI)⁻¹ v`` computed from each basis against a float64 solve, where ``F``
  is a running-average factor that drifted for ``interval`` steps since the old basis was
  computed, next to the error of simply keeping the old (stale) decomposition.

The factors are synthetic, labelled so: a running average (decay 0.95, as K-FAC's default) of
batch Gram matrices ``X Xᵀ / m`` whose rows have a power-law spectrum (eigenvalue ``k^-2``), the
shape of real Kronecker factors; ``λ = 10⁻³ · tr F / n``.

    python -m scripts.eigh_warm_start                     # sizes 256 … 4608 (~3 minutes)
    python -m scripts.eigh_warm_start --sizes 64 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from reproductions.common.cli import positive_int
from scripts.bench import Clock, markdown_table

DECAY = 0.95


@dataclass(frozen=True)
class WarmStartRow:
    """One factor size: seconds of each refresh and errors of each basis (median over trials)."""

    n: int
    eigh_s: float
    warm_s: float
    speedup: float
    error_exact: float
    error_warm: float
    error_stale: float


def refresh_warm(factor: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One subspace iteration from ``basis``: the new basis and its Rayleigh quotients."""
    q, _ = torch.linalg.qr(factor @ basis)
    return q, (q * (factor @ q)).sum(dim=0).clamp_(min=0.0)


def refresh_full(factor: Tensor) -> tuple[Tensor, Tensor]:
    """A full eigendecomposition: basis and clamped eigenvalues."""
    d, q = torch.linalg.eigh(factor)
    return q, d.clamp_(min=0.0)


def damped_solve_error(basis: Tensor, values: Tensor, factor: Tensor, damping: float,
                       vectors: Tensor) -> float:
    """Relative error of ``Q diag(1/(d+λ)) Qᵀ V`` against the float64 solve of ``(F+λI) X = V``."""
    approx = basis @ ((basis.T @ vectors) / (values + damping)[:, None])
    f64 = factor.double()
    exact = torch.linalg.solve(f64 + damping * torch.eye(len(f64), dtype=f64.dtype),
                               vectors.double())
    return float(torch.linalg.norm(approx.double() - exact) / torch.linalg.norm(exact))


class DriftingFactor:
    """A running-average factor of synthetic batch Gram matrices with a power-law spectrum."""

    def __init__(self, n: int, batch: int, generator: torch.Generator) -> None:
        self.batch, self.generator = batch, generator
        mix, _ = torch.linalg.qr(torch.randn(n, n, generator=generator))
        self.shape = mix * torch.arange(1, n + 1, dtype=torch.float32).reciprocal()
        self.value = self._batch()

    def _batch(self) -> Tensor:
        x = self.shape @ torch.randn(len(self.shape), self.batch, generator=self.generator)
        return x @ x.T / self.batch

    def step(self) -> Tensor:
        """Blend one new batch factor in and return the running average."""
        self.value = DECAY * self.value + (1 - DECAY) * self._batch()
        return self.value


def measure(n: int, interval: int, trials: int, clock: Clock, seed: int = 0) -> WarmStartRow:
    """Time and accuracy of the two refreshes at size ``n`` after ``interval`` drift steps."""
    generator = torch.Generator().manual_seed(seed + n)
    factor = DriftingFactor(n, batch=max(n // 4, 8), generator=generator)
    basis, values = refresh_full(factor.value)
    times: dict[str, list[float]] = {"eigh": [], "warm": []}
    errors: dict[str, list[float]] = {"exact": [], "warm": [], "stale": []}
    for _ in range(trials):
        for _ in range(interval):
            current = factor.step()
        damping = 1e-3 * float(torch.trace(current)) / n
        vectors = torch.randn(n, 16, generator=generator)
        times["eigh"].append(clock.time(lambda f=current: refresh_full(f)))
        times["warm"].append(clock.time(lambda f=current, q=basis: refresh_warm(f, q)))
        exact, warm = refresh_full(current), refresh_warm(current, basis)
        errors["exact"].append(damped_solve_error(*exact, current, damping, vectors))
        errors["warm"].append(damped_solve_error(*warm, current, damping, vectors))
        errors["stale"].append(damped_solve_error(basis, values, current, damping, vectors))
        basis, values = warm  # the warm start keeps refreshing its own basis
    eigh_s, warm_s = statistics.median(times["eigh"]), statistics.median(times["warm"])
    return WarmStartRow(n, eigh_s, warm_s, eigh_s / warm_s,
                        *(statistics.median(errors[k]) for k in ("exact", "warm", "stale")))


def table(rows: Sequence[WarmStartRow]) -> str:
    """The markdown table of a run."""
    return markdown_table(
        ["n", "eigh s", "warm start s", "speed-up", "error: eigh", "error: warm start",
         "error: stale basis"],
        [[str(r.n), f"{r.eigh_s:.3f}", f"{r.warm_s:.3f}", f"{r.speedup:.2f}",
          f"{r.error_exact:.1e}", f"{r.error_warm:.1e}", f"{r.error_stale:.1e}"] for r in rows])


def main(argv: Sequence[str] | None = None) -> list[WarmStartRow]:
    """Measure every size, print the table and optionally write the rows as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=positive_int,
                        default=[256, 512, 1152, 2304, 4608])
    parser.add_argument("--interval", type=positive_int, default=10,
                        help="drift steps between refreshes (the inverse update interval)")
    parser.add_argument("--trials", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = Clock(torch.device("cpu"))
    rows = [measure(n, args.interval, args.trials, clock) for n in args.sizes]
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"interval": args.interval, "trials": args.trials,
                                         "threads": args.threads, "decay": DECAY,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    return rows


if __name__ == "__main__":
    main()
