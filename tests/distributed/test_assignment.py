"""Work assignment: deterministic, balanced per its cost model, within worker groups."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from core import ConfigError
from core.distributed.assignment import LayerWork, assign
from core.distributed.strategies import grad_workers


def _works(n: int, seed: int = 0) -> list[LayerWork]:
    rng = random.Random(seed)
    return [LayerWork(f"layer{i}", rng.randint(8, 600), rng.randint(8, 600)) for i in range(n)]


def _cost(w: LayerWork) -> float:
    return float(w.a_dim) ** 3 + float(w.g_dim) ** 3


@pytest.mark.parametrize("world_size", [3, 8])
def test_greedy_is_balanced_within_the_lpt_bound(world_size: int) -> None:
    works = _works(40)
    assignment = assign(works, world_size)
    loads = assignment.loads()
    by_hand = [0.0] * world_size
    for w, p in zip(works, assignment.placements, strict=True):
        assert p.a_rank == p.g_rank
        by_hand[p.a_rank] += _cost(w)
    assert loads == pytest.approx(by_hand)
    # Greedy by decreasing cost: no rank exceeds the mean by more than one item.
    assert max(loads) <= sum(loads) / world_size + max(map(_cost, works))
    assert assignment.imbalance() < 1.1


def test_greedy_is_within_four_thirds_of_the_optimum() -> None:
    works = _works(7, seed=3)
    costs = [_cost(w) for w in works]
    best = min(max(sum(c for c, r in zip(costs, ranks, strict=True) if r == k) for k in range(3))
               for ranks in itertools.product(range(3), repeat=len(works)))
    assert max(assign(works, 3).loads()) <= 4 / 3 * best


def test_assignment_is_a_pure_function_of_its_inputs() -> None:
    works = _works(30)
    first = assign(works, 8, colocate=False, groups=[(0, 4), (1, 5), (2, 6), (3, 7)])
    again = assign(list(works), 8, colocate=False, groups=[(0, 4), (1, 5), (2, 6), (3, 7)])
    assert first == again


def test_split_factors_stay_in_the_layer_group_and_beat_colocation() -> None:
    works = [LayerWork("big", 2049, 1000)] + _works(5)
    groups = [(0, 2), (1, 3)]
    split = assign(works, 4, colocate=False, groups=groups)
    for p in split.placements:
        assert p.group in groups and p.a_rank in p.group and p.g_rank in p.group
    assert split["big"].a_rank != split["big"].g_rank
    assert max(split.loads()) < max(assign(works, 4, groups=groups).loads())


def test_greedy_keeps_model_order_among_equal_costs() -> None:
    works = [LayerWork(f"layer{i}", 64, 64) for i in range(4)]
    assert [a for _, a, _ in assign(works, 2).as_rows()] == [0, 1, 0, 1]


def test_greedy_picks_the_group_with_the_least_total_load() -> None:
    """Four equal layers over two groups of two: one layer per rank (by the groups' largest
    member load instead, the second group fills one rank and leaves the other idle)."""
    works = [LayerWork(f"layer{i}", 3, 4) for i in range(4)]
    assignment = assign(works, 4, groups=[(0, 2), (1, 3)])
    assert assignment.loads() == [3.0**3 + 4.0**3] * 4


def test_greedy_places_a_layers_larger_factor_first() -> None:
    """Longest processing time first: each layer's 5×5 factor goes to the emptier rank, so
    the loads end 5³ + 4³ each (the smaller first ends one rank at 5³ + 5³)."""
    works = [LayerWork("x", 4, 5), LayerWork("y", 5, 4)]
    assignment = assign(works, 2, colocate=False, groups=[(0, 1)])
    assert assignment.loads() == [5.0**3 + 4.0**3] * 2


def test_round_robin_follows_model_order() -> None:
    works = _works(10)
    rows = assign(works, 4, policy="round-robin").as_rows()
    assert [(a, g) for _, a, g in rows] == [(i % 4, i % 4) for i in range(10)]
    split = assign(works, 4, policy="round-robin", colocate=False,
                   groups=[(0, 1, 2, 3)]).as_rows()
    assert [(a, g) for _, a, g in split][:3] == [(0, 1), (2, 3), (0, 1)]
    columns = assign(works[:4], 4, policy="round-robin", groups=[(0, 2), (1, 3)]).as_rows()
    assert [a for _, a, _ in columns] == [0, 1, 2, 3]  # turns within each group too


def test_contiguous_is_numpy_array_split() -> None:
    works = _works(10)
    rows = assign(works, 4, policy="contiguous").as_rows()
    chunks = np.array_split(np.arange(10), 4)
    assert [a for _, a, _ in rows] == [r for r, chunk in enumerate(chunks) for _ in chunk]


@pytest.mark.parametrize(("cost", "expected"), [
    ("inversion", 100.0**3 + 10.0**3),
    ("memory", 100.0**2 + 10.0**2),
    (lambda n: float(n), 110.0),
])
def test_cost_models(cost: object, expected: float) -> None:
    assignment = assign([LayerWork("x", 100, 10)], 2, cost=cost)  # type: ignore[arg-type]
    assert sum(assignment.loads()) == expected


def test_rejects_bad_policy_and_groups() -> None:
    with pytest.raises(ValueError, match="policy"):
        assign(_works(2), 2, policy="random")
    with pytest.raises(ValueError, match="partition"):
        assign(_works(2), 4, groups=[(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="partition"):  # every rank covered, one twice
        assign(_works(2), 3, groups=[(0, 1), (1, 2)])


def test_table_lists_every_layer_and_the_loads() -> None:
    table = assign(_works(3), 2).table()
    for name in ("layer0", "layer1", "layer2", "load per rank", "max/mean"):
        assert name in table


@pytest.mark.parametrize(("name", "fraction", "world_size", "workers"), [
    ("comm-opt", None, 8, 8), ("mem-opt", None, 8, 1), ("dp-kfac", None, 8, 1),
    ("hybrid-opt", 0.5, 8, 4), ("hybrid-opt", 0.25, 8, 2), ("hybrid-opt", 0.01, 8, 1),
])
def test_gradient_workers_are_max_1_p_f(name: str, fraction: float | None, world_size: int,
                                        workers: int) -> None:
    assert grad_workers(name, fraction, world_size) == workers


@pytest.mark.parametrize(("fraction", "world_size"), [(0.3, 4), (0.75, 4), (0.4, 10)])
def test_a_gradient_worker_count_that_does_not_divide_the_ranks_is_refused(
        fraction: float, world_size: int) -> None:
    """1.2 workers is not a count; 3 of 4 ranks, or 4 of 10, do not split the ranks into
    equal groups."""
    with pytest.raises(ConfigError, match="grad_worker_fraction"):
        grad_workers("hybrid-opt", fraction, world_size)
