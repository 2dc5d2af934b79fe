"""The seam between the K-FAC mathematics and its distribution.

A :class:`Strategy` answers, per layer, which rank captures, inverts and preconditions, and moves
factors, second-order state and preconditioned gradients between ranks. The base class is the
single-process case: everything local, nothing moves. The distributed strategies of
KFAC_MATH.md live in ``core.distributed`` and override these methods.

Contract with the preconditioner (per step, on every rank, in this order): on factor-update
steps, a :meth:`~Strategy.factor_reduction` that receives each layer as soon as its batch
factors are staged and is then finished (on a step that keeps its inverses, the completion it
returns runs after ``communicate_gradients``); ``inverse_sides`` then ``communicate_inverses``
on inverse-update steps; ``preconditions`` then ``communicate_gradients`` every step. Every
rank makes the same calls, so a strategy may issue collectives in any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from core.distributed.communicator import Communicator
from core.inverse import SIDES
from core.kfac_layer import KFACLayer


def nothing_to_wait() -> None:
    """Completes a factor reduction that finished when it was started (or moved nothing)."""


class FactorReduction:
    """One step's batch factors, handed to the strategy layer by layer as each is staged.

    This base collects the layers and, in :meth:`finish`, hands them all to ``move`` (nothing
    moves without one): what a strategy needs whose collective takes every factor at once. A
    streaming subclass starts collectives in :meth:`add`, while later layers' factors are still
    being built.

    Args:
        move: Starts the reduction of the staged factors of the given layers (in place on
            ``layer.batch_*``) and returns the call that completes it.
    """

    def __init__(self, move: Callable[[list[KFACLayer]], Callable[[], None]] | None = None
                 ) -> None:
        self.layers: list[KFACLayer] = []
        self._move = move

    def add(self, layer: KFACLayer) -> None:
        """``layer``'s batch factors are staged and final."""
        self.layers.append(layer)

    def finish(self) -> Callable[[], None]:
        """Start whatever has not started and return the call that completes the reduction.

        Between the two the preconditioner runs work that does not read the new factors (the
        preconditioning of a step that keeps its inverses), so the collectives overlap it.
        """
        return nothing_to_wait if self._move is None else self._move(self.layers)


class Strategy:
    """Single-process behaviour; subclasses distribute it.

    Attributes:
        name: The strategy's name (``"local"`` here).
        rank: This process's rank.
        world_size: Number of processes.
        communicator: The communicator (and so the ledger) of the strategy; here a world of
            one, which moves and records nothing, so code written for a distributed run
            (``average_gradients(..., strategy.communicator)``, the ledger's summary) runs
            unchanged in one process.
    """

    name = "local"
    #: Whether :meth:`factor_reduction` moves batch factors between ranks (if not, the
    #: preconditioner builds and blends them one layer at a time).
    communicates_factors = False
    #: Whether every rank holds every layer's running factors (so which layers have them is
    #: the same on every rank).
    factors_everywhere = True

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.communicator = Communicator.simulated(0, 1)

    @property
    def moves_gradients(self) -> bool:
        """Whether :meth:`communicate_gradients` may replace or round this rank's
        preconditioned gradients (then what is computed from them must wait for it)."""
        return False

    @property
    def factor_ranks(self) -> int:
        """How many ranks' batches each factor pools (1 here and for ``dp-kfac``)."""
        return 1

    def buffer_bytes(self) -> int:
        """Bytes of communication buffers this strategy holds."""
        return 0

    def setup(self, layers: list[KFACLayer], *, method: str, dtype: torch.dtype) -> None:
        """Assign work for ``layers``; called once before the first step."""

    def set_step(self, step: int) -> None:
        """The preconditioner step that subsequent communication belongs to."""

    def captures(self, layer: KFACLayer) -> bool:
        """Whether this rank captures ``layer``'s activations and gradients."""
        return True

    def factor_reduction(self) -> FactorReduction:
        """A fresh reduction of this step's batch factors across ranks (nothing moves here)."""
        return FactorReduction()

    def inverse_sides(self, layer: KFACLayer) -> tuple[str, ...]:
        """Which of ``layer``'s factors (``"a"``, ``"g"``) this rank decomposes or inverts."""
        return SIDES

    def communicate_inverses(self, layers: list[KFACLayer]) -> None:
        """Send second-order state from the ranks that inverted to those that precondition."""

    def preconditions(self, layer: KFACLayer) -> bool:
        """Whether this rank computes ``layer``'s preconditioned gradient."""
        return True

    def communicate_gradients(self, layers: list[KFACLayer], grads: dict[str, Tensor]) -> None:
        """Give every rank every layer's preconditioned gradient (fills ``grads`` in place).

        Args:
            layers: The layers that have a gradient this step; which layers have one must agree
                across ranks (it does under DDP and with ``average_gradients``).
            grads: The preconditioned gradients this rank computed, by layer name.
        """

    def describe(self) -> str:
        """A human-readable placement table."""
        return "single process: every layer captured, inverted and preconditioned locally"

    def state_signature(self) -> dict[str, object]:
        """What a saved state depends on (checked when it is loaded)."""
        return {"strategy": self.name, "world_size": self.world_size}

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own resumable state (none here)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
