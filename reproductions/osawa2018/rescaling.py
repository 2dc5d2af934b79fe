"""Weight rescaling and L2 regularisation of the recipe (PAPERS.md §2.2 items 5 and 9).

chainerkfac's ``NormalizeWeightUR`` runs after every update on the weights flagged
``normalize_weight`` (every convolution and the final fully connected layer; not BatchNorm, not
biases): if ``‖W‖ > sqrt(2·d_out)`` the weight is scaled down to that norm. We implement the plain
version (the norm is recomputed every step); the code's optional amortisation
(``nw_skip_scale_comp``, off in its configs) is not reproduced.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

RESCALE_EPS = 1e-9
"""Added to the norm before dividing, as in chainerkfac."""


def rescaled_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights chainerkfac rescales (and L2-decays): those of every Conv2d and Linear."""
    return [m.weight for m in model.modules()
            if isinstance(m, nn.Conv2d | nn.Linear) and m.weight.requires_grad]


def rescale_target(weight: Tensor) -> float:
    """``sqrt(2·d_out)``, the largest norm a weight keeps (``d_out`` = its first dimension)."""
    return math.sqrt(2.0 * weight.shape[0])


@torch.no_grad()
def rescale_weights(weights: Iterable[Tensor]) -> None:
    """Scale each weight by ``sqrt(2·d_out) / (‖W‖ + ε)`` when that factor is below 1.

    The norms reach the host in one transfer: one per weight stalled a GPU's kernel launches
    at each of ResNet-50's 54 weights, every step."""
    weights = list(weights)
    if not weights:
        return
    norms = torch.stack([weight.norm().double() for weight in weights]).tolist()
    for weight, norm in zip(weights, norms, strict=True):
        scale = rescale_target(weight) / (norm + RESCALE_EPS)
        if scale < 1.0:
            weight.mul_(scale)


@torch.no_grad()
def add_weight_decay(weights: Iterable[Tensor], coefficient: float) -> None:
    """``∇W ← ∇W + coefficient · W``, before preconditioning (Chainer's ``WeightDecay`` hook
    runs before K-FAC computes its gradients, which is why the damping is ``max(λ, wd)``)."""
    if coefficient == 0.0:
        return
    for weight in weights:
        if weight.grad is not None:
            weight.grad.add_(weight, alpha=coefficient)
