"""Paper-scale communication ledger and memory report, for any world size, in one process.

:func:`simulate` builds, for each simulated rank, the real strategy on a communicator whose
transport moves nothing, and drives the strategy's communication methods in the order the
preconditioner calls them, with ``meta``-device tensors of the right shapes standing in for
factors, decompositions and gradients (no forward pass, no memory). What the ledger records is
therefore what the same strategy, bucketing and packing code records in a real run (a test
checks the two agree at P = 4). The compute stages are stand-ins: every decomposition is taken
to succeed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import mean
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from core.config import KFACConfig, update_due
from core.distributed.assignment import LayerWork
from core.distributed.communicator import Communicator, average_gradients
from core.distributed.ledger import Ledger
from core.distributed.strategies import make_strategy
from core.kfac_layer import KFACLayer
from core.preconditioner import build_layers, memory_report
from core.strategy import Strategy

META = torch.device("meta")


@dataclass
class RankReport:
    """What one simulated rank moved and holds.

    Attributes:
        rank: The rank.
        ledger: Its collectives.
        memory: :func:`~core.preconditioner.memory_report` after the simulated steps.
        captured_bytes: Batch factors it builds per factor update (transient).
        captured: Layers whose batch factors it builds.
        inverted: ``(layer, side)`` of each factor it decomposes or inverts.
        preconditioned: Layers whose preconditioned gradient it computes (last step).
    """

    rank: int
    ledger: Ledger
    memory: dict[str, int]
    captured_bytes: int
    captured: tuple[str, ...] = ()
    inverted: tuple[tuple[str, str], ...] = ()
    preconditioned: tuple[str, ...] = ()


@dataclass
class SimulationReport:
    """Per-rank ledgers and memory of one strategy at one world size.

    Attributes:
        strategy: Strategy name.
        world_size: Simulated number of ranks.
        layers: The preconditioned layers and their factor dimensions.
        ranks: One :class:`RankReport` per simulated rank.
        placement: The strategy's placement table.
    """

    strategy: str
    world_size: int
    layers: list[LayerWork]
    ranks: list[RankReport]
    placement: str

    def per_worker(self, *, stage: str | None = None, step: int | None = None,
                   op: str | None = None, field: str = "traffic_bytes") -> list[int]:
        """Per rank, the sum of ledger ``field`` over the entries matching the filters."""
        return [sum(getattr(e, field) for e in r.ledger.select(step=step, stage=stage, op=op))
                for r in self.ranks]

    def memory(self, key: str = "total") -> list[int]:
        """Per rank, one memory figure (``factors``, ``inverses``, ``buffers``, ``total``,
        or ``captured`` for the transient batch factors)."""
        if key == "captured":
            return [r.captured_bytes for r in self.ranks]
        return [r.memory[key] for r in self.ranks]

    def totals(self) -> dict[str, float]:
        """Shape facts of the preconditioned layers (PAPERS.md §6 notation).

        ``factor_elements`` Φ = Σ(a² + g²), ``triangle_elements`` Σ(a(a+1)/2 + g(g+1)/2),
        ``preconditioned_params`` Ψ = Σ a·g, ``rank1_elements`` Σ(a + g) (MKOR's vectors),
        ``inversion_work`` Σ(a³ + g³) and ``largest_inversion_share`` (one layer's part of it).
        """
        work = [float(w.a_dim) ** 3 + float(w.g_dim) ** 3 for w in self.layers]
        return {
            "layers": len(self.layers),
            "factor_elements": sum(w.a_dim**2 + w.g_dim**2 for w in self.layers),
            "triangle_elements": sum(w.a_dim * (w.a_dim + 1) // 2 + w.g_dim * (w.g_dim + 1) // 2
                                     for w in self.layers),
            "preconditioned_params": sum(w.a_dim * w.g_dim for w in self.layers),
            "rank1_elements": sum(w.a_dim + w.g_dim for w in self.layers),
            "inversion_work": sum(work),
            "largest_inversion_share": max(work) / sum(work),
        }

    def stages(self) -> list[str]:
        """Stages that appear in any rank's ledger, sorted."""
        return sorted({e.stage for r in self.ranks for e in r.ledger.entries})

    def table(self, *, step: int | None = None) -> str:
        """Per-worker traffic per stage and memory per kind, as max and mean over ranks (MB)."""
        lines = [f"{self.strategy}, P = {self.world_size}"
                 + ("" if step is None else f", step {step}"),
                 f"  {'per worker (MB)':<26}{'max':>12}{'mean':>12}"]
        for stage in self.stages():
            values = self.per_worker(stage=stage, step=step)
            lines.append(f"  traffic {stage:<18}{max(values) / 1e6:>12.1f}"
                         f"{mean(values) / 1e6:>12.1f}")
        for key in ("factors", "inverses", "buffers", "total", "captured"):
            values = self.memory(key)
            lines.append(f"  memory {key:<19}{max(values) / 1e6:>12.1f}{mean(values) / 1e6:>12.1f}")
        return "\n".join(lines)


def _on_meta(model: nn.Module) -> nn.Module:
    """``model`` itself if it already lives on ``meta``, else a ``meta`` copy."""
    if all(p.device == META for p in model.parameters()):
        return model
    return copy.deepcopy(model).to(META)


def _stage_factors(strategy: Strategy, layers: list[KFACLayer], dtype: torch.dtype) -> int:
    """Stand-in batch factors where the strategy captures; returns their bytes."""
    captured = 0
    for layer in layers:
        if strategy.captures(layer):
            layer.batch_a = torch.empty(layer.a_dim, layer.a_dim, dtype=dtype, device=META)
            layer.batch_g = torch.empty(layer.g_dim, layer.g_dim, dtype=dtype, device=META)
            captured += (layer.a_dim**2 + layer.g_dim**2) * layer.batch_a.element_size()
    return captured


def _keep_factors(layers: list[KFACLayer]) -> None:
    """Stand-in for the running-average update: keep whatever batch factors remain."""
    for layer in layers:
        if layer.batch_a is not None and layer.batch_g is not None:
            layer.a.update(layer.batch_a, 0.0)
            layer.g.update(layer.batch_g, 0.0)
        layer.batch_a = layer.batch_g = None


def _invert(strategy: Strategy, layers: list[KFACLayer], method: str,
            dtype: torch.dtype) -> None:
    """Stand-in inversion: the strategy's sides become (empty) good decompositions."""
    for layer in layers:
        sides = strategy.inverse_sides(layer)
        if sides and layer.has_factors:
            if layer.state is None:
                layer.state = layer.empty_state(method, dtype, META)
            layer.valid_sides.update(sides)


def _simulate_rank(model: nn.Module, config: KFACConfig, rank: int, world_size: int,
                   steps: int, average_grads: bool) -> tuple[RankReport, Strategy, list[KFACLayer]]:
    communicator = Communicator.simulated(rank, world_size, bucket_cap_mb=config.bucket_cap_mb)
    strategy = make_strategy(config, communicator)
    layers = build_layers(model, config, lambda: 1.0)
    factor_dtype = getattr(torch, config.factor_dtype)
    inverse_dtype = getattr(torch, config.inverse_dtype)
    strategy.setup(layers, method=config.state_method, dtype=inverse_dtype)
    grads = [SimpleNamespace(grad=torch.empty_like(p)) for p in model.parameters()
             if p.requires_grad]
    captured = 0
    computed: tuple[str, ...] = ()
    for step in range(steps):
        strategy.set_step(step)
        if average_grads:
            average_gradients(grads, communicator)
        inverting = update_due("inv_update_steps", config.inv_update_steps, step)
        finish_factors = None  # the preconditioner's order: see KFACPreconditioner.step
        if update_due("factor_update_steps", config.factor_update_steps, step):
            captured = _stage_factors(strategy, layers, factor_dtype)
            reduction = strategy.factor_reduction()
            for layer in layers:
                reduction.add(layer)
            finish_factors = reduction.finish()
            if inverting:
                finish_factors()
                finish_factors = None
                _keep_factors(layers)
        if inverting:
            _invert(strategy, layers, config.state_method, config.state_dtype)
            strategy.communicate_inverses(layers)
        preconditioned = {
            layer.name: torch.empty(layer.g_dim, layer.a_dim, dtype=inverse_dtype, device=META)
            for layer in layers if strategy.preconditions(layer) and layer.has_state
        }
        computed = tuple(preconditioned)
        strategy.communicate_gradients(layers, preconditioned)
        if finish_factors is not None:
            finish_factors()
            _keep_factors(layers)
    report = RankReport(
        rank, communicator.ledger, memory_report(layers, strategy), captured,
        captured=tuple(layer.name for layer in layers if strategy.captures(layer)),
        inverted=tuple((layer.name, side) for layer in layers
                       for side in strategy.inverse_sides(layer)),
        preconditioned=computed)
    return report, strategy, layers


def simulate(model: nn.Module, strategy: str = "comm-opt", world_size: int = 64, *,
             steps: int = 1, ranks: Iterable[int] | None = None, average_grads: bool = True,
             **options: Any) -> SimulationReport:
    """The ledger and memory of ``strategy`` over ``world_size`` ranks, simulated in-process.

    Args:
        model: The model (build it under ``torch.device("meta")`` at paper scale; a model on
            another device is copied to ``meta``).
        strategy: Strategy name (see KFAC_MATH.md).
        world_size: Number of simulated ranks ``P``.
        steps: Steps to simulate, from step 0, following ``factor_update_steps`` and
            ``inv_update_steps`` (step 0 is a full second-order update).
        ranks: Ranks to simulate (all by default).
        average_grads: Also record the data-parallel gradient all-reduce of every trainable
            parameter (stage ``grad_allreduce``), as ``average_gradients`` does without DDP.
        **options: Further :class:`~core.config.KFACConfig` fields (e.g. ``symmetry_aware``,
            ``comm_dtype``, ``grad_worker_fraction``, ``assignment``, ``inverse_method``).

    Returns:
        A :class:`SimulationReport`.
    """
    config = KFACConfig(strategy=strategy, **options)
    model = _on_meta(model)
    selected = list(range(world_size) if ranks is None else ranks)
    if not selected:
        raise ValueError("simulate needs at least one rank")
    reports: list[RankReport] = []
    for rank in selected:
        report, strat, layers = _simulate_rank(model, config, rank, world_size, steps,
                                               average_grads)
        reports.append(report)
    works = [LayerWork(layer.name, layer.a_dim, layer.g_dim) for layer in layers]
    return SimulationReport(config.canonical_strategy, world_size, works, reports,
                            strat.describe())
