"""Draw the distribution-strategy diagrams of the docs' concepts pages.

One PNG per strategy, ``docs/concepts/img/strategy-<name>.png``: four ranks (rows) and four layers
(coloured squares; layer ``i`` is owned by rank ``i``), and for each of the three phases of a
second-order update (factors, inversion, preconditioning) which rank does what for which layer,
with the collective that runs between phases. The placements follow KFAC_MATH.md
("Distribution") and, for ``hybrid-opt``, KAISA's grid as ``core.distributed`` builds it: with
``f = 1/2`` the columns are ranks {0, 2} and {1, 3}, the rows {0, 1} and {2, 3}.

Usage: ``python -m scripts.make_concept_figures [--out DIR]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

RANKS = 4
LAYERS = 4
PHASES = ("builds factors", "inverts", "preconditions")
LAYER_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "img"

#: Whether ``rank`` does a phase's work for ``layer``.
Who = Callable[[int, int], bool]


def everyone(rank: int, layer: int) -> bool:
    """Every rank works on every layer."""
    return True


def owner(rank: int, layer: int) -> bool:
    """Only the layer's owner (rank ``layer``) works on it."""
    return rank == layer


def owner_column(rank: int, layer: int) -> bool:
    """The ranks of the owner's KAISA column (``f = 1/2`` on four ranks: {0, 2} and {1, 3})."""
    return rank % 2 == layer % 2


@dataclass(frozen=True)
class StrategyDiagram:
    """One strategy: who works in each phase and what travels between phases.

    Attributes:
        name: The strategy's name (``strategy=`` value, or ``mkor``).
        title: The heading drawn above the diagram.
        who: For each of :data:`PHASES`, which ranks work on which layers.
        moves: The collectives after each phase: after factors, after inversion, after
            preconditioning ("" when nothing travels).
    """

    name: str
    title: str
    who: tuple[Who, Who, Who]
    moves: tuple[str, str, str]


DIAGRAMS = (
    StrategyDiagram("d-kfac", "d-kfac (D-KFAC)", (everyone, everyone, everyone),
                    ("all-reduce A, G", "", "")),
    StrategyDiagram("comm-opt", "comm-opt (KAISA, f = 1)", (everyone, owner, everyone),
                    ("all-reduce A, G", "broadcast inverses\nto every rank", "")),
    StrategyDiagram("hybrid-opt", "hybrid-opt (KAISA, f = 1/2)", (everyone, owner, owner_column),
                    ("all-reduce A, G", "broadcast inverses\nwithin the column",
                     "broadcast P\nwithin each row")),
    StrategyDiagram("mem-opt", "mem-opt (KAISA, f = 1/P; MPD-KFAC)", (everyone, owner, owner),
                    ("all-reduce A, G", "", "broadcast P\nfrom the owner")),
    StrategyDiagram("osawa", "osawa (Osawa et al.)", (everyone, owner, owner),
                    ("reduce-scatter A, G\nto the owners", "", "all-gather P")),
    StrategyDiagram("dp-kfac", "dp-kfac (DP-KFAC)", (owner, owner, owner),
                    ("", "", "broadcast P\nfrom the owner")),
    StrategyDiagram("mkor", "mkor (MKOR, rank-1 factors)", (everyone, everyone, everyone),
                    ("all-reduce ā, ḡ\n(vectors)", "", "")),
)


def draw(diagram: StrategyDiagram, path: Path) -> None:
    """Draw one strategy's diagram into ``path`` (PNG).

    Args:
        diagram: The strategy to draw.
        path: The PNG to write.
    """
    cell_w, gap, square = 2.2, 1.8, 0.38
    fig, ax = plt.subplots(figsize=(9.2, 3.3), dpi=110)
    for phase, (label, who) in enumerate(zip(PHASES, diagram.who, strict=True)):
        x0 = phase * (cell_w + gap)
        ax.text(x0 + cell_w / 2, RANKS + 0.35, label, ha="center", va="bottom", fontsize=10,
                fontweight="bold")
        for rank in range(RANKS):
            y = RANKS - 1 - rank
            ax.add_patch(Rectangle((x0, y + 0.08), cell_w, 0.84, facecolor="#f4f4f4",
                                   edgecolor="#999999", linewidth=0.8))
            for layer in range(LAYERS):
                works = who(rank, layer)
                ax.add_patch(Rectangle((x0 + 0.2 + layer * 0.5, y + 0.31), square, square,
                                       facecolor=LAYER_COLOURS[layer] if works else "white",
                                       edgecolor=LAYER_COLOURS[layer], linewidth=1.2))
        move = diagram.moves[phase]
        if phase < len(PHASES) - 1 or move:
            start = x0 + cell_w + 0.1
            ax.add_patch(FancyArrowPatch((start, RANKS / 2), (start + gap - 0.2, RANKS / 2),
                                         arrowstyle="-|>", mutation_scale=14,
                                         color="#333333" if move else "#bbbbbb"))
            ax.text(start + (gap - 0.2) / 2, RANKS / 2 + 0.15, move or "nothing moves",
                    ha="center", va="bottom", fontsize=8,
                    color="#000000" if move else "#888888")
    for rank in range(RANKS):
        ax.text(-0.15, RANKS - 1 - rank + 0.5, f"rank {rank}", ha="right", va="center",
                fontsize=9)
    ax.set_title(diagram.title, fontsize=11, loc="left")
    ax.set_xlim(-1.1, 3 * cell_w + 3 * gap)
    ax.set_ylim(-0.35, RANKS + 0.9)
    ax.axis("off")
    ax.text(-1.1, -0.3, "squares: layers 0–3 (layer i owned by rank i); filled: this rank does "
            "the phase for that layer", fontsize=7.5, color="#555555")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Write every strategy diagram.

    Args:
        argv: Command-line arguments (``--out DIR``); ``sys.argv`` when None.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for diagram in DIAGRAMS:
        draw(diagram, out / f"strategy-{diagram.name}.png")


if __name__ == "__main__":
    main()
