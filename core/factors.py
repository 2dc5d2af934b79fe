"""Kronecker factors from captured rows, under each code base's scaling convention.

The canonical factors are ``A_c = (1/R) Σ ā āᵀ`` and ``G_c = (1/R) Σ δ δᵀ`` with ``δ = B·g``;
each convention rescales them (table in KFAC_MATH.md). Factors are always accumulated in fp32
or fp64 with autocast disabled, whatever the model's dtype, and symmetrised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core.layers import Rows


def _gram(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """``scale · xᵀx`` in ``dtype``, symmetrised."""
    x = x.to(dtype)
    with torch.autocast(device_type=x.device.type, enabled=False):
        gram = x.T @ x
    gram.mul_(scale)
    return (gram + gram.T) / 2


def a_factor(rows: Rows, scaling: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """The batch ``A`` factor of captured input rows.

    Args:
        rows: ``ā`` rows, ``(B, T, a_dim)``.
        scaling: ``"kaisa"``, ``"kfc"`` or ``"dpkfac"``.
        dtype: Accumulation and result dtype.
    """
    b, t = rows.batch, rows.positions
    x = rows.rows
    if scaling == "dpkfac" and not rows.spatial:
        return _gram(x.mean(dim=1), 1.0 / b, dtype)
    flat = x.reshape(b * t, -1)
    if not rows.spatial:
        return _gram(flat, 1.0 / (b * t), dtype)
    scale = {"kaisa": 1.0 / (b * t**3), "kfc": 1.0 / b, "dpkfac": 1.0 / (b * t**2)}[scaling]
    return _gram(flat, scale, dtype)


def g_factor(rows: Rows, scaling: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """The batch ``G`` factor of captured output-gradient rows.

    Args:
        rows: rows of ``g`` as autograd hands them for a loss that is a mean over the batch,
            already multiplied by any accumulation / loss-scale correction, ``(B, T, g_dim)``.
        scaling: ``"kaisa"``, ``"kfc"`` or ``"dpkfac"``.
        dtype: Accumulation and result dtype.
    """
    b, t = rows.batch, rows.positions
    g = rows.rows
    if scaling == "dpkfac" and not rows.spatial:
        return _gram(g.mean(dim=1), float(b), dtype)
    flat = g.reshape(b * t, -1)
    if scaling == "kaisa":
        scale = 1.0 / (b * t**3) if rows.spatial else 1.0 / (b * t)
    elif scaling == "kfc":
        scale = b / t
    else:  # dpkfac, spatial: L² · G_c
        scale = float(b * t)
    return _gram(flat, scale, dtype)


class RunningFactor:
    """A running average ``F ← α·F + (1 − α)·F_batch``; the first update sets ``F = F_batch``.

    Batch factors of several micro-steps (gradient accumulation, or a module called more than
    once) are summed into a pending batch and averaged when the running average is updated.
    """

    def __init__(self) -> None:
        self.value: Tensor | None = None
        self.pending: Tensor | None = None
        self.pending_count = 0

    def accumulate(self, batch: Tensor) -> None:
        """Add one micro-step's batch factor to the pending batch."""
        if self.pending is None:
            self.pending = batch.clone()
        else:
            self.pending.add_(batch)
        self.pending_count += 1

    def take_batch(self) -> Tensor | None:
        """The averaged pending batch factor (None if nothing was captured), and clear it."""
        if self.pending is None:
            return None
        batch = self.pending.div_(self.pending_count)
        self.pending, self.pending_count = None, 0
        return batch

    def discard_pending(self) -> None:
        """Drop a pending batch (an overflowed AMP step, or a step that captured garbage)."""
        self.pending, self.pending_count = None, 0

    def update(self, batch: Tensor, decay: float) -> None:
        """Blend a batch factor into the running average."""
        if self.value is None:
            self.value = batch.clone()
        else:
            self.value.mul_(decay).add_(batch, alpha=1.0 - decay)
