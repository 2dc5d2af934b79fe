"""How long a stride-1 convolution's ``A`` factor takes from shifted views of its input against
the product of its patch rows, on a device, and whether the preconditioner uses it there.

``core.conv_gram`` forms the factor of a stride-1 convolution from one GEMM per kernel
displacement over the padded input (plus edge corrections) instead of the ``syrk`` of its
im2col rows where that takes under ``core.layers.SHIFTED_FLOP_FRACTION`` of the FLOPs;
``core.layers.SHIFTED_CONV_GRAM`` switches it off. This script times both through the
preconditioner's own capture-to-factor path (the shifted one wherever it saves any FLOPs), on
the 3x3 layers of ResNet-18 at the benchmark's two input sizes, checks that they agree, and
says which one the preconditioner picks::

    python -m scripts.conv_gram                  # this machine's CPU
    python -m scripts.conv_gram --device cuda
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

import core.layers
from core import KFACPreconditioner
from scripts.bench import Clock, markdown_table
from scripts.gram_blocks import parse_shape_args

#: (batch, channels, height = width) of ResNet-18's stride-1 3x3 convolutions: CIFAR stem at
#: 32x32 with batch 32, ImageNet at 224x224 with batch 16.
SHAPES = ((32, 64, 32), (32, 128, 16), (32, 256, 8), (32, 512, 4),
          (16, 64, 56), (16, 128, 28), (16, 256, 14), (16, 512, 7))


@contextmanager
def shifted_gram(enabled: bool) -> Iterator[None]:
    """``core.layers.SHIFTED_CONV_GRAM`` set to ``enabled``, and the shifted product taken
    wherever it saves any FLOPs (``SHIFTED_FLOP_FRACTION`` 1); both restored afterwards."""
    saved = core.layers.SHIFTED_CONV_GRAM, core.layers.SHIFTED_FLOP_FRACTION
    core.layers.SHIFTED_CONV_GRAM, core.layers.SHIFTED_FLOP_FRACTION = enabled, 1.0
    try:
        yield
    finally:
        core.layers.SHIFTED_CONV_GRAM, core.layers.SHIFTED_FLOP_FRACTION = saved


def factor_seconds(conv: nn.Conv2d, x: Tensor, clock: Clock, repeats: int
                   ) -> tuple[float, Tensor]:
    """Best seconds to turn a captured input into its batch ``A`` (with the current switch),
    and that factor."""
    layer = KFACPreconditioner(conv, factor_scaling="kfc").layers[0]
    result: list[Tensor] = []

    def form() -> None:
        layer.capture_input(x)
        layer.fold_captures()
        batch = layer.a.take_batch()
        assert batch is not None
        result[:] = [batch]

    return clock.best(form, repeats), result[0]


def measure(shapes: Sequence[tuple[int, int, int]], device: torch.device, repeats: int
            ) -> list[list[str]]:
    """One table row per shape: both paths' times, the speed-up, FLOPs, the agreement, and
    the path the preconditioner takes with the module's settings."""
    clock = Clock(device)
    lines = []
    for batch, channels, size in shapes:
        conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False).to(device)
        x = torch.randn(batch, channels, size, size, device=device)
        helper = core.layers.Conv2dHelper(conv)
        used = "shifted views" if helper.shifted_plan(x.shape) is not None else "patch rows"
        with shifted_gram(False):
            rows_s, rows_a = factor_seconds(conv, x, clock, repeats)
        with shifted_gram(True):
            plan = helper.shifted_plan(x.shape)
            shifted_s, shifted_a = factor_seconds(conv, x, clock, repeats)
        if plan is None:  # the shifted product saves no FLOPs here: nothing to compare
            lines.append([f"{batch} x {channels} x {size}", f"{rows_s * 1e3:.3g}", "", "",
                          "", "", used])
            continue
        difference = ((shifted_a - rows_a).abs().max() / rows_a.abs().max()).item()
        lines.append([f"{batch} x {channels} x {size}", f"{rows_s * 1e3:.3g}",
                      f"{shifted_s * 1e3:.3g}", f"{rows_s / shifted_s:.2f}",
                      f"{plan.flops(batch, channels) / plan.patch_flops(batch, channels):.2f}",
                      f"{difference:.1e}", used])
    return lines


def main(argv: Sequence[str] | None = None,
         out: Callable[[str], object] = print) -> list[list[str]]:
    """Print the table (and return its rows)."""
    args, shapes = parse_shape_args(
        __doc__.split("\n\n")[0], "BxCxH",
        "batch x channels x height of 3x3 convolutions (default: ResNet-18's)", SHAPES, argv)
    lines = measure(shapes, torch.device(args.device), args.repeats)  # type: ignore[arg-type]
    header = ["batch x channels x size", "patch rows (ms)", "shifted views (ms)", "speed-up",
              "FLOPs shifted / patches", "max relative difference", "used"]
    out(f"A factor of a stride-1 3x3 convolution, {args.device}:\n")
    out(markdown_table(header, lines))
    return lines


if __name__ == "__main__":
    main()
