"""Heavy-ball momentum with the chainerkfac momentum adjustment (PAPERS.md §2.2 item 8).

chainerkfac's ``KFACUpdateRule`` keeps the learning rate inside the velocity::

    m_t = m · η_t / η_{t-1}   if adjust_momentum and η_t < η_{t-1},   else m
    v   ← m_t · v − η_t · g
    θ   ← θ + v

so when the rate decays, the momentum of that step shrinks by the same ratio (Goyal et al.'s
"momentum correction"). With a constant rate this is exactly ``torch.optim.SGD`` with momentum
``m`` and no dampening (``v = −η · buf``). The gradient ``g`` is whatever ``.grad`` holds, e.g. the
K-FAC-preconditioned gradient; weight decay, if any, is added to ``.grad`` before
preconditioning (see :func:`reproductions.osawa2018.rescaling.add_weight_decay`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from core.config import check_number


class HeavyBallSGD(torch.optim.Optimizer):
    """Momentum SGD in the velocity form of chainerkfac, with optional momentum adjustment.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate ``η`` (a scheduler may change ``group["lr"]`` between steps).
        momentum: Base momentum ``m`` in [0, 1).
        adjust_momentum: Scale the momentum by ``η_t/η_{t-1}`` at steps where the rate fell.

    Each group also records ``previous_lr`` (``η_{t-1}``, initially ``lr``) and
    ``last_momentum`` (the ``m_t`` of the last step); both are saved in the state dict.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float,
                 momentum: float = 0.9, adjust_momentum: bool = False) -> None:
        check_number("lr", lr, low=0.0)
        check_number("momentum", momentum, low=0.0, high=1.0, high_inclusive=False)
        super().__init__(params, {"lr": lr, "momentum": momentum,
                                  "adjust_momentum": adjust_momentum})
        for group in self.param_groups:
            group.setdefault("previous_lr", group["lr"])
            group.setdefault("last_momentum", group["momentum"])

    @staticmethod
    def effective_momentum(momentum: float, lr: float, previous_lr: float, adjust: bool
                           ) -> float:
        """``m_t``: ``m · η_t/η_{t-1}`` when adjusting and the rate fell, else ``m``."""
        if adjust and lr < previous_lr:
            return momentum * lr / previous_lr
        return momentum

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            lr = group["lr"]
            momentum = self.effective_momentum(group["momentum"], lr, group["previous_lr"],
                                               group["adjust_momentum"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(param)
                velocity = state["velocity"]
                velocity.mul_(momentum).add_(param.grad, alpha=-lr)
                param.add_(velocity)
            group["previous_lr"] = lr
            group["last_momentum"] = momentum
