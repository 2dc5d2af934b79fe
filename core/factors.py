"""Kronecker factors from captured rows, under each code base's scaling convention.

The canonical factors are ``A_c = (1/R) Σ ā āᵀ`` and ``G_c = (1/R) Σ δ δᵀ`` with ``δ = B·g``;
each convention rescales them (table in KFAC_MATH.md). Factors are always accumulated in fp32
or fp64 with autocast disabled, whatever the model's dtype, and symmetrised.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from core import host_kernels
from core.layers import Rows
from core.timing import traced

#: Column-block width of the symmetric product: blocks above the diagonal are computed and
#: mirrored, so a ``d``-square factor costs ``(k + 1) / 2k`` of the full GEMM with ``k`` blocks.
GRAM_BLOCK = 256
#: On the CPU, run the symmetric product as one BLAS ``syrk`` (:mod:`core.host_kernels`):
#: PyTorch has none, and the blocks above cost 1.2-1.5x more on ResNet-18's shapes on this
#: project's CPUs (docs/benchmarks.md). Other devices multiply blocks.
HOST_SYRK = True


def _block_edges(dim: int) -> list[tuple[int, int]]:
    blocks = max(1, math.ceil(dim / GRAM_BLOCK))
    cuts = [dim * i // blocks for i in range(blocks + 1)]
    return list(itertools.pairwise(cuts))


class SymmetricGram:
    """Accumulates ``Σ_k scale_k · m_k m_kᵀ`` over ``(dim, rows_k)`` matrices, exactly symmetric.

    A symmetric rank-k update: on the CPU BLAS ``syrk`` itself (:data:`HOST_SYRK`), elsewhere
    GEMMs of only the blocks on and above the diagonal (the scale folded into the GEMM). Either
    accumulates in place part after part, so rows can be built and multiplied a cache-sized
    slice of the batch at a time; :meth:`result` mirrors the upper triangle (with blocks, it
    symmetrises the diagonal blocks, ``(b + bᵀ) / 2``, exactly symmetric since floating-point
    addition commutes). Autocast is off; parts are cast to ``dtype``.

    Args:
        dim: The factor's dimension.
        dtype: Accumulation and result dtype.
        device: Where the rows (and so the result) are. The result is allocated here, before
            any rows: long-lived, it then does not sit between the rows' short-lived buffers
            and keep the allocator from returning their memory.
    """

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.out = torch.empty(dim, dim, dtype=dtype, device=device)
        self.edges = _block_edges(dim)
        self.beta = 0.0
        self.syrk = (HOST_SYRK and self.out.device.type == "cpu"
                     and dtype in host_kernels.DTYPES)

    def add(self, m: Tensor, scale: float) -> None:
        """Add ``scale · m mᵀ``."""
        with torch.autocast(device_type=m.device.type, enabled=False):
            m = m.to(self.out.dtype)
            if self.syrk:
                host_kernels.syrk_upper(self.out, m, scale, self.beta)
                self.beta = 1.0
                return
            for i, (r0, r1) in enumerate(self.edges):
                for c0, c1 in self.edges[i:]:
                    block = self.out[r0:r1, c0:c1]
                    torch.addmm(block, m[r0:r1], m[c0:c1].T, beta=self.beta, alpha=scale,
                                out=block)
        self.beta = 1.0

    def result(self) -> Tensor:
        """The symmetric sum (the accumulator must not be used afterwards)."""
        out = self.out
        assert self.beta == 1.0, "a factor needs at least one part of rows"
        if self.syrk:  # the upper triangle is the result
            host_kernels.mirror_upper(out)
            return out
        for i, (r0, r1) in enumerate(self.edges):
            diagonal = out[r0:r1, r0:r1]
            diagonal.add_(diagonal.T.clone(memory_format=torch.contiguous_format)).mul_(0.5)
            for c0, c1 in self.edges[i + 1:]:
                out[c0:c1, r0:r1] = out[r0:r1, c0:c1].T
        return out


@functools.lru_cache(maxsize=64)
def _diagonal_owners(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """Which diagonal each entry of the concatenated diagonals of ``sizes`` comes from: the
    same few layouts recur every step (all layers at once, or one layer's pair), so building
    it is paid once per layout (it was most of the cost of one layer's checks)."""
    return torch.arange(len(sizes), device=device).repeat_interleave(
        torch.tensor(sizes, device=device), output_size=sum(sizes))


@traced("batch_finiteness_check")
def gram_diagonal_checks(pairs: Sequence[tuple[Tensor, Tensor]]) -> list[tuple[bool, bool]]:
    """For each layer's ``(A, G)`` batch factors: whether both are finite, and whether ``A`` is
    all zeros, read from their diagonals alone, for every pair in one host transfer (one per
    layer would make the host wait for a GPU at every layer).

    A batch factor is a sum of Gram matrices, so ``|F_ij| <= sqrt(F_ii F_jj)``: it is finite
    exactly when its diagonal is (an inf or NaN row entry reaches the diagonal too), and zero
    exactly when its diagonal is (no row, or only zero rows, went into it). Its diagonal
    entries are sums of squares, never negative, so both are read from its trace, summed in
    float64 (no sum of finite float32 entries overflows there): finite exactly when the
    diagonal is, zero exactly when it is. The traces of all factors come from one
    concatenation of their diagonals and one indexed sum, a few ops whatever the layer count.
    """
    if not pairs:
        return []
    diagonals = [d for a, g in pairs for d in (a.diagonal(), g.diagonal())]
    device = diagonals[0].device
    sizes = tuple(d.numel() for d in diagonals)
    traces = torch.zeros(len(sizes), dtype=torch.float64, device=device).index_add_(
        0, _diagonal_owners(sizes, device), torch.cat(diagonals).to(torch.float64)).tolist()
    return [(math.isfinite(traces[i]) and math.isfinite(traces[i + 1]), traces[i] == 0)
            for i in range(0, len(traces), 2)]


def _feature_major(rows: Tensor) -> Tensor:
    """The ``(dim, B·T)`` matrix of ``(B, T, dim)`` rows.

    A view when the rows' layout allows (Linear inputs, convolution patches from
    :meth:`~core.layers.Conv2dHelper.a_rows`); otherwise one copy along contiguous runs of
    positions (convolution output gradients), never an element-wise transpose.
    """
    return rows.permute(2, 0, 1).reshape(rows.shape[2], -1)


def add_a_rows(gram: SymmetricGram, rows: Rows, batch: int, scaling: str) -> None:
    """Add captured input rows to the batch ``A`` factor being accumulated in ``gram``.

    Args:
        gram: The accumulator.
        rows: ``ā`` rows, ``(B_k, T, a_dim)``: the whole batch or a slice of it.
        batch: Examples ``B`` in the whole batch.
        scaling: ``"kaisa"``, ``"kfc"`` or ``"dpkfac"``.
    """
    t, x = rows.positions, rows.rows
    if scaling == "dpkfac" and not rows.spatial:
        gram.add(x.mean(dim=1).T, 1.0 / batch)
        return
    gram.add(_feature_major(x), a_scale(batch, t, rows.spatial, scaling))


def a_scale(batch: int, positions: int, spatial: bool, scaling: str) -> float:
    """What ``Σ ā āᵀ`` over a batch's rows is multiplied by to give its ``A`` factor.

    Args:
        batch: Examples ``B`` in the whole batch.
        positions: Rows per example (``T`` or ``L``).
        spatial: Whether the positions are convolution output locations.
        scaling: ``"kaisa"``, ``"kfc"`` or ``"dpkfac"`` (for ``dpkfac`` with positions that are
            not spatial, rows are averaged over them first: :func:`add_a_rows`).
    """
    if not spatial:
        return 1.0 / (batch * positions)
    return {"kaisa": 1.0 / (batch * positions**3), "kfc": 1.0 / batch,
            "dpkfac": 1.0 / (batch * positions**2)}[scaling]


def add_g_rows(gram: SymmetricGram, rows: Rows, batch: int, scaling: str,
               multiplier: float = 1.0) -> None:
    """Add captured output-gradient rows to the batch ``G`` factor being accumulated in ``gram``.

    Args:
        gram: The accumulator.
        rows: rows of ``g`` as autograd hands them for a loss that is a mean over the batch,
            ``(B_k, T, g_dim)``: the whole batch or a slice of it.
        batch: Examples ``B`` in the whole batch.
        scaling: ``"kaisa"``, ``"kfc"`` or ``"dpkfac"``.
        multiplier: What ``g`` is multiplied by first (accumulation steps over the AMP loss
            scale); it enters the GEMM's scale squared, so ``g`` itself is not rewritten.
    """
    b, t, g = batch, rows.positions, rows.rows
    square = multiplier * multiplier
    if scaling == "dpkfac" and not rows.spatial:
        gram.add(g.mean(dim=1).T, float(b) * square)
        return
    if scaling == "kaisa":
        scale = 1.0 / (b * t**3) if rows.spatial else 1.0 / (b * t)
    elif scaling == "kfc":
        scale = b / t
    else:  # dpkfac, spatial: L² · G_c
        scale = float(b * t)
    gram.add(_feature_major(g), scale * square)


class RunningFactor:
    """A running average ``F ← α·F + (1 − α)·F_batch``; the first update sets ``F = F_batch``,
    or, for a factor that starts at the identity, ``F = α·I + (1 − α)·F_batch``.

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

    @traced("running_average")
    def update(self, batch: Tensor, decay: float, *, identity_start: bool = False) -> None:
        """Blend a batch factor into the running average (which, with ``identity_start``, is
        the identity before the first update)."""
        if self.value is None and identity_start:
            self.value = torch.eye(batch.shape[0], dtype=batch.dtype, device=batch.device)
        if self.value is None:
            self.value = batch.clone()
        else:
            self.value.lerp_(batch, 1.0 - decay)
