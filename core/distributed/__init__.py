"""Distribution of K-FAC work across ranks: assignment, communicator, ledger and strategies."""

from __future__ import annotations

import torch.distributed as dist

from core.config import KFACConfig
from core.strategy import Strategy


def make_strategy(config: KFACConfig) -> Strategy:
    """The strategy for ``config.strategy``; single-process when not distributed."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return Strategy()
    raise NotImplementedError(
        f"strategy={config.canonical_strategy!r} across {dist.get_world_size()} processes is "
        "not implemented yet"
    )
