"""Running mixup, exactly as the chainerkfac ImageNet model does it (PAPERS.md §2.2 item 11).

What ``ResNet50._mixup`` in chainerkfac's ``examples/imagenet/models/resnet50_d.py`` does, and what
:class:`RunningMixup` implements:

* The partner of example ``i`` is example ``i`` of the **previous mini-batch** seen by the same
  worker (not a permutation of the current batch, as in Zhang et al.'s mixup).
* Each example draws its own ``λ ~ Beta(α, α)``, then ``λ ← max(λ, 1 − λ)``, so the current
  image always dominates.
* ``x̃ = λ x + (1 − λ) x_prev`` and ``ỹ = λ onehot(y) + (1 − λ) y_prev`` (soft targets).
* **Running** mixup: the remembered ``(x_prev, y_prev)`` is the previous batch *after* mixing, so
  every batch carries a geometrically fading trace of all earlier ones. Random erasing runs in
  place on the same array after mixing, so the remembered batch is also the erased one; pass
  the erasing step as ``transform`` to reproduce that. Without ``running``, the partner is the
  previous raw batch and its one-hot labels.
* The first batch (and any batch whose shape differs from the remembered one, e.g. the last
  partial batch) is used unmixed with one-hot targets. The remembered batch is part of
  :meth:`RunningMixup.state_dict`, so a resumed run mixes its first batch as the original did.

The loss is the cross-entropy with the soft targets (``F.cross_entropy`` accepts probabilities);
accuracy is measured against the original labels. Random numbers come from torch's global
generator, so ``seed_everything`` and the checkpointed RNG state make runs repeatable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from core.config import check_number

#: The smallest ``α`` whose draws are trusted: below about 0.01 PyTorch's Beta sampler drifts
#: to ``λ = 1/2`` (the mean of ``max(λ, 1 − λ)`` is 0.88 at 10⁻³ and 0.5 at 10⁻⁸, where it
#: should approach 1), and below float32's range the distribution cannot be built.
MIN_ALPHA = 0.01


class RunningMixup:
    """Mixes each batch with the previous one (see the module docstring).

    Args:
        alpha: Beta distribution parameter ``α`` >= :data:`MIN_ALPHA`.
        num_classes: Number of classes, for the one-hot targets.
        running: Remember the mixed batch (True, chainerkfac's ``running_mixup``) or the raw one.
    """

    def __init__(self, alpha: float, num_classes: int, running: bool = True) -> None:
        check_number("mixup_alpha", alpha, low=MIN_ALPHA)
        self.beta = torch.distributions.Beta(torch.tensor(float(alpha)),
                                             torch.tensor(float(alpha)))
        self.num_classes = num_classes
        self.running = running
        self.previous: tuple[Tensor, Tensor] | None = None

    def sample_lambda(self, n: int) -> Tensor:
        """``max(λ, 1 − λ)`` for ``n`` draws of ``λ ~ Beta(α, α)``."""
        lam = self.beta.sample((n,))
        return torch.maximum(lam, 1.0 - lam)

    def __call__(self, x: Tensor, labels: Tensor,
                 transform: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Mix ``x`` with the remembered batch, apply ``transform``, remember, and return.

        Args:
            x: Input batch ``(N, …)``.
            labels: Integer labels ``(N,)``.
            transform: Applied to the mixed batch before it is remembered (random erasing).

        Returns:
            The batch to train on and its soft targets ``(N, num_classes)``.
        """
        onehot = F.one_hot(labels, self.num_classes).to(x.dtype)
        mixed, targets = x, onehot
        if self.previous is not None and self.previous[0].shape == x.shape:
            lam = self.sample_lambda(x.shape[0]).to(device=x.device, dtype=x.dtype)
            prev_x, prev_y = self.previous
            mixed = torch.lerp(prev_x, x, lam.view(-1, *([1] * (x.dim() - 1))))
            targets = torch.lerp(prev_y, onehot, lam.view(-1, 1))
        if transform is not None:
            mixed = transform(mixed)
        self.previous = (mixed, targets) if self.running else (x, onehot)
        return mixed, targets

    def state_dict(self) -> dict[str, Tensor | None]:
        """The remembered batch: ``{"inputs": Tensor | None, "targets": Tensor | None}``."""
        inputs, targets = self.previous if self.previous is not None else (None, None)
        return {"inputs": inputs, "targets": targets}

    def load_state_dict(self, state: dict[str, Tensor | None]) -> None:
        """Remember the batch of a :meth:`state_dict` (None entries: nothing remembered)."""
        inputs, targets = state["inputs"], state["targets"]
        self.previous = None if inputs is None or targets is None else (inputs, targets)
