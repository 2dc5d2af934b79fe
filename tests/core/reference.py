"""Independent, naive float64 references for K-FAC quantities (loops, explicit Kronecker products).

Nothing here calls ``core``; the tests compare ``core`` against these.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def conv_patches_naive(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """im2col by explicit loops: ``(B, L, c_in·k_h·k_w)`` in channel-major order."""
    (kh, kw), (sh, sw) = conv.kernel_size, conv.stride
    (ph, pw), (dh, dw) = conv.padding, conv.dilation
    b, c, h, w = x.shape
    xp = torch.zeros(b, c, h + 2 * ph, w + 2 * pw, dtype=x.dtype)
    xp[:, :, ph:ph + h, pw:pw + w] = x
    out_h = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for n in range(b):
        per_example = []
        for i in range(out_h):
            for j in range(out_w):
                patch = torch.empty(c, kh, kw, dtype=x.dtype)
                for ci in range(c):
                    for u in range(kh):
                        for v in range(kw):
                            patch[ci, u, v] = xp[n, ci, i * sh + u * dh, j * sw + v * dw]
                per_example.append(patch.flatten())
        rows.append(torch.stack(per_example))
    return torch.stack(rows)


def outer_mean(rows: Tensor) -> Tensor:
    """``(1/R) Σ r rᵀ`` by an explicit sum of outer products over ``(N, dim)`` rows."""
    total = torch.zeros(rows.shape[1], rows.shape[1], dtype=rows.dtype)
    for r in rows:
        total += torch.outer(r, r)
    return total / rows.shape[0]


def with_bias_column(rows: Tensor) -> Tensor:
    return torch.cat([rows, torch.ones(*rows.shape[:-1], 1, dtype=rows.dtype)], dim=-1)


def reference_factors(a_rows: Tensor, g: Tensor, *, spatial: bool, scaling: str
                      ) -> tuple[Tensor, Tensor]:
    """Factors per the KFAC_MATH.md table from ``(B, T, ·)`` input rows and autograd's ``g``.

    ``T`` is the sequence length (Linear 3-D) or the number of output locations (Conv2d).
    """
    b, t = a_rows.shape[0], a_rows.shape[1]
    delta = b * g
    if scaling == "dpkfac" and not spatial:
        return outer_mean(a_rows.mean(1)), outer_mean(delta.mean(1))
    a_c = outer_mean(a_rows.reshape(b * t, -1))
    g_c = outer_mean(delta.reshape(b * t, -1))
    if scaling == "kfc":
        return (t * a_c if spatial else a_c), g_c
    if scaling == "kaisa":
        if spatial:
            return a_c / t**2, g_c / (b**2 * t**2)
        return a_c, g_c / b**2
    return a_c / t, t**2 * g_c  # dpkfac, spatial


def dense_eigen_precondition(grad: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
    """``(G ⊗ A + λI)⁻¹ vec ∇W̄`` with the explicit Kronecker product (row-major vec)."""
    kron = torch.kron(g, a)
    eye = torch.eye(kron.shape[0], dtype=kron.dtype)
    return (torch.linalg.inv(kron + damping * eye) @ grad.flatten()).reshape(grad.shape)


def dense_inverse_precondition(grad: Tensor, a: Tensor, g: Tensor, shift_a: float,
                               shift_g: float) -> Tensor:
    """``(G + λ_G I)⁻¹ ∇W̄ (A + λ_A I)⁻¹`` with ``torch.linalg.inv``."""
    ia = torch.linalg.inv(a + shift_a * torch.eye(a.shape[0], dtype=a.dtype))
    ig = torch.linalg.inv(g + shift_g * torch.eye(g.shape[0], dtype=g.dtype))
    return ig @ grad @ ia
