"""How fast ``cholesky_solve`` applies ``A``'s side each way on this host.

``P = ∇ L⁻ᵀ L⁻¹`` needs triangular solves from the right. :func:`core.inverse.solve_from_right`
runs them either in place from the right or from the left on a transposed copy of the gradient
(``Pᵀ = L⁻ᵀ L⁻¹ ∇ᵀ``), and which is faster depends on the BLAS and the CPU: MKL's right-side
solves ran at half the rate of its left-side ones on an AMD EPYC core and as fast on an Intel
Xeon core, so the library takes the transposed path on AMD CPUs alone
(:data:`core.inverse.TRANSPOSED_SOLVE_MIN_ROWS`). This script times both on the ``A`` sides of
the benchmark's models, so the choice can be checked on another host::

    python -m scripts.solve_sides
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from core import host_kernels
from core.inverse import solve_from_right, transposes_a_side
from scripts.bench import (
    Clock,
    TimedCall,
    fastest_seconds,
    markdown_table,
    well_conditioned_spd,
)
from scripts.gram_blocks import parse_shape_args

#: (``A``'s dimension, gradient rows): ResNet-18's 576- to 4,608-wide ``A`` with 64 to 512
#: output channels, and the small BERT's 257- and 1,025-wide ``A`` with 256 and 1,024 rows.
SHAPES = ((576, 64), (1152, 128), (2304, 256), (4608, 512), (257, 256), (257, 1024),
          (1025, 256))


def measure(shapes: Sequence[tuple[int, int]], device: torch.device, repeats: int
            ) -> list[list[str]]:
    """One table row per shape: both ways' times, their ratio, and the library's choice."""
    clock = Clock(device)

    def seconds(chol: torch.Tensor, grad: torch.Tensor, transposed: bool) -> float:
        """One way's time, less that of the working copy the caller makes."""
        call = TimedCall(lambda: solve_from_right(grad.clone(), chol, transposed=transposed),
                         grad.clone)
        return fastest_seconds(clock, [call], repeats)

    lines = []
    for dim, rows in shapes:
        chol = torch.linalg.cholesky(well_conditioned_spd(dim, device))
        grad = torch.randn(rows, dim, device=device)
        right, transposed = (seconds(chol, grad, way) for way in (False, True))
        lines.append([f"{dim} x {rows}", f"{right * 1e3:.3g}", f"{transposed * 1e3:.3g}",
                      f"{right / transposed:.2f}",
                      "transposed" if transposes_a_side(rows, device) else "right side"])
    return lines


def main(argv: Sequence[str] | None = None,
         out: Callable[[str], object] = print) -> list[list[str]]:
    """Print the table (and return its rows)."""
    args, shapes = parse_shape_args(__doc__.split("\n\n")[0], "DIMxROWS",
                                    "A dimension x gradient rows (default: the benchmark "
                                    "models')", SHAPES, argv)
    device = torch.device(args.device)
    lines = measure(shapes, device, args.repeats)  # type: ignore[arg-type]
    out(f"A's side of cholesky_solve, {args.device}, CPU vendor "
        f"{host_kernels.cpu_vendor() or 'unknown'}, best of {args.repeats}:\n")
    out(markdown_table(["A dim x rows", "right side (ms)", "transposed copy (ms)",
                        "right / transposed", "library's choice"], lines))
    return lines


if __name__ == "__main__":
    main()
