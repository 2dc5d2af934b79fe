"""The Gram matrix of a stride-1 convolution's patches, without forming the patches.

A convolution's ``A`` factor sums ``ā āᵀ`` over its im2col patch rows. With stride 1, the block
of two kernel offsets ``α, β`` is ``S(α, β) = Σ_o x[o + α] x[o + β]ᵀ`` over the output grid
``o``: a cross-correlation of the (zero-padded) input with itself at the displacement
``D = β − α``, restricted to the window ``α + grid``. All ``k²`` blocks of one displacement
share the correlation over the whole image, ``T(D)``; they differ from it only by the few rows
and columns of the image their window leaves out. So the factor costs one ``C × C`` GEMM per
distinct displacement (13 for a 3x3 kernel, against the 81 blocks of the ``9C``-square product
of the patches) plus thin edge corrections, and no patch is ever written: on ResNet-18's 3x3
layers 2-3x less work than the ``syrk`` of materialised patches.

Each ``T(D)`` is one GEMM on contiguous memory: the input is laid out channels-last with enough
zero padding that shifting the flattened ``(positions, C)`` matrix by ``D``'s flat offset pairs
every real position with its neighbour at ``D``, and any pair that wraps past a row or an image
lands on padding (a product of zeros).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

#: A half-open range of rows or columns in padded coordinates.
Span = tuple[int, int]


@dataclass(frozen=True)
class Geometry:
    """A stride-1 ``Conv2d``'s patch geometry (per axis: height, width).

    Attributes:
        kernel: Kernel size. dilation: Dilation. padding: Zero padding on each side.
    """

    kernel: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int]

    @property
    def reach(self) -> tuple[int, int]:
        """How far the last kernel offset lies from the first, per axis."""
        return ((self.kernel[0] - 1) * self.dilation[0], (self.kernel[1] - 1) * self.dilation[1])

    @property
    def offsets(self) -> list[tuple[int, int]]:
        """Kernel offsets in the weight's ``(k_h, k_w)`` order, in padded-input pixels."""
        (kh, kw), (dh, dw) = self.kernel, self.dilation
        return [(i * dh, j * dw) for i in range(kh) for j in range(kw)]


@dataclass(frozen=True)
class _Block:
    """One block ``S(α, β) = T(D) − Σ_rects`` of the factor, ``β`` at or after ``α``."""

    alpha: int
    beta: int
    shift: tuple[int, int]
    corrections: tuple[tuple[Span, Span], ...]


@dataclass(frozen=True)
class Plan:
    """How the patch Gram of one input size is computed, and what it costs.

    Attributes:
        geometry: The convolution's.
        padded: Padded height and width of the channels-last layout.
        output: Output height and width.
        blocks: Every block on or after the diagonal (offset order), with its corrections.
        shifts: The distinct displacements ``D`` of the blocks, each one GEMM.
    """

    geometry: Geometry
    padded: tuple[int, int]
    output: tuple[int, int]
    blocks: tuple[_Block, ...]
    shifts: tuple[tuple[int, int], ...]

    @property
    def positions(self) -> int:
        """Output locations ``L`` per example (the rows per example of the patches)."""
        return self.output[0] * self.output[1]

    def flops(self, batch: int, channels: int) -> float:
        """Multiply-add FLOPs (2 per product) of the Gram of ``batch`` examples: one GEMM per
        displacement over every padded position, plus the corrections' GEMMs."""
        hp, wp = self.padded
        per_pair = 2.0 * channels * channels * batch
        edges = sum((r1 - r0) * (c1 - c0) for b in self.blocks
                    for (r0, r1), (c0, c1) in b.corrections)
        return per_pair * (len(self.shifts) * hp * wp + edges)

    def patch_flops(self, batch: int, channels: int) -> float:
        """FLOPs of the symmetric product of the materialised patches, ``rows·d²``."""
        dim = channels * self.geometry.kernel[0] * self.geometry.kernel[1]
        return float(batch * self.output[0] * self.output[1] * dim * dim)

    def flat_shift(self, shift: tuple[int, int]) -> int:
        """``D``'s offset in the flattened channels-last layout."""
        return shift[0] * self.padded[1] + shift[1]


def _span_minus(outer: Span, inner: Span) -> list[Span]:
    """The parts of ``outer`` outside ``inner`` (at most two spans, empty ones dropped)."""
    parts = [(outer[0], min(outer[1], inner[0])), (max(outer[0], inner[1]), outer[1])]
    return [p for p in parts if p[0] < p[1]]


def _intersect(a: Span, b: Span) -> Span:
    return (max(a[0], b[0]), min(a[1], b[1]))


@functools.lru_cache(maxsize=256)
def plan(geometry: Geometry, height: int, width: int) -> Plan:
    """The blocks, displacements and edge corrections for an input of ``height × width``.

    Raises:
        ValueError: If the kernel does not fit the padded input (no output positions).
    """
    (ph, pw), (rh, rw) = geometry.padding, geometry.reach
    output = (height + 2 * ph - rh, width + 2 * pw - rw)
    if min(output) < 1:
        raise ValueError(f"a {geometry.kernel} kernel (dilation {geometry.dilation}) does not "
                         f"fit a {height}x{width} input padded by {geometry.padding}")
    # Top/left padding as the convolution's; bottom/right at least that (the last windows) and
    # enough that a shift of up to the reach never pairs two real pixels across a row or image.
    padded = (ph + height + max(ph, rh - ph), pw + width + max(pw, rw - pw))
    real = ((ph, ph + height), (pw, pw + width))
    offsets = geometry.offsets
    blocks = []
    for alpha, beta in itertools.combinations_with_replacement(range(len(offsets)), 2):
        (ah, aw), (bh, bw) = offsets[alpha], offsets[beta]
        shift = (bh - ah, bw - aw)
        # Pairs (u, u + D) with both real: u in the overlap of the image and the image - D.
        overlap = tuple(_intersect(real[axis], (real[axis][0] - shift[axis],
                                                real[axis][1] - shift[axis]))
                        for axis in (0, 1))
        window = ((ah, ah + output[0]), (aw, aw + output[1]))
        corrections: list[tuple[Span, Span]] = []
        if overlap[0][0] < overlap[0][1] and overlap[1][0] < overlap[1][1]:
            # The overlap minus the window: whole rows outside it, then columns outside it
            # within the window's rows.
            corrections += [(rows, overlap[1]) for rows in _span_minus(overlap[0], window[0])]
            inside = _intersect(overlap[0], window[0])
            if inside[0] < inside[1]:
                corrections += [(inside, cols) for cols in _span_minus(overlap[1], window[1])]
        blocks.append(_Block(alpha, beta, shift, tuple(corrections)))
    shifts = tuple(dict.fromkeys(b.shift for b in blocks))
    return Plan(geometry, padded, output, tuple(blocks), shifts)


class ShiftedPatches:
    """A captured input laid out for :meth:`gram`: channels-last, zero-padded, flattened.

    Building it (one copy of the input) is the convolution's row capture; :meth:`gram` is its
    factor GEMMs.

    Args:
        x: The captured ``(B, C, H, W)`` input.
        plan: From :func:`plan` for ``x``'s spatial size.
        dtype: Dtype of the layout and of the factor.
    """

    def __init__(self, x: Tensor, plan: Plan, dtype: torch.dtype) -> None:
        self.plan = plan
        batch, channels, height, width = x.shape
        (hp, wp), (ph, pw) = plan.padded, plan.geometry.padding
        self.length = batch * hp * wp
        tail = max(plan.flat_shift(s) for s in plan.shifts)
        flat = torch.zeros(self.length + tail, channels, dtype=dtype, device=x.device)
        self.images = flat[:self.length].view(batch, hp, wp, channels)
        self.images[:, ph:ph + height, pw:pw + width].copy_(x.permute(0, 2, 3, 1))
        self.flat = flat

    def gram(self, out: Tensor, scale: float, with_bias: bool) -> Tensor:
        """``scale · Σ ā āᵀ`` over the patch rows, written into ``out`` (``d × d``, ``d`` =
        ``C·k_h·k_w`` plus one with the bias entry), exactly symmetric.

        Rows are in the weight's channel-major ``(c, k_h, k_w)`` order, as
        :meth:`core.layers.Conv2dHelper.a_rows` builds them. The blocks of one offset ``α``
        (its rows of the factor) are gathered in a ``(C, k², C)`` panel with contiguous
        blocks, then copied into those rows in one pass: writing each ``C × C`` block straight
        into the interleaved layout costs about twice as much. A block after the diagonal is
        kept until its transpose fills the later offset's panel.
        """
        plan, images, flat = self.plan, self.images, self.flat
        channels, taps = flat.shape[1], len(plan.geometry.offsets)
        dim = channels * taps
        with torch.autocast(device_type=flat.device.type, enabled=False):
            head = flat[:self.length].T
            correlations = {}
            for shift in plan.shifts:
                start = plan.flat_shift(shift)
                correlations[shift] = (head @ flat[start:start + self.length]).mul_(scale)
            rows = out[:dim, :dim].view(channels, taps, dim)
            panel = torch.empty(channels, taps, channels, dtype=flat.dtype, device=flat.device)
            blocks = {(b.alpha, b.beta): b for b in plan.blocks}
            kept: dict[tuple[int, int], Tensor] = {}
            for alpha in range(taps):
                for beta in range(taps):
                    if beta < alpha:
                        panel[:, beta] = kept.pop((beta, alpha)).T
                        continue
                    value = self._block(blocks[alpha, beta], correlations, scale)
                    panel[:, beta] = value
                    if beta > alpha:
                        kept[alpha, beta] = value
                rows[:, alpha].view(channels, channels, taps).copy_(panel.permute(0, 2, 1))
            if with_bias:
                (oh, ow), sums = plan.output, []
                for ah, aw in plan.geometry.offsets:
                    sums.append(images[:, ah:ah + oh, aw:aw + ow].sum(dim=(0, 1, 2)))
                column = torch.stack(sums, dim=1).reshape(dim).mul_(scale)
                out[dim, :dim] = column
                out[:dim, dim] = column
                out[dim, dim] = scale * images.shape[0] * oh * ow
        return out

    def _block(self, block: _Block, correlations: dict[tuple[int, int], Tensor],
               scale: float) -> Tensor:
        """``scale · S(α, β)``: the scaled correlation at the block's displacement less the
        pairs outside its window; a diagonal block made exactly symmetric. A block without
        corrections off the diagonal is the shared correlation itself (read-only); the first
        correction writes a new matrix, so no block costs a copy of its own."""
        value = correlations[block.shift]
        channels = value.shape[0]
        dh, dw = block.shift
        for i, ((r0, r1), (c0, c1)) in enumerate(block.corrections):
            left = self.images[:, r0:r1, c0:c1].reshape(-1, channels)
            right = self.images[:, r0 + dh:r1 + dh, c0 + dw:c1 + dw].reshape(-1, channels)
            if i == 0:
                value = torch.addmm(value, left.T, right, alpha=-scale)
            else:
                value.addmm_(left.T, right, alpha=-scale)
        if block.alpha == block.beta:  # (v + vᵀ) / 2 is exactly symmetric: addition commutes
            value = (value + value.T).mul_(0.5)
        return value
