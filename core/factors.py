"""Kronecker factors from captured rows, under each code base's scaling convention.

The canonical factors are ``A_c = (1/R) Σ ā āᵀ`` and ``G_c = (1/R) Σ δ δᵀ`` with ``δ = B·g``;
each convention rescales them (table in KFAC_MATH.md). Factors are always accumulated in fp32
or fp64 with autocast disabled, whatever the model's dtype, and symmetrised.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from core.inverse import symmetrised
from core.layers import Rows

#: Column-block width of the symmetric product: blocks above the diagonal are computed and
#: mirrored, so a ``d``-square factor costs ``(k + 1) / 2k`` of the full GEMM with ``k`` blocks.
GRAM_BLOCK = 512


def _block_edges(dim: int) -> list[tuple[int, int]]:
    blocks = max(1, math.ceil(dim / GRAM_BLOCK))
    cuts = [dim * i // blocks for i in range(blocks + 1)]
    return list(itertools.pairwise(cuts))


def _gram(m: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """``scale · m mᵀ`` of a ``(dim, rows)`` matrix in ``dtype``, exactly symmetric.

    Like a symmetric rank-k update (BLAS ``syrk``): only the blocks on and above the diagonal
    are multiplied (the scale folded into the GEMM); those above are mirrored, those on it
    symmetrised. Every copy keeps one side contiguous, so none is a strided transpose.
    """
    m = m.to(dtype)
    dim = m.shape[0]
    out = torch.empty(dim, dim, dtype=dtype, device=m.device)
    edges = _block_edges(dim)
    with torch.autocast(device_type=m.device.type, enabled=False):
        for i, (r0, r1) in enumerate(edges):
            for c0, c1 in edges[i:]:
                block = torch.empty(r1 - r0, c1 - c0, dtype=dtype, device=m.device)
                torch.addmm(block, m[r0:r1], m[c0:c1].T, beta=0.0, alpha=scale, out=block)
                if r0 == c0:
                    out[r0:r1, r0:r1] = symmetrised(block)
                else:
                    out[r0:r1, c0:c1] = block
                    out[c0:c1, r0:r1] = block.T.contiguous()
    return out


def _feature_major(rows: Tensor) -> Tensor:
    """The ``(dim, B·T)`` matrix of ``(B, T, dim)`` rows.

    A view when the rows' layout allows (Linear inputs, convolution patches from
    :meth:`~core.layers.Conv2dHelper.a_rows`); otherwise one copy along contiguous runs of
    positions (convolution output gradients), never an element-wise transpose.
    """
    return rows.permute(2, 0, 1).reshape(rows.shape[2], -1)


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
        return _gram(x.mean(dim=1).T, 1.0 / b, dtype)
    if not rows.spatial:
        scale = 1.0 / (b * t)
    else:
        scale = {"kaisa": 1.0 / (b * t**3), "kfc": 1.0 / b, "dpkfac": 1.0 / (b * t**2)}[scaling]
    return _gram(_feature_major(x), scale, dtype)


def g_factor(rows: Rows, scaling: str, dtype: torch.dtype = torch.float32,
             multiplier: float = 1.0) -> Tensor:
    """The batch ``G`` factor of captured output-gradient rows.

    Args:
        rows: rows of ``g`` as autograd hands them for a loss that is a mean over the batch,
            ``(B, T, g_dim)``.
        scaling: ``"kaisa"``, ``"kfc"`` or ``"dpkfac"``.
        dtype: Accumulation and result dtype.
        multiplier: What ``g`` is multiplied by first (accumulation steps over the AMP loss
            scale); it enters the GEMM's scale squared, so ``g`` itself is not rewritten.
    """
    b, t = rows.batch, rows.positions
    g = rows.rows
    square = multiplier * multiplier
    if scaling == "dpkfac" and not rows.spatial:
        return _gram(g.mean(dim=1).T, float(b) * square, dtype)
    if scaling == "kaisa":
        scale = 1.0 / (b * t**3) if rows.spatial else 1.0 / (b * t)
    elif scaling == "kfc":
        scale = b / t
    else:  # dpkfac, spatial: L² · G_c
        scale = float(b * t)
    return _gram(_feature_major(g), scale * square, dtype)


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
        """Add one micro-step's batch factor to the pending batch (which takes ``batch`` over:
        the caller must not write to it afterwards)."""
        if self.pending is None:
            self.pending = batch
        else:
            self.pending.add_(batch)
        self.pending_count += 1

    def take_batch(self) -> Tensor | None:
        """The averaged pending batch factor (None if nothing was captured), and clear it."""
        if self.pending is None:
            return None
        batch = self.pending
        if self.pending_count > 1:
            batch.div_(self.pending_count)
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
            self.value.lerp_(batch, 1.0 - decay)
