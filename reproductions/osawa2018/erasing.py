"""Random erasing on a batch, as chainerkfac's ImageNet model does it (PAPERS.md §2.2 item 11).

Per example, with probability ``rate``: an area ``S = H·W·U(area_low, area_high)`` and an aspect
``r = U(min_aspect, 1)`` give a rectangle ``h = round(sqrt(S·r))``, ``w = round(sqrt(S/r))``
(half-up rounding), swapped with probability 1/2 and clipped to the image; its top-left corner is
uniform over ``0 … max(H − h − 1, 0)`` rows and ``0 … max(W − w − 1, 0)`` columns (inclusive, as
Python's ``random.randint`` in the original), and every channel inside it is set to 0, the mean of
the normalised input. The draws are vectorised over the batch and use torch's global generator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.config import ConfigError, check_number


class RandomErasing:
    """Erases one random rectangle per selected example (see the module docstring).

    Args:
        rate: Probability that an example is erased, in [0, 1].
        area: ``(area_low, area_high)``, fractions of the image area, 0 < low <= high <= 1.
        min_aspect: Lower end of the aspect ratio draw, in (0, 1].
    """

    def __init__(self, rate: float, area: tuple[float, float], min_aspect: float) -> None:
        check_number("erasing_rate", rate, low=0.0, high=1.0)
        low, high = area
        if not 0.0 < low <= high <= 1.0:
            raise ConfigError("erasing_area", area, "(low, high) with 0 < low <= high <= 1")
        check_number("erasing_min_aspect", min_aspect, low=0.0, high=1.0, low_inclusive=False)
        self.rate = rate
        self.area = (low, high)
        self.min_aspect = min_aspect

    def rectangles(self, n: int, height: int, width: int) -> tuple[Tensor, ...]:
        """Draw ``(erase, top, left, h, w)`` for ``n`` examples (int64 tensors, ``erase`` bool)."""
        draws = torch.rand(6, n, dtype=torch.float64)
        erase = draws[0] < self.rate
        low, high = self.area
        size = height * width * (low + (high - low) * draws[1])
        aspect = self.min_aspect + (1.0 - self.min_aspect) * draws[2]
        h = torch.floor(torch.sqrt(size * aspect) + 0.5).long()
        w = torch.floor(torch.sqrt(size / aspect) + 0.5).long()
        swap = draws[3] < 0.5
        h, w = torch.where(swap, w, h), torch.where(swap, h, w)
        h, w = h.clamp(max=height), w.clamp(max=width)
        top = torch.floor(draws[4] * ((height - h - 1).clamp(min=0) + 1)).long()
        left = torch.floor(draws[5] * ((width - w - 1).clamp(min=0) + 1)).long()
        return erase, top, left, h, w

    def __call__(self, x: Tensor) -> Tensor:
        """A copy of the ``(N, C, H, W)`` batch with the drawn rectangles set to 0."""
        n, _, height, width = x.shape
        erase, top, left, h, w = (t.to(x.device) for t in self.rectangles(n, height, width))
        rows = torch.arange(height, device=x.device).view(1, -1)
        cols = torch.arange(width, device=x.device).view(1, -1)
        in_rows = (rows >= top.view(-1, 1)) & (rows < (top + h).view(-1, 1))
        in_cols = (cols >= left.view(-1, 1)) & (cols < (left + w).view(-1, 1))
        mask = in_rows.unsqueeze(2) & in_cols.unsqueeze(1) & erase.view(-1, 1, 1)
        return x.masked_fill(mask.unsqueeze(1), 0.0)
