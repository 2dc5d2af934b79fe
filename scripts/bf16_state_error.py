"""How far a bf16 second-order state (``precondition_dtype="bfloat16"``) moves each layer's
preconditioned gradient from the fp32 state's, on a model trained for a few K-FAC steps.

Rounding the state and the gradient to bf16 perturbs each entry by at most 2⁻⁸ relative, but
the product can lose much more where it cancels: a factor that is rank-deficient next to the
damping has inverse entries of order 1/λ that the exact gradient never excites, and rounding
noise does. This script trains ``--steps`` steps of SGD with K-FAC (random batches, fp32 state),
then preconditions each layer's last gradient with the fp32 state and with its bf16 rounding,
and prints the relative error and the cosine per layer, worst last; and which factors
``precondition_dtype_tolerance`` (``--tolerance``, the default's value by default) would keep in
fp32 on that gradient, and the error left with them kept. ``--method mkor`` does the same for
MKOR's inverse factors (updated on every step; MKOR has no tolerance, so nothing is kept).

    OMP_NUM_THREADS=1 python -m scripts.bf16_state_error --workload resnet18-32
    OMP_NUM_THREADS=1 python -m scripts.bf16_state_error --workload bert-small --method mkor
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core import KFACConfig, KFACPreconditioner, MKORPreconditioner  # noqa: E402
from core.inverse import (  # noqa: E402
    SIDES,
    factor_shifts,
    kept_dtype,
    make_state,
    precondition,
)
from core.optim import build_optimizer  # noqa: E402
from reproductions.common.cli import float_in, positive_int  # noqa: E402
from scripts import bench  # noqa: E402


@dataclass(frozen=True)
class LayerError:
    """One layer's preconditioned gradient under a bf16 state, against the fp32 state's.

    Attributes:
        name: The layer.
        a_dim: Width of its input factor.
        g_dim: Width of its output-gradient factor.
        relative_error: ``‖P_bf16 − P_fp32‖ / ‖P_fp32‖`` (Frobenius).
        cosine: Cosine of the angle between the two.
        kept: The factors (``A``, ``G``) the tolerance keeps in fp32.
        guarded_error: The relative error with those kept in fp32, the others rounded.
    """

    name: str
    a_dim: int
    g_dim: int
    relative_error: float
    cosine: float
    kept: str
    guarded_error: float


def _relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got - exact).norm() / exact.norm().clamp_min(1e-30))


def _trained(workload: bench.Workload, precond: KFACPreconditioner | MKORPreconditioner,
             model: torch.nn.Module, steps: int) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps of ``workload``'s base optimizer on random batches of its shape,
    preconditioned; the last step's raw gradient matrices by layer name."""
    optimizer = build_optimizer(workload.base, model, lr=workload.lr)
    device = torch.device("cpu")
    raw: dict[str, torch.Tensor] = {}
    for step in range(steps):
        batch = workload.batch(device, seed=step)
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model, batch).backward()
        raw = {layer.name: matrix.clone() for layer in precond.layers
               if (matrix := layer.helper.grad_matrix()) is not None}
        precond.step()
        optimizer.step()
    return raw


def _error(name: str, a_dim: int, g_dim: int, rounded: torch.Tensor, exact: torch.Tensor,
           kept: str, guarded: torch.Tensor) -> LayerError:
    rounded, exact = rounded.double().flatten(), exact.double().flatten()
    return LayerError(name, a_dim, g_dim, _relative(rounded, exact),
                      float(torch.nn.functional.cosine_similarity(rounded, exact, dim=0)),
                      kept, _relative(guarded.double().flatten(), exact))


def measure_mkor(workload: bench.Workload, *, steps: int) -> list[LayerError]:
    """Train ``steps`` MKOR steps (inverse factors updated on each) on random batches of
    ``workload``'s shape, then compare each layer's last gradient preconditioned with the fp32
    inverses and with their bf16 rounding (``precondition_dtype="bfloat16"``)."""
    torch.manual_seed(0)
    model = workload.build()
    precond = MKORPreconditioner(model, inv_update_steps=1, skip_layers=workload.skip_layers)
    raw = _trained(workload, precond, model, steps)
    out = []
    for layer in precond.layers:
        if layer.name not in raw:
            continue
        grad = raw[layer.name]
        exact = layer.precondition(grad)
        rounded = layer.precondition(grad, torch.bfloat16)
        out.append(_error(layer.name, layer.a_dim, layer.g_dim, rounded, exact, "-", rounded))
    return sorted(out, key=lambda e: e.relative_error)


def measure(workload: bench.Workload, *, method: str, damping: float, steps: int,
            tolerance: float) -> list[LayerError]:
    """Train ``steps`` K-FAC steps on random batches of ``workload``'s shape, then compare
    each layer's last gradient preconditioned with the fp32 state and its bf16 rounding, whole
    and with the factors ``tolerance`` keeps in fp32."""
    torch.manual_seed(0)
    model = workload.build()
    precond = KFACPreconditioner(model, inverse_method=method, damping=damping, kl_clip=None,
                                 skip_layers=workload.skip_layers)
    raw = _trained(workload, precond, model, steps)
    out = []
    for layer in precond.layers:
        if layer.state is None or layer.name not in raw:
            continue
        grad = raw[layer.name]
        exact = precondition(grad, layer.state, damping)
        low = make_state(layer.state.kind, [t.bfloat16() for t in layer.state.tensors()])
        rounded = precondition(grad, low, damping)
        guarded = make_state(layer.state.kind, [t.clone() for t in layer.state.tensors()])
        shifts = factor_shifts(layer.a.value, layer.g.value, damping, "full")
        kept = []
        for side, shift in zip(SIDES, shifts, strict=True):
            dtype = kept_dtype(layer.state.side_tensors(side), layer.state.kind, shift, grad,
                               side, torch.bfloat16, tolerance)
            guarded.convert_side(side, dtype)
            if dtype != torch.bfloat16:
                kept.append(side.upper())
        out.append(_error(layer.name, layer.a_dim, layer.g_dim, rounded, exact,
                          ", ".join(kept) or "-", precondition(grad, guarded, damping)))
    return sorted(out, key=lambda e: e.relative_error)


def markdown(errors: Sequence[LayerError]) -> str:
    lines = ["| layer | A width | G width | relative error | cosine | kept fp32 by the "
             "tolerance | error with them kept |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {e.name} | {e.a_dim} | {e.g_dim} | {e.relative_error:.1e} | {e.cosine:.5f} "
              f"| {e.kept} | {e.guarded_error:.1e} |" for e in errors]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="resnet18-32", choices=sorted(bench.WORKLOADS))
    parser.add_argument("--method", default="inverse",
                        choices=("inverse", "cholesky", "eigen", "mkor"))
    parser.add_argument("--damping", type=float_in(0.0, low_inclusive=False), default=1e-3)
    parser.add_argument("--steps", type=positive_int, default=12)
    parser.add_argument("--tolerance", type=float_in(0.0),
                        default=KFACConfig.precondition_dtype_tolerance,
                        help="precondition_dtype_tolerance to show the kept factors of")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[LayerError]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    workload = bench.WORKLOADS[args.workload]
    if args.method == "mkor":
        errors = measure_mkor(workload, steps=args.steps)
    else:
        errors = measure(workload, method=args.method, damping=args.damping, steps=args.steps,
                         tolerance=args.tolerance)
    print(markdown(errors))
    return errors


if __name__ == "__main__":
    main()
