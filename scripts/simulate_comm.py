"""Per-worker communication and memory of every strategy at paper scale, on one CPU.

For ResNet-50 (torchvision) and the BERT-Large encoder (hidden 1024, 24 layers, 16 heads,
intermediate 4096; embeddings and the vocabulary decoder are not K-FAC layers) at P workers,
prints one markdown table per model: per-worker traffic per stage for one second-order update
(factors and inverses updated, gradients preconditioned), mean and max over ranks, and the
largest per-rank memory. Numbers come from ``core.distributed.simulate``, i.e. from the
ledgers the real strategy code fills. MKOR's row is its rank-1 vector all-reduce, recorded by
the same communicator.

    python scripts/simulate_comm.py [--world-size 64] [--symmetry-aware] [--comm-dtype float16]
                                    [--prediv-eigenvalues]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from statistics import mean

import torch
import torchvision
from torch import nn

from core.distributed import Communicator, SimulationReport, simulate
from reproductions.common.cli import exit_on_user_error, float_in

STRATEGIES = ("d-kfac", "comm-opt", "hybrid-opt", "mem-opt", "osawa", "dp-kfac")
STAGES = ("factor_comm", "inverse_comm", "grad_comm")
MB = 1e6


def resnet50() -> nn.Module:
    """torchvision ResNet-50 on the ``meta`` device (shapes only)."""
    with torch.device("meta"):
        return torchvision.models.resnet50()


def bert_large() -> nn.Module:
    """The BERT-Large encoder on the ``meta`` device (no pooler, no prediction heads)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096)
    with torch.device("meta"):
        return BertModel(config, add_pooling_layer=False)


def _row(name: str, report: SimulationReport) -> str:
    cells = [name]
    for stage in STAGES:
        traffic = report.per_worker(stage=stage)
        cells.append(f"{mean(traffic) / MB:,.1f} / {max(traffic) / MB:,.1f}")
    total = report.per_worker()
    cells.append(f"{mean(total) / MB:,.1f} / {max(total) / MB:,.1f}")
    for key in ("factors", "inverses", "buffers", "captured", "total"):
        cells.append(f"{max(report.memory(key)) / MB:,.1f}")
    return "| " + " | ".join(cells) + " |"


def mkor_row(rank1_elements: int, world_size: int, dtype: torch.dtype) -> str:
    """MKOR: one all-reduce (average) of every layer's concatenated rank-1 vectors."""
    communicator = Communicator.simulated(0, world_size)
    communicator.all_reduce(torch.empty(rank1_elements, device="meta"), stage="factor_comm",
                            average=True, dtype=dtype)
    (entry,) = communicator.ledger.entries
    traffic = f"{entry.traffic_bytes / MB:,.2f}"
    return (f"| mkor ({str(dtype).removeprefix('torch.')} vectors) | {traffic} | 0 | 0 | "
            f"{traffic} | | | | | |")


def table(title: str, model: nn.Module, world_size: int, options: dict[str, object],
          mkor_dtype: torch.dtype, fraction: float) -> str:
    """The markdown table of one model (hybrid-opt with ``fraction`` of the workers)."""
    reports = {
        (f"hybrid-opt (f = {fraction:g})" if name == "hybrid-opt" else name):
        simulate(model, name, world_size, average_grads=False, **options,
                 **({"grad_worker_fraction": fraction} if name == "hybrid-opt" else {}))
        for name in STRATEGIES}
    totals = next(iter(reports.values())).totals()
    grad_allreduce = simulate(model, "d-kfac", world_size, ranks=[0]).per_worker(
        stage="grad_allreduce")[0]
    lines = [
        f"### {title}, P = {world_size}",
        "",
        f"{totals['layers']} K-FAC layers; factor elements Φ = {totals['factor_elements']:,}, "
        f"upper triangles {totals['triangle_elements']:,}, preconditioned parameters "
        f"Ψ = {totals['preconditioned_params']:,}, rank-1 vector elements "
        f"{totals['rank1_elements']:,}; largest layer {totals['largest_inversion_share']:.1%} "
        f"of the Σ(a³ + g³) inversion work. Common data-parallel gradient all-reduce (all "
        f"trainable parameters, not in the rows): {grad_allreduce / MB:,.1f} MB per worker.",
        "",
        "Traffic is MB per worker per second-order update, as the ledger counts it (received; "
        "sent for the reduce-scatter), mean / max over ranks; grad_comm recurs every step. "
        "Memory is the largest rank's MB (captured: batch factors built per update).",
        "",
        "| strategy | factor_comm | inverse_comm | grad_comm | total | factors | inverses "
        "| buffers | captured | memory total |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(name, report) for name, report in reports.items()]
    lines.append(mkor_row(int(totals["rank1_elements"]), world_size, mkor_dtype))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=_at_least_two, default=64)
    parser.add_argument("--grad-worker-fraction", type=float_in(0.0, 1.0, low_inclusive=False),
                        default=0.25, help="f of the hybrid-opt row (default 0.25): "
                        "max(1, world size × f) must divide the world size")
    parser.add_argument("--symmetry-aware", action="store_true",
                        help="send symmetric factors and inverses as upper triangles")
    parser.add_argument("--comm-dtype", choices=("float16", "bfloat16"), default=None,
                        help="wire dtype for factors and inverses (and MKOR's vectors)")
    parser.add_argument("--prediv-eigenvalues", action="store_true",
                        help="keep and send 1/(d_G d_Aᵀ + λ) instead of the eigenvalues "
                        "(KAISA's default)")
    args = parser.parse_args(argv)
    options: dict[str, object] = {"symmetry_aware": args.symmetry_aware,
                                  "comm_dtype": args.comm_dtype,
                                  "prediv_eigenvalues": args.prediv_eigenvalues}
    mkor_dtype = getattr(torch, args.comm_dtype or "float32")
    with exit_on_user_error(parser):  # an f that does not fit the world size
        for title, build in (("ResNet-50", resnet50), ("BERT-Large encoder", bert_large)):
            print(table(title, build(), args.world_size, options, mkor_dtype,
                        args.grad_worker_fraction))
            print()


def _at_least_two(text: str) -> int:
    """An argparse ``type``: a world size of two ranks or more (one communicates nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 2") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} is not >= 2 (one process communicates "
                                         "nothing)")
    return value


if __name__ == "__main__":
    main()
