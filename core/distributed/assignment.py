"""Which rank inverts which factor: deterministic, cost-modelled work assignment.

Every rank computes the same assignment from the same inputs (layer names and factor dimensions
in model order, the world size, the worker groups) with no communication, so the result is
identical everywhere by construction. Three policies:

* ``greedy`` (KAISA): layers by decreasing cost; each goes to the least-loaded worker group and,
  inside it, to the least-loaded rank (both factors together, or each factor separately when
  factors are not colocated). Ties go to the lowest index, and equal costs keep model order.
* ``round-robin`` (DP-KFAC / MPD-KFAC code): layer ``i`` to group ``i mod G``, then to the
  group's members in turn.
* ``contiguous`` (after Osawa et al.'s code, ``np.array_split``): model order cut into
  equal-count chunks, one per group and then per member. chainerkfac cuts its Fisher blocks
  sorted by link name, BatchNorm blocks included, so at fewer workers than layers its chunks
  hold other layers than these.

The cost of a factor of dimension ``n`` is ``n³`` (``"inversion"``), ``n²`` (``"memory"``) or any
callable of ``n``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.inverse import SIDES

CostModel = str | Callable[[int], float]

COST_MODELS: dict[str, Callable[[int], float]] = {
    "inversion": lambda n: float(n) ** 3,
    "memory": lambda n: float(n) ** 2,
}


def cost_function(model: CostModel) -> Callable[[int], float]:
    """The per-factor cost function for a cost-model name or callable."""
    if callable(model):
        return model
    try:
        return COST_MODELS[model]
    except KeyError:
        raise ValueError(f"unknown cost model {model!r}; expected one of "
                         f"{sorted(COST_MODELS)} or a callable of the factor dimension") from None


@dataclass(frozen=True)
class LayerWork:
    """A layer to place: its name and factor dimensions."""

    name: str
    a_dim: int
    g_dim: int


@dataclass(frozen=True)
class Placement:
    """Where one layer's work goes.

    Attributes:
        layer: The layer's name.
        a_dim: Dimension of ``A``.
        g_dim: Dimension of ``G``.
        a_rank: Rank that inverts ``A``.
        g_rank: Rank that inverts ``G``.
        group: The worker group holding both ranks (KAISA's gradient-worker column).
        a_cost: Cost of ``A`` under the cost model.
        g_cost: Cost of ``G`` under the cost model.
    """

    layer: str
    a_dim: int
    g_dim: int
    a_rank: int
    g_rank: int
    group: tuple[int, ...]
    a_cost: float
    g_cost: float

    def rank_of(self, side: str) -> int:
        """The rank inverting factor ``side`` (``"a"`` or ``"g"``)."""
        return self.a_rank if side == "a" else self.g_rank

    @property
    def owner(self) -> int:
        """The single rank holding both factors (colocated placements only)."""
        if self.a_rank != self.g_rank:
            raise ValueError(f"{self.layer}: factors are split across ranks "
                             f"{self.a_rank} and {self.g_rank}; there is no single owner")
        return self.a_rank


@dataclass(frozen=True)
class Assignment:
    """The placement of every layer, in model order, and the per-rank loads it implies."""

    world_size: int
    policy: str
    placements: tuple[Placement, ...]

    def __getitem__(self, layer: str) -> Placement:
        for placement in self.placements:
            if placement.layer == layer:
                return placement
        raise KeyError(layer)

    def loads(self) -> list[float]:
        """Cost assigned to each rank."""
        loads = [0.0] * self.world_size
        for p in self.placements:
            loads[p.a_rank] += p.a_cost
            loads[p.g_rank] += p.g_cost
        return loads

    def imbalance(self) -> float:
        """Max over mean rank load (1.0 is perfect balance)."""
        loads = self.loads()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def as_rows(self) -> list[tuple[str, int, int]]:
        """``(layer, a_rank, g_rank)`` per layer: what must agree across ranks."""
        return [(p.layer, p.a_rank, p.g_rank) for p in self.placements]

    def table(self) -> str:
        """A printable placement table with the per-rank loads."""
        width = max([len(p.layer) for p in self.placements] + [5])
        lines = [f"{'layer':<{width}} {'A dim':>7} {'G dim':>7} {'cost A':>10} {'cost G':>10} "
                 f"{'A rank':>6} {'G rank':>6}  workers"]
        for p in self.placements:
            lines.append(f"{p.layer:<{width}} {p.a_dim:>7} {p.g_dim:>7} {p.a_cost:>10.3g} "
                         f"{p.g_cost:>10.3g} {p.a_rank:>6} {p.g_rank:>6}  {list(p.group)}")
        loads = self.loads()
        lines.append("load per rank: " + ", ".join(f"{r}: {x:.3g}" for r, x in enumerate(loads)))
        lines.append(f"policy {self.policy}; max/mean load {self.imbalance():.3f}")
        return "\n".join(lines)


def _least_loaded(ranks: Sequence[int], loads: Sequence[float]) -> int:
    """The rank of ``ranks`` with the smallest load (the first one on ties)."""
    return min(ranks, key=lambda r: loads[r])


def _greedy(works: Sequence[LayerWork], costs: list[tuple[float, float]],
            groups: Sequence[tuple[int, ...]], world_size: int, colocate: bool
            ) -> list[tuple[int, int, int]]:
    loads = [0.0] * world_size
    out: list[tuple[int, int, int]] = [(-1, -1, -1)] * len(works)
    order = sorted(range(len(works)), key=lambda i: -(costs[i][0] + costs[i][1]))
    for i in order:
        g = min(range(len(groups)), key=lambda k: sum(loads[r] for r in groups[k]))
        cost_a, cost_g = costs[i]
        if colocate:
            rank = _least_loaded(groups[g], loads)
            loads[rank] += cost_a + cost_g
            out[i] = (g, rank, rank)
            continue
        ranks = {}
        for side, cost in sorted(zip(SIDES, (cost_a, cost_g), strict=True),
                                 key=lambda item: (-item[1], item[0])):
            ranks[side] = _least_loaded(groups[g], loads)
            loads[ranks[side]] += cost
        out[i] = (g, ranks["a"], ranks["g"])
    return out


def _round_robin(n_layers: int, groups: Sequence[tuple[int, ...]], colocate: bool
                 ) -> list[tuple[int, int, int]]:
    out = []
    for i in range(n_layers):
        g = i % len(groups)
        members, turn = groups[g], i // len(groups)
        if colocate:
            rank = members[turn % len(members)]
            out.append((g, rank, rank))
        else:
            out.append((g, members[(2 * turn) % len(members)],
                        members[(2 * turn + 1) % len(members)]))
    return out


def _split_evenly(n: int, parts: int) -> list[range]:
    """``np.array_split`` of ``range(n)`` into ``parts`` contiguous chunks."""
    size, extra = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + size + (1 if k < extra else 0))
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


def _contiguous(n_layers: int, groups: Sequence[tuple[int, ...]], colocate: bool
                ) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = [(-1, -1, -1)] * n_layers
    for g, chunk in enumerate(_split_evenly(n_layers, len(groups))):
        members = groups[g]
        slots = [(i, side) for i in chunk for side in (("ag",) if colocate else SIDES)]
        ranks: dict[tuple[int, str], int] = {}
        for m, part in enumerate(_split_evenly(len(slots), len(members))):
            for k in part:
                ranks[slots[k]] = members[m]
        for i in chunk:
            if colocate:
                out[i] = (g, ranks[(i, "ag")], ranks[(i, "ag")])
            else:
                out[i] = (g, ranks[(i, "a")], ranks[(i, "g")])
    return out


POLICIES = ("greedy", "round-robin", "contiguous")


def assign(
    works: Sequence[LayerWork],
    world_size: int,
    *,
    policy: str = "greedy",
    cost: CostModel = "inversion",
    colocate: bool = True,
    groups: Sequence[tuple[int, ...]] | None = None,
) -> Assignment:
    """Place every layer's two factor inversions on ranks.

    Args:
        works: Layers in model order.
        world_size: Number of ranks.
        policy: ``"greedy"``, ``"round-robin"`` or ``"contiguous"``.
        cost: Cost model: ``"inversion"`` (``n³``), ``"memory"`` (``n²``) or a callable.
        colocate: Keep a layer's ``A`` and ``G`` on the same rank.
        groups: Worker groups that must hold all of a layer's work (KAISA's columns); by
            default every rank is its own group.

    Returns:
        The :class:`Assignment`, identical on every rank for identical inputs.
    """
    if groups is None:
        groups = [(r,) for r in range(world_size)]
    groups = [tuple(g) for g in groups]
    if sorted(r for g in groups for r in g) != list(range(world_size)):
        raise ValueError(f"worker groups {groups} do not partition ranks 0..{world_size - 1}")
    fn = cost_function(cost)
    costs = [(fn(w.a_dim), fn(w.g_dim)) for w in works]
    if policy == "greedy":
        rows = _greedy(works, costs, groups, world_size, colocate)
    elif policy == "round-robin":
        rows = _round_robin(len(works), groups, colocate)
    elif policy == "contiguous":
        rows = _contiguous(len(works), groups, colocate)
    else:
        raise ValueError(f"unknown assignment policy {policy!r}; expected one of {POLICIES}")
    placements = tuple(
        Placement(w.name, w.a_dim, w.g_dim, a_rank, g_rank, groups[g], cost_a, cost_g)
        for w, (cost_a, cost_g), (g, a_rank, g_rank) in zip(works, costs, rows, strict=True)
    )
    return Assignment(world_size, policy, placements)
