"""How fast each way of forming a Kronecker factor ``(1/R) Σ m mᵀ`` runs on a device.

``core.factors.SymmetricGram`` multiplies only the column blocks on and above the diagonal
(``GRAM_BLOCK`` wide) except on the CPU, where it calls BLAS ``syrk``. Narrow blocks save
FLOPs but launch many small GEMMs, which a GPU runs far below its peak; this script measures
each block width (and one full GEMM, and ``syrk`` on the CPU) on the factor shapes of the
benchmark's models, as a fraction of the lower bound ``scripts/bench.py`` uses (``rows·d²``
FLOPs at the measured GEMM rate), so the width can be chosen per device from data::

    python -m scripts.gram_blocks                  # this machine's CPU
    python -m scripts.gram_blocks --device cuda    # run by scripts/gpu_check.sh
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

import core.factors
from core.factors import SymmetricGram
from reproductions.common.cli import positive_int
from scripts.bench import Clock, gemm_rate, markdown_table

#: (factor dimension, rows): ResNet-18's largest A (4,608 = 512·3·3) at 32x32 and 224x224
#: batch sizes, its 2,304 and 1,152, and the small BERT's 257 and 1,025 (1,024 tokens).
SHAPES = ((4608, 512), (4608, 784), (2304, 2048), (1152, 8192), (1025, 1024), (257, 1024))
BLOCKS = (256, 512, 1024, 2048)


@contextmanager
def gram_path(block: int | None, syrk: bool) -> Iterator[None]:
    """``SymmetricGram`` with blocks ``block`` wide (None: one block, the full GEMM), or with
    the CPU's ``syrk`` (whose result is mirrored in the default blocks)."""
    saved = core.factors.GRAM_BLOCK, core.factors.HOST_SYRK
    if not syrk:
        core.factors.GRAM_BLOCK = block if block is not None else 1 << 30
    core.factors.HOST_SYRK = syrk
    try:
        yield
    finally:
        core.factors.GRAM_BLOCK, core.factors.HOST_SYRK = saved


def gram_seconds(m: torch.Tensor, clock: Clock, repeats: int) -> float:
    """Seconds to form and symmetrise the factor of ``m`` (``(dim, rows)``) as configured."""
    def form() -> torch.Tensor:
        gram = SymmetricGram(m.shape[0], m.dtype, m.device)
        gram.add(m, 1.0 / m.shape[1])
        return gram.result()

    return clock.best(form, repeats)


def measure(shapes: Sequence[tuple[int, int]], device: torch.device, repeats: int
            ) -> list[list[str]]:
    """One table row per shape: each path's time over the bound."""
    clock = Clock(device)
    lines = []
    for dim, rows in shapes:
        square = torch.randn(dim, dim, device=device), torch.randn(dim, dim, device=device)
        bound = rows * dim * dim / gemm_rate(*square, clock, repeats)
        m = torch.randn(rows, dim, device=device).T  # feature-major, as the factors see rows
        paths: list[tuple[int | None, bool]] = [(b, False) for b in BLOCKS]
        paths.append((None, False))
        if device.type == "cpu":
            paths.append((None, True))
        cells = []
        for block, syrk in paths:
            if block is not None and block >= dim:  # one block: the full GEMM's column
                cells.append("")
                continue
            with gram_path(block, syrk):
                cells.append(f"{gram_seconds(m, clock, repeats) / bound:.2f}")
        lines.append([f"{dim} x {rows}", f"{bound * 1e3:.3g}", *cells])
    return lines


def parse_shape_args(description: str, metavar: str, shapes_help: str,
                     defaults: Sequence[tuple[int, ...]], argv: Sequence[str] | None,
                     more: Callable[[argparse.ArgumentParser], object] | None = None
                     ) -> tuple[argparse.Namespace, list[tuple[int, ...]]]:
    """The options of a per-shape timing table (``--device``, ``--repeats``, ``--shapes`` as
    ``AxB[xC]``, and those ``more`` adds to the parser) and the shapes to time; torch is set
    to one thread."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--shapes", nargs="+", default=None, metavar=metavar, help=shapes_help,
                        type=_shape(metavar.count("x") + 1))
    if more is not None:
        more(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = list(defaults) if args.shapes is None else args.shapes
    return args, shapes


def _shape(dims: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type``: ``AxB[xC]`` with ``dims`` positive integers."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            shape = tuple(int(n) for n in text.split("x"))
        except ValueError:
            shape = ()
        if len(shape) != dims or min(shape) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {dims} positive integers joined by 'x'")
        return shape
    return parse


def main(argv: Sequence[str] | None = None,
         out: Callable[[str], object] = print) -> list[list[str]]:
    """Print the table (and return its rows)."""
    args, shapes = parse_shape_args(__doc__.split("\n\n")[0], "DIMxROWS",
                                    "factor shapes (default: the benchmark models')", SHAPES,
                                    argv)
    lines = measure(shapes, torch.device(args.device), args.repeats)  # type: ignore[arg-type]
    header = ["factor dim x rows", "bound (ms)", *(f"blocks of {b}" for b in BLOCKS),
              "one GEMM", *(["syrk"] if args.device == "cpu" else [])]
    out(f"Time to form a factor over its lower bound, {args.device}:\n")
    out(markdown_table(header, lines))
    return lines


if __name__ == "__main__":
    main()
