"""The seam between the K-FAC mathematics and its distribution.

A :class:`Strategy` answers, per layer, which rank captures, inverts and preconditions, and moves
factors, second-order state and preconditioned gradients between ranks. The base class is the
single-process case: everything local, nothing moves. The distributed strategies of
KFAC_MATH.md live in ``core.distributed`` and override these methods.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.kfac_layer import KFACLayer


class Strategy:
    """Single-process behaviour; subclasses distribute it.

    Attributes:
        name: The strategy's name (``"local"`` here).
        rank: This process's rank.
        world_size: Number of processes.
    """

    name = "local"

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    @property
    def factor_ranks(self) -> int:
        """How many ranks' batches each factor pools (1 here and for ``dp-kfac``)."""
        return 1

    def buffer_bytes(self) -> int:
        """Bytes of communication buffers this strategy holds."""
        return 0

    def setup(self, layers: list[KFACLayer], *, method: str, dtype: torch.dtype) -> None:
        """Assign work for ``layers``; called once before the first step."""

    def captures(self, layer: KFACLayer) -> bool:
        """Whether this rank captures ``layer``'s activations and gradients."""
        return True

    def reduce_factors(self, layers: list[KFACLayer]) -> None:
        """Combine the staged batch factors across ranks (in place on ``layer.batch_*``)."""

    def inverts(self, layer: KFACLayer) -> bool:
        """Whether this rank computes ``layer``'s inverse / eigendecomposition."""
        return True

    def communicate_inverses(self, layers: list[KFACLayer]) -> None:
        """Send second-order state from the ranks that inverted to those that precondition."""

    def preconditions(self, layer: KFACLayer) -> bool:
        """Whether this rank computes ``layer``'s preconditioned gradient."""
        return True

    def communicate_gradients(self, layers: list[KFACLayer], grads: dict[str, Tensor]) -> None:
        """Give every rank every layer's preconditioned gradient (fills ``grads`` in place)."""

    def describe(self) -> str:
        """A human-readable placement table."""
        return "single process: every layer captured, inverted and preconditioned locally"

    def state_signature(self) -> dict[str, object]:
        """What a saved state depends on (checked when it is loaded)."""
        return {"strategy": self.name, "world_size": self.world_size}


