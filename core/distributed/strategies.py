"""The distribution strategies of KFAC_MATH.md ("Distribution") over a :class:`Communicator`.

=============  ======================  ==============  ======================================
strategy       factors                 inversion       after inversion
=============  ======================  ==============  ======================================
``d-kfac``     all-reduce              every rank      nothing
``comm-opt``   all-reduce              owner           state broadcast to every rank
``hybrid-opt`` all-reduce              owner           state within the column, ``P`` in rows
``mem-opt``    all-reduce              owner           ``P`` broadcast from the owner
``osawa``      reduce-scatter to owner owner           all-gather of ``P``
``dp-kfac``    none (owner's batch)    owner           ``P`` broadcast from the owner
=============  ======================  ==============  ======================================

KAISA's three modes are one class: ranks form a grid of ``P·f`` rows by ``1/f`` columns; a
layer's inverse workers sit in one column, which receives its state and preconditions it, and
each row receives ``P`` from its member of that column (``f = 1``: comm-opt, ``f = 1/P``:
mem-opt). DP-KFAC is mem-opt without factor communication, capturing only on the owner.

Consistency rule: whether an owner holds a usable decomposition is data-dependent (first steps,
failed decompositions), and so is the dtype ``precondition_dtype_tolerance`` keeps a factor in;
so after each inversion the owners share one code per factor in a tiny MAX all-reduce (stage
``inverse_comm``); every later decision about what moves, and in which dtype, depends only on
those codes, the assignment and the shapes, which all ranks share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from core.config import ConfigError, KFACConfig
from core.distributed.assignment import Assignment, LayerWork, Placement, assign
from core.distributed.communicator import AllReduceStream, Communicator
from core.inverse import SIDES
from core.kfac_layer import KFACLayer
from core.strategy import FactorReduction, Strategy, nothing_to_wait


class _StreamedFactorReduction(FactorReduction):
    """Each layer's staged factors go into an :class:`AllReduceStream` as they come."""

    def __init__(self, stream: AllReduceStream, *, pack: bool) -> None:
        super().__init__()
        self._stream = stream
        self._pack = pack

    def add(self, layer: KFACLayer) -> None:
        for factor in layer.batch_factors_for_reduction():
            self._stream.add(factor, pack=self._pack)

    def finish(self) -> Callable[[], None]:
        return self._stream.finish().wait


class DistributedStrategy(Strategy):
    """What every distributed strategy shares: communicator, assignment, readiness flags.

    Args:
        config: The preconditioner configuration (assignment, wire options).
        communicator: The communicator of this rank.
    """

    communicates_factors = True

    def __init__(self, config: KFACConfig, communicator: Communicator) -> None:
        super().__init__()
        self.config = config
        self.communicator = communicator
        self.rank = communicator.rank
        self.world_size = communicator.world_size
        self.wire_dtype = getattr(torch, config.comm_dtype) if config.comm_dtype else None
        self.pack = config.symmetry_aware
        self.assignment: Assignment | None = None
        self.ready: dict[str, bool] = {}
        self.method = "eigen"
        self.dtype = torch.float32
        self._received_bytes = 0

    # Set-up and bookkeeping --------------------------------------------------------------------
    @property
    def factor_ranks(self) -> int:
        return self.world_size

    def worker_groups(self) -> list[tuple[int, ...]]:
        """Groups that hold all of one layer's work (every rank alone by default)."""
        return [(r,) for r in range(self.world_size)]

    def communication_groups(self) -> list[tuple[int, ...]]:
        """Sub-groups this strategy's collectives use (created on every rank at set-up)."""
        return []

    def setup(self, layers: list[KFACLayer], *, method: str, dtype: torch.dtype) -> None:
        self.method, self.dtype = method, dtype
        works = [LayerWork(layer.name, layer.a_dim, layer.g_dim) for layer in layers]
        self.assignment = assign(works, self.world_size, policy=self.config.assignment,
                                 cost=self.config.assignment_cost,
                                 colocate=self.config.colocate_factors,
                                 groups=self.worker_groups())
        self.ready = {layer.name: False for layer in layers}
        self.communicator.register_groups(self.communication_groups())

    def set_step(self, step: int) -> None:
        self.communicator.ledger.step = step

    def placement(self, layer: KFACLayer) -> Placement:
        """Where ``layer``'s work goes."""
        assert self.assignment is not None, "setup() has not run"
        return self.assignment[layer.name]

    def owner(self, layer: KFACLayer) -> int:
        """The rank holding both of ``layer``'s factors (owner strategies)."""
        return self.placement(layer).owner

    def inverse_sides(self, layer: KFACLayer) -> tuple[str, ...]:
        placement = self.placement(layer)
        return tuple(side for side in SIDES if placement.rank_of(side) == self.rank)

    def buffer_bytes(self) -> int:
        """Peak bucket buffers plus the preconditioned-gradient receive buffers of a step."""
        return self.communicator.peak_buffer_bytes + self._received_bytes

    def describe(self) -> str:
        assert self.assignment is not None
        return f"{self.name} over {self.world_size} ranks\n{self.assignment.table()}"

    def state_signature(self) -> dict[str, object]:
        signature = super().state_signature()
        signature["rank"] = self.rank
        if self.assignment is not None:
            signature["placements"] = self.assignment.as_rows()
        return signature

    def state_dict(self) -> dict[str, Any]:
        """Which layers are ready, and the buffer bytes :meth:`buffer_bytes` reports (a
        resumed run reports the run's peak, not that of the steps since it resumed)."""
        return {"ready": sorted(name for name, ok in self.ready.items() if ok),
                "peak_buffer_bytes": self.communicator.peak_buffer_bytes,
                "received_bytes": self._received_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ready = set(state["ready"])
        self.ready = {name: name in ready for name in self.ready}
        self.communicator.peak_buffer_bytes = max(self.communicator.peak_buffer_bytes,
                                                  int(state.get("peak_buffer_bytes", 0)))
        self._received_bytes = int(state.get("received_bytes", 0))

    # Shared communication ----------------------------------------------------------------------
    def factor_reduction(self) -> FactorReduction:
        """Averaging every staged batch factor over all ranks (packed / wire dtype per
        config), each bucket started as soon as it is full: what every strategy but
        ``osawa`` and ``dp-kfac`` does with factors."""
        return _StreamedFactorReduction(self.communicator.stream_all_reduce(
            stage="factor_comm", average=True, dtype=self.wire_dtype), pack=self.pack)

    def _sync_ready(self, layers: list[KFACLayer]) -> dict[str, tuple[torch.dtype, ...]]:
        """Share, per factor, whether its inverting rank holds a good decomposition, and in
        which dtype it keeps it (``precondition_dtype_tolerance`` may keep a factor wider).

        Each inverting rank contributes its own factors' codes (0: kept in the state dtype,
        1: kept in the inverse dtype, 2: no good state) and 0 elsewhere; the MAX all-reduce
        gives every rank the owners' codes.

        Returns:
            Per layer, the dtype each side's state is kept in (``SIDES`` order).
        """
        wide, narrow = self.dtype, self.config.state_dtype
        codes = torch.zeros(len(layers), len(SIDES), dtype=torch.uint8)
        for i, layer in enumerate(layers):
            placement = self.placement(layer)
            for j, side in enumerate(SIDES):
                if placement.rank_of(side) == self.rank:
                    state = layer.state
                    codes[i, j] = (2 if state is None or side not in layer.valid_sides
                                   else 0 if state.side_dtype(side) == narrow else 1)
        codes = codes.to(self.communicator.device)
        self.communicator.all_reduce(codes, stage="inverse_comm", op="max")
        dtypes = {}
        for layer, row in zip(layers, codes.cpu().tolist(), strict=True):
            self.ready[layer.name] = 2 not in row
            dtypes[layer.name] = tuple(wide if code == 1 else narrow for code in row)
        return dtypes

    def _receive_buffers(self, layers: list[KFACLayer], grads: dict[str, Tensor]) -> None:
        """Put fresh tensors for ``layers``' preconditioned gradients into ``grads``, counted in
        the buffers: views of one allocation, back to back in order, which a collective
        receives into directly (without a flat copy of its own)."""
        if not layers:
            return
        sizes = [layer.g_dim * layer.a_dim for layer in layers]
        flat = torch.empty(sum(sizes), dtype=self.dtype, device=layers[0].device)
        self._received_bytes += flat.numel() * flat.element_size()
        for layer, part in zip(layers, flat.split(sizes), strict=True):
            grads[layer.name] = part.view(layer.g_dim, layer.a_dim)


class DKFACStrategy(DistributedStrategy):
    """D-KFAC: factors all-reduced; every rank inverts and preconditions every layer."""

    name = "d-kfac"

    def inverse_sides(self, layer: KFACLayer) -> tuple[str, ...]:
        return SIDES

    def describe(self) -> str:
        return f"d-kfac over {self.world_size} ranks: every rank inverts every layer"


def grad_workers(name: str, fraction: float | None, world_size: int) -> int:
    """KAISA's gradient-worker count ``max(1, P·f)`` (f = 1 for comm-opt, 1/P for mem-opt
    and dp-kfac).

    Raises:
        ConfigError: if ``P·f`` is not an integer dividing ``P``.
    """
    fraction = {"comm-opt": 1.0, "mem-opt": 1.0 / world_size,
                "dp-kfac": 1.0 / world_size}.get(name, fraction)
    assert fraction is not None, "hybrid-opt needs grad_worker_fraction (checked by KFACConfig)"
    workers = max(1.0, world_size * fraction)
    if abs(workers - round(workers)) > 1e-9 or world_size % round(workers):
        raise ConfigError("grad_worker_fraction", fraction,
                          f"f with max(1, {world_size}·f) an integer dividing {world_size}")
    return round(workers)


class KAISAStrategy(DistributedStrategy):
    """KAISA's grid: ``comm-opt`` (f = 1), ``hybrid-opt`` (1/P < f < 1), ``mem-opt`` (f = 1/P).

    Args:
        config: The preconditioner configuration.
        communicator: The communicator of this rank.
        name: ``"comm-opt"``, ``"hybrid-opt"`` (f from the config), ``"mem-opt"`` or
            ``"dp-kfac"`` (its subclass).
    """

    def __init__(self, config: KFACConfig, communicator: Communicator, *, name: str) -> None:
        super().__init__(config, communicator)
        self.name = name
        p = self.world_size
        self.grad_workers = workers = grad_workers(name, config.grad_worker_fraction, p)
        n_columns = p // workers
        self.columns = [tuple(range(c, p, n_columns)) for c in range(n_columns)]
        self.rows = [tuple(range(r * n_columns, (r + 1) * n_columns)) for r in range(workers)]
        self.row = self.rows[self.rank // n_columns]

    @property
    def moves_gradients(self) -> bool:
        return len(self.row) > 1

    def worker_groups(self) -> list[tuple[int, ...]]:
        return self.columns

    def communication_groups(self) -> list[tuple[int, ...]]:
        return self.columns + self.rows

    def state_signature(self) -> dict[str, object]:
        return super().state_signature() | {"grad_workers": self.grad_workers}

    def preconditions(self, layer: KFACLayer) -> bool:
        return self.ready[layer.name] and self.rank in self.placement(layer).group

    def communicate_inverses(self, layers: list[KFACLayer]) -> None:
        """Share the readiness flags; then, within each column, broadcast every ready layer's
        state from its inverting ranks (one bucketed broadcast per source rank)."""
        dtypes = self._sync_ready(layers)
        if self.grad_workers == 1:
            return
        outgoing: dict[int, tuple[list[Tensor], list[bool]]] = {}
        received: list[tuple[KFACLayer, str]] = []
        group = self.columns[self.rank % len(self.columns)]
        for layer in layers:
            placement = self.placement(layer)
            if not self.ready[layer.name] or placement.group != group:
                continue
            if layer.state is None:
                layer.state = layer.empty_state(self.method, self.config.state_dtype,
                                                layer.device)
            for side, dtype in zip(SIDES, dtypes[layer.name], strict=True):
                src = placement.rank_of(side)
                if src != self.rank:
                    layer.state.convert_side(side, dtype)  # the owner's, before it arrives
                    received.append((layer, side))
                tensors, packs = outgoing.setdefault(src, ([], []))
                side_tensors = layer.state.side_tensors(side)
                tensors += side_tensors
                packs += [self.pack and layer.state.symmetric] * len(side_tensors)
        pending = [self.communicator.start_broadcast(tensors, src=src, stage="inverse_comm",
                                                     group=group, dtype=self.wire_dtype,
                                                     pack=packs)
                   for src, (tensors, packs) in outgoing.items()]
        for p in pending:
            p.wait()
        for layer, side in received:
            layer.valid_sides.add(side)

    def communicate_gradients(self, layers: list[KFACLayer], grads: dict[str, Tensor]) -> None:
        """Within this rank's row, each ready layer's ``P`` comes from the row's member of the
        layer's column (one bucketed broadcast per source rank)."""
        self._received_bytes = 0
        if len(self.row) == 1:
            return
        by_src: dict[int, list[KFACLayer]] = {}
        for layer in layers:
            if self.ready[layer.name]:
                src = next(r for r in self.row if r in self.placement(layer).group)
                by_src.setdefault(src, []).append(layer)
        for src, sent in by_src.items():
            if src != self.rank:
                self._receive_buffers(sent, grads)
        pending = [self.communicator.start_broadcast([grads[layer.name] for layer in sent],
                                                     src=src, stage="grad_comm", group=self.row)
                   for src, sent in by_src.items()]
        for p in pending:
            p.wait()


class DPKFACStrategy(KAISAStrategy):
    """DP-KFAC: only the owner captures a layer and builds its factors from its local batch;
    no factor communication; the owner preconditions and broadcasts ``P``."""

    communicates_factors = False
    factors_everywhere = False

    def __init__(self, config: KFACConfig, communicator: Communicator) -> None:
        super().__init__(config, communicator, name="dp-kfac")

    @property
    def factor_ranks(self) -> int:
        return 1

    def captures(self, layer: KFACLayer) -> bool:
        return self.owner(layer) == self.rank

    def factor_reduction(self) -> FactorReduction:
        """Nothing moves: each owner's factors describe its own local batch."""
        return FactorReduction()


class OsawaStrategy(DistributedStrategy):
    """Osawa et al.: factors reduce-scattered to their owners, which invert and precondition;
    preconditioned gradients all-gathered."""

    name = "osawa"
    factors_everywhere = False

    @property
    def moves_gradients(self) -> bool:
        return self.world_size > 1

    def _owned(self, layers: list[KFACLayer], rank: int) -> list[KFACLayer]:
        return [layer for layer in layers if self.owner(layer) == rank]

    def factor_reduction(self) -> FactorReduction:
        """The reduce-scatter to the owners (one uneven collective of every layer's factors,
        completed when the reduction is finished)."""
        return FactorReduction(self._reduce_scatter_factors)

    def _reduce_scatter_factors(self, layers: list[KFACLayer]) -> Callable[[], None]:
        staged = {layer.name: layer.batch_factors_for_reduction() for layer in layers}
        segments = [[t for layer in self._owned(layers, r) for t in staged[layer.name]]
                    for r in range(self.world_size)]
        self.communicator.reduce_scatter_v(segments, stage="factor_comm",
                                           average=True, dtype=self.wire_dtype, pack=self.pack)
        for layer in layers:
            if self.owner(layer) != self.rank:
                layer.batch_a = layer.batch_g = None
        return nothing_to_wait

    def communicate_inverses(self, layers: list[KFACLayer]) -> None:
        self._sync_ready(layers)

    def preconditions(self, layer: KFACLayer) -> bool:
        return self.ready[layer.name] and self.owner(layer) == self.rank

    def communicate_gradients(self, layers: list[KFACLayer], grads: dict[str, Tensor]) -> None:
        self._received_bytes = 0
        ready = [layer for layer in layers if self.ready[layer.name]]
        owned = [self._owned(ready, r) for r in range(self.world_size)]
        for r, theirs in enumerate(owned):
            if r != self.rank:
                self._receive_buffers(theirs, grads)
        segments = [[grads[layer.name] for layer in theirs] for theirs in owned]
        self.communicator.all_gather_v(segments, stage="grad_comm")


def make_strategy(config: KFACConfig, communicator: Communicator | None = None) -> Strategy:
    """The strategy for ``config.strategy``.

    Args:
        config: The preconditioner configuration.
        communicator: Communicator to use (e.g. a simulated one); by default one on the
            ranks of the initialised default process group (on groups of its own).

    Returns:
        A distributed strategy, or the single-process :class:`Strategy` when no communicator is
        given and ``torch.distributed`` is not initialised or has one rank.
    """
    if communicator is None:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return Strategy()
        communicator = Communicator.from_torch(bucket_cap_mb=config.bucket_cap_mb)
    name = config.canonical_strategy
    if name == "d-kfac":
        return DKFACStrategy(config, communicator)
    if name == "osawa":
        return OsawaStrategy(config, communicator)
    if name == "dp-kfac":
        return DPKFACStrategy(config, communicator)
    return KAISAStrategy(config, communicator, name=name)
