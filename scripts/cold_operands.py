"""How much slower a preconditioning product runs when its operands are no longer in cache.

``scripts/bench.py`` bounds each product ``F⁻¹ x`` by its FLOPs at the GEMM rate measured on
hot square operands (or by reading its operands at the copy bandwidth, whichever is longer).
In a training step each layer's inverse and gradient were last touched before the forward and
backward passes, which evict them from the core's caches, so the product first reads them from
further away. For ResNet-18's 4,608-wide products that read is small next to the FLOPs; for
the small BERT's 256-wide products, and in bf16 above all (four times the fp32 rate on half the
bytes), it is not. This script times the benchmark models' products hot (repeated calls) and
after writing a buffer of each given size (8 MB evicts this machine's 2 MB per-core L2, 1 GB
its shared L3 as well), as multiples of the bound's compute term::

    python -m scripts.cold_operands
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

import torch

from reproductions.common.cli import positive_int
from scripts.bench import Clock, gemm_rate, markdown_table
from scripts.gram_blocks import parse_shape_args

#: ``(m, k, n)`` of ``(m, k) @ (k, n)`` as :func:`core.inverse.precondition` runs them, for a
#: gradient ``(g, a)``: ``G⁻¹ ∇W̄`` is ``(g, g, a)``, ``∇W̄ A⁻¹`` is ``(g, a, a)``. The small
#: BERT's 256-to-256 and 256-to-1,024 layers (257 with the bias), and ResNet-18's largest
#: (``layer4``'s 3x3 convolutions: 512 outputs, 4,608 = 512·3·3 inputs).
SHAPES = ((256, 256, 257), (256, 257, 257), (1024, 1024, 257), (1024, 257, 257),
          (512, 512, 4608), (512, 4608, 4608))
DTYPES = (torch.float32, torch.bfloat16)
FLUSH_MB = (8, 1024)


def product_seconds(a: torch.Tensor, b: torch.Tensor, buffers: Sequence[torch.Tensor],
                    clock: Clock, repeats: int) -> list[float]:
    """Median seconds of ``a @ b`` over ``repeats`` calls after one warm-up: calls back to
    back (hot), then each call right after writing each buffer."""
    def product() -> object:
        return a @ b

    product()
    times = [statistics.median(clock.time(product) for _ in range(repeats))]
    for buffer in buffers:
        seconds = []
        for _ in range(repeats):
            buffer.add_(1.0)
            seconds.append(clock.time(product))
        times.append(statistics.median(seconds))
    return times


def measure(shapes: Sequence[tuple[int, int, int]], flush_mb: Sequence[int],
            device: torch.device, repeats: int) -> list[list[str]]:
    """One row per shape and dtype: the bound, then the product hot and after each flush, as
    multiples of the bound."""
    clock = Clock(device)
    buffers = [torch.zeros(mb * 2**20 // 4, device=device) for mb in flush_mb]
    lines = []
    for m, k, n in shapes:
        for dtype in DTYPES:
            size = min(m, k, n)
            square = [torch.randn(size, size, device=device, dtype=dtype) for _ in range(2)]
            bound = 2 * m * k * n / gemm_rate(*square, clock, repeats)
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            times = product_seconds(a, b, buffers, clock, repeats)
            lines.append([f"{m} x {k} x {n}", str(dtype).removeprefix("torch."),
                          f"{bound * 1e6:.0f}", *(f"{t / bound:.2f}" for t in times)])
    return lines


def main(argv: Sequence[str] | None = None,
         out: Callable[[str], object] = print) -> list[list[str]]:
    """Print the table (and return its rows)."""
    def flush_option(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--flush-mb", type=positive_int, nargs="+", default=list(FLUSH_MB),
                            help="sizes of the buffers written before a cold call (MB)")

    args, shapes = parse_shape_args(__doc__.split("\n\n")[0], "MxKxN",
                                    "product shapes (default: the benchmark models')", SHAPES,
                                    argv, flush_option)
    lines = measure(shapes, args.flush_mb, torch.device(args.device),  # type: ignore[arg-type]
                    args.repeats)
    header = ["m x k x n", "dtype", "bound (µs)", "hot / bound",
              *(f"after {mb} MB written / bound" for mb in args.flush_mb)]
    out(f"A product's time over its lower bound, operands hot and evicted, {args.device}:\n")
    out(markdown_table(header, lines))
    return lines


if __name__ == "__main__":
    main()
