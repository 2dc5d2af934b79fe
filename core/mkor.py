"""MKOR: rank-1 Kronecker factors updated by Sherman–Morrison (Mozaffari et al., NeurIPS 2023).

Per layer, on every ``inv_update_steps``-th step (KFAC_MATH.md "MKOR"):

1. rank-1 statistics ``ā`` (mean input row) and ``ḡ`` (mean over rows of ``R·g``), see
   :func:`core.rank1.activation_vector` and :func:`core.rank1.gradient_vector`;
2. one all-reduce of all layers' concatenated vectors, divided by the world size exactly once
   (optionally fp16 on the wire);
3. the norm-based stabiliser: if ``max |L⁻¹| > ε``, ``L⁻¹ ← ζ L⁻¹ + (1 − ζ) I`` (same for
   ``R⁻¹``);
4. the inverse update of the recursion ``L_t = γ L_{t−1} + (1 − γ) ḡ ḡᵀ`` (``R`` with ``ā``),
   by one of three rules (:func:`update_inverse`).

Every step: ``P = L⁻¹ ∇W̄ R⁻¹``, then ``P ← (‖∇W̄‖ / ‖P‖) P`` per layer; a first-order optimizer
(LAMB for BERT, SGD for ResNet) consumes ``P``. Inverse factors start at ``I``.

Where this differs from the released code (``Mohammad-Mozaffari/mkor``), on purpose:

* The official code's averaging all-reduce divides by the world size **twice** (``ReduceOp.AVG``
  and then a division in its ``sync``), so its statistics shrink by ``P²``. Ours divides once.
* The official stabiliser **resets the inverse to I** (its blending branch is unreachable: a
  module is looked up in a list of tensors), and it acts one update late, instead of the update.
  Ours blends, ``ζ L⁻¹ + (1 − ζ) I``, before the update in the same step, as the paper says.
* ``update_rule="official"`` reproduces the code's inverse update, but with ``γ = stat_decay``
  where the code hard-codes 0.95 (the default ``stat_decay``).
* The official per-layer rescale uses ``(‖∇W‖ + ‖∇b‖) / (‖ΔW‖ + ‖Δb‖)`` and the code clamps
  captured activations and gradients to ±100; ours uses the Frobenius norms of ``W̄ = [W | b]``
  and does not clamp.
* The stabiliser's trigger is the largest absolute entry of the inverse (as in the code; the
  paper's text speaks of an infinity norm).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from core.config import (
    PRECONDITION_DTYPES,
    ConfigError,
    check_choice,
    check_hyper,
    check_number,
    check_schedulable,
)
from core.hyper import Schedulable
from core.inverse import extremes, inverse_product
from core.layer_base import (
    HALF_OVERFLOW_FIX,
    cloned,
    half_overflows,
    nbytes,
    restored,
    squared_norm,
    unaliased,
)
from core.layers import LayerHelper
from core.rank1 import Rank1Config, Rank1Layer, Rank1Preconditioner
from core.timing import traced

UPDATE_RULES = ("exact", "paper", "official")
INVERSE_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Entries of an inverse kept in another dtype that a CPU brings to the arithmetic dtype at a
#: time (4 MiB of float32): small enough to stay in cache between the cast and the update,
#: large enough that per-block dispatch stays small against it.
CAST_BLOCK_ENTRIES = 2**20


@traced("max_abs")
def max_abs(tensor: Tensor) -> float:
    """``max |t_i|`` (NaN if an entry is NaN) from one ``aminmax`` pass, without a temporary,
    brought to the host in one transfer."""
    return _peak(*extremes(tensor).tolist())


def _peak(low: float, high: float) -> float:
    """``max(−low, high)``, NaN if either is (where Python's ``max`` would drop it)."""
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def stabiliser_fires(inverse: Tensor, epsilon: float) -> bool:
    """Whether the norm-based stabiliser acts on ``L⁻¹``: ``max |L⁻¹| > ε``.

    It then blends ``L⁻¹`` towards ``I`` (``ζ L⁻¹ + (1 − ζ) I``, paper Eq. 3.9), mixing the
    second-order direction with the first-order one; the blend is folded into
    :func:`update_inverse` (``blend=ζ``). Under the exact rule this keeps the factor bounded
    only when ``ζ < γ``: a direction the statistics do not excite grows by ``1/γ`` per
    update and the blend scales it by ``ζ``, so where it fires it settles at
    ``(1 − ζ)/(γ − ζ)`` (2 at the defaults), and grows without bound for ``ζ ≥ γ``. The
    paper's printed rule, which grows the excited directions, is not bounded by it.
    """
    return max_abs(inverse) > epsilon


class RankOneUpdate(NamedTuple):
    """``L_t⁻¹ = scale·L⁻¹ + coeff·u uᵀ + shift·I`` (see :func:`update_inverse`), with
    ``u_peak = max |u_i|`` for :func:`cannot_overflow`, and ``definite``: whether the
    Sherman–Morrison denominator is positive, so that a positive definite ``L⁻¹`` gives a
    positive definite ``L_t⁻¹`` (it is, for a positive definite ``L⁻¹``)."""

    scale: float
    shift: float
    coeff: float
    u: Tensor
    u_peak: float
    definite: bool


@traced("rank1_terms")
def update_terms(inverse: Tensor, v: Tensor, gamma: float, rule: str, blend: float = 1.0
                 ) -> RankOneUpdate:
    """The terms of one rank-1 update of ``inverse`` (see :func:`update_inverse`).

    One matrix-vector product reads ``L⁻¹``; the rest is vector work, whose two reductions
    (``vᵀu``, taken in float64, and ``max |u|``) reach the host in one transfer, so the scalar
    arithmetic runs there in float64.
    """
    if rule not in UPDATE_RULES:
        raise ValueError(f"unknown update rule {rule!r}")
    if rule == "official":  # M' = γ M + (1 − γ) I, u = M' v
        weight, rest = gamma * blend, gamma * (1.0 - blend) + 1.0 - gamma
    else:  # M = blend·L⁻¹ + (1 − blend)·I, u = M v
        weight, rest = blend, 1.0 - blend
    u = matvec(inverse, v)
    if weight != 1.0:
        u.mul_(weight)
    if rest:
        u.add_(v, alpha=rest)
    # vᵀu in float64: it overflows float32 from |v| near 2⁶⁴ (a diverging step's statistics),
    # and an infinite one made the rank-1 coefficient 0, a finite but wrong inverse
    quad = torch.dot(v.double(), u.double())
    low, high = torch.aminmax(u)
    low, high, quad = torch.stack([low.double(), high.double(), quad]).tolist()
    if rule == "official":
        scale, shift = weight, rest
        numerator, denominator = -1.0, 1.0 + quad
    elif rule == "exact":
        ratio = (1.0 - gamma) / gamma
        scale, shift = blend / gamma, (1.0 - blend) / gamma
        numerator, denominator = -ratio / gamma, 1.0 + ratio * quad
    else:  # paper
        scale, shift = gamma * blend, gamma * (1.0 - blend)
        numerator, denominator = (1.0 - gamma) / gamma**2, 1.0 + gamma * (1.0 - gamma) * quad
    # a zero denominator (an inverse gone indefinite) gives an infinite term, which the
    # caller's checks turn into a counted failure
    coeff = numerator / denominator if denominator else math.inf
    peak = _peak(low, high)
    limits = torch.finfo(u.dtype)
    if math.isfinite(coeff) and coeff and (abs(coeff) < limits.tiny
                                           or peak * peak > limits.max / 2):
        # the term as (√|c|·u)(√|c|·u)ᵀ: c below the dtype's normal range (a diverging step's
        # statistics) rounded away, or uᵢuⱼ overflowed, before c scaled it back
        root = math.sqrt(abs(coeff))
        u.mul_(root)
        coeff, peak = math.copysign(1.0, coeff), peak * root
    return RankOneUpdate(scale, shift, coeff, u, peak, denominator > 0)


def row_blocks(matrix: Tensor) -> list[slice]:
    """Row ranges of ``matrix`` of about :data:`CAST_BLOCK_ENTRIES` entries each on the CPU
    (the last may be shorter); elsewhere all its rows at once: a GPU's caching allocator
    reuses the cast copy without faulting it in, and each block would cost kernel launches."""
    n = matrix.shape[0]
    rows = max(1, CAST_BLOCK_ENTRIES // max(1, matrix.shape[1]))
    if matrix.device.type != "cpu" or rows >= n:
        return [slice(0, n)]
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def matvec(matrix: Tensor, v: Tensor) -> Tensor:
    """``M v`` in ``v``'s dtype. A matrix kept in another dtype is cast a block of rows at a
    time, so no full-size copy of it is made and each block is still in cache when read."""
    if matrix.dtype == v.dtype:
        return matrix @ v
    u = v.new_empty(matrix.shape[0])
    for rows in row_blocks(matrix):
        torch.mv(matrix[rows].to(v.dtype), v, out=u[rows])
    return u


@traced("rank1_update")
def apply_update(inverse: Tensor, terms: RankOneUpdate, *, in_place: bool = False) -> Tensor:
    """``scale·L⁻¹ + coeff·u uᵀ + shift·I``: one ``addr`` pass over the matrix and a diagonal
    update, in ``u``'s (the arithmetic) dtype, the result in ``inverse``'s. ``in_place``
    overwrites ``inverse`` (the same values, bit for bit, without a fresh matrix to allocate
    and fault in). An inverse kept in another dtype is updated a block of rows at a time
    through one block-sized buffer, which stays in cache, so the update streams it once in its
    own width."""
    if inverse.dtype != terms.u.dtype:
        return _apply_update_by_blocks(inverse, terms, in_place=in_place)
    if in_place:
        new = inverse.addr_(terms.u, terms.u, beta=terms.scale, alpha=terms.coeff)
    else:
        new = torch.addr(inverse, terms.u, terms.u, beta=terms.scale, alpha=terms.coeff)
    if terms.shift:
        new.diagonal().add_(terms.shift)
    return new


def _apply_update_by_blocks(inverse: Tensor, terms: RankOneUpdate, *, in_place: bool
                            ) -> Tensor:
    """:func:`apply_update` of an inverse kept in another dtype than ``u``."""
    new = inverse if in_place else torch.empty_like(inverse)
    blocks = row_blocks(inverse)
    buffer = terms.u.new_empty(blocks[0].stop - blocks[0].start, inverse.shape[1])
    for rows in blocks:
        block = buffer[:rows.stop - rows.start]
        block.copy_(inverse[rows]).addr_(terms.u[rows], terms.u, beta=terms.scale,
                                         alpha=terms.coeff)
        if terms.shift:  # the block's entries on the matrix's diagonal
            block.diagonal(offset=rows.start).add_(terms.shift)
        new[rows].copy_(block)
    return new


def cannot_overflow(terms: RankOneUpdate, peak: float, dtype: torch.dtype) -> bool:
    """Whether ``scale·L⁻¹ + coeff·u uᵀ + shift·I`` is certainly finite in ``dtype``, given
    ``peak = max |L⁻¹|``.

    Every entry is at most ``|scale|·peak + |coeff|·max|u|² + |shift|`` in magnitude (up to
    rounding); with that below half the dtype's largest value nothing overflows, and finite
    inputs give no NaN. False when any input is not finite (the bound is then NaN or infinite).
    """
    # products, not powers: a float's ** raises OverflowError where * gives inf
    bound = (abs(terms.scale) * peak + abs(terms.coeff) * terms.u_peak * terms.u_peak
             + abs(terms.shift))
    return bound < 0.5 * torch.finfo(dtype).max


def update_inverse(inverse: Tensor, v: Tensor, gamma: float, rule: str, blend: float = 1.0
                   ) -> Tensor:
    """One rank-1 update of a symmetric inverse factor with the statistic ``v``.

    The factor updated is ``M = blend·L⁻¹ + (1 − blend)·I``: ``L_{t−1}⁻¹`` itself for
    ``blend=1``, the stabilised one for ``blend=ζ``.

    Args:
        inverse: ``L_{t−1}⁻¹``, symmetric (inverse factors start at ``I`` and every rule keeps
            them symmetric).
        v: ``ḡ`` (or ``ā`` for the right factor).
        gamma: ``γ``, the weight of the old factor in ``L_t = γ L_{t−1} + (1 − γ) v vᵀ``.
        rule: ``"exact"``: the Sherman–Morrison inverse of that recursion,
            ``(1/γ) M − ((1−γ)/γ²) (M v vᵀ M) / (1 + ((1−γ)/γ) vᵀ M v)``.
            ``"paper"``: the formula as printed in the paper (Eq. 5/6),
            ``γ M + (1−γ) / (γ² (1 + γ(1−γ) vᵀ M v)) · M v vᵀ M``; it is not the inverse of
            the recursion. ``"official"``: the released code, ``M' = γ M + (1−γ) I``,
            ``M' − (M' v vᵀ M') / (1 + vᵀ M' v)``.
        blend: The stabiliser's weight ``ζ`` of ``L⁻¹``, or 1.

    Returns:
        ``L_t⁻¹`` (a new matrix). Every rule is ``a·L⁻¹ + d·I + c·u uᵀ`` with ``u`` the
        product of ``v`` with the blended factor (``= vᵀ M`` by symmetry): one ``addr`` pass
        over the matrix and a diagonal update (:func:`update_terms`, :func:`apply_update`);
        the blend is never materialised.
    """
    return apply_update(inverse, update_terms(inverse, v, gamma, rule, blend))


def gradient_norm_scale(p: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``‖∇W̄‖ / ‖P‖``: the factor that gives ``P`` the gradient's norm, so LR schedules keep
    their meaning; and ``‖∇W̄‖²``, which :func:`trusted_scales` reads. Both 0-d tensors,
    computed without waiting for the device (no per-layer sync on a GPU). The scale is 0 for
    a zero ``P``, which the nonsingular inverses give only for a zero gradient, so ``P`` times
    it is the raw gradient then too."""
    p_square, g_square = squared_norm(p), squared_norm(grad)
    return torch.where(p_square > 0, torch.sqrt(g_square / p_square), 0.0), g_square


def trusted_scales(scales: Sequence[Tensor], g_squares: Sequence[Tensor]) -> list[bool]:
    """Which of the layers' :func:`gradient_norm_scale` results can be trusted, in one host
    transfer: a scale finite, and positive unless its gradient is zero. In a narrow dtype
    ``‖P‖²`` can underflow to 0 or overflow (and ``‖∇W̄‖²`` likewise) while ``P`` and the
    rescaled result are ordinary numbers, and a ``P`` that overflowed gives 0 too."""
    scale, g_square = torch.stack(list(scales)), torch.stack(list(g_squares))
    return (scale.isfinite() & ((scale > 0) | (g_square == 0))).tolist()


@dataclass(kw_only=True)
class MKORConfig(Rank1Config):
    """All options of :class:`MKORPreconditioner` (and the shared ones of
    :class:`~core.rank1.Rank1Config`: ``skip_layers``, ``vocab_size_threshold``,
    ``accumulation_steps``, ``dtype``, ``comm_dtype``).

    Attributes:
        inv_update_steps: Capture statistics and update the inverse factors every this many
            steps (int >= 1 or callable of the step; the paper uses 10). Preconditioning runs
            every step with the current inverses.
        stat_decay: ``γ`` in (0, 1), the weight of the old factor (number or callable).
        update_rule: ``"exact"`` (default), ``"paper"`` or ``"official"``; see
            :func:`update_inverse`.
        epsilon: Stabiliser threshold ``ε`` > 0 on ``max |L⁻¹|``; ``math.inf`` disables it.
            The default 2 is the official code's.
        zeta: Stabiliser weight ``ζ`` in [0, 1] of the old inverse; the default 0.9 is the
            official code's ``1 − stabilization_factor``.
        rescale: Rescale each layer's ``P`` to the norm of its gradient (the paper always does).
        inverse_dtype: Storage dtype of the inverse factors; None keeps them in ``dtype``.
            ``"float16"`` halves their memory, as in the paper; updates upcast to ``dtype``.
        precondition_dtype: dtype of the preconditioning products ``L⁻¹ ∇W̄ R⁻¹`` (each
            operand cast to it, the result cast back to ``dtype``); None runs them in
            ``dtype``. ``"bfloat16"`` runs them at the bf16 GEMM rate, as K-FAC's option of
            that name does, with a relative error of about 2⁻⁸ in ``P``; with
            ``inverse_dtype="bfloat16"`` too the stored inverses are used as they are, with
            no cast per step. A ``P`` that is not finite in it is computed again in float64.
    """

    inv_update_steps: Schedulable[int] = 10
    stat_decay: Schedulable[float] = 0.95
    update_rule: str = "exact"
    epsilon: float = 2.0
    zeta: float = 0.9
    rescale: bool = True
    inverse_dtype: str | None = None
    precondition_dtype: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_schedulable("inv_update_steps", self.inv_update_steps, low=1, integer=True)
        check_hyper("stat_decay", self.stat_decay)
        check_choice("update_rule", self.update_rule, UPDATE_RULES)
        check_number("epsilon", self.epsilon, low=0.0, low_inclusive=False, infinite=True)
        check_number("zeta", self.zeta, low=0.0, high=1.0)
        if not isinstance(self.rescale, bool):
            raise ConfigError("rescale", self.rescale, "True or False")
        if self.inverse_dtype is not None:
            check_choice("inverse_dtype", self.inverse_dtype, INVERSE_DTYPES)
        if self.precondition_dtype is not None:
            check_choice("precondition_dtype", self.precondition_dtype, PRECONDITION_DTYPES)
        if (self.update_rule == "exact" and math.isfinite(self.epsilon)
                and not callable(self.stat_decay) and self.zeta >= self.stat_decay):
            warnings.warn(f"zeta={self.zeta} >= stat_decay={self.stat_decay}: the stabiliser "
                          "cannot bound the inverse factors under the exact rule (a direction "
                          "the statistics do not excite grows by zeta/stat_decay per update "
                          "where it fires, until the update fails); choose zeta < stat_decay",
                          stacklevel=3)


class MKORLayer(Rank1Layer):
    """One layer's inverse factors ``L⁻¹`` (output side, ``g_dim``) and ``R⁻¹`` (input side,
    ``a_dim``), both starting at ``I``, with the last averaged statistics and counters.

    Args:
        name: The module's qualified name.
        helper: The layer-type helper.
        dtype: Arithmetic dtype.
        storage_dtype: Dtype the inverse factors are kept in.
        grad_multiplier: See :class:`~core.rank1.Rank1Layer`.
    """

    def __init__(self, name: str, helper: LayerHelper, *, dtype: torch.dtype,
                 storage_dtype: torch.dtype, grad_multiplier: Callable[[], float]) -> None:
        super().__init__(name, helper, dtype=dtype, grad_multiplier=grad_multiplier)
        self.storage_dtype = storage_dtype
        # the narrower of the arithmetic and the storage dtype, which an update must fit
        self._range_dtype = min(dtype, storage_dtype, key=lambda t: torch.finfo(t).max)
        self.a_inv = torch.eye(self.a_dim, dtype=storage_dtype, device=self.device)
        self.g_inv = torch.eye(self.g_dim, dtype=storage_dtype, device=self.device)
        self.a_vec: Tensor | None = None
        self.g_vec: Tensor | None = None
        self.stabilisations = 0
        self.update_failures = 0
        self.wide_rescales = 0
        self.nonfinite_preconditioned = 0
        # max |·| of each inverse, cached from its last update (the stabiliser's trigger).
        self._a_peak: float | None = None
        self._g_peak: float | None = None

    def update(self, a: Tensor, g: Tensor, *, gamma: float, rule: str, epsilon: float,
               zeta: float) -> None:
        """Stabilise and update both inverse factors with the averaged statistics.

        An update whose result is not finite in the storage dtype is skipped (the last inverse
        is kept) and counted in :attr:`update_failures`.
        """
        self._follow_weight()
        self.a_vec, self.g_vec = a.clone(), g.clone()
        self.a_inv, self._a_peak = self._updated("R", self.a_inv, self._a_peak, a, gamma, rule,
                                                 epsilon, zeta)
        self.g_inv, self._g_peak = self._updated("L", self.g_inv, self._g_peak, g, gamma, rule,
                                                 epsilon, zeta)

    def _follow_weight(self) -> None:
        """Keep the inverse factors where the weight is: a model moved after its
        preconditioner was built (materialised from the meta device, or moved to a GPU)
        takes them along, as it does K-FAC's and Eva's statistics, which are built from the
        first captures. Inverses built on the meta device are still ``I``: no step has
        run there."""
        device = self.device
        if self.a_inv.device == device:
            return
        if self.a_inv.is_meta:
            self.a_inv, self.g_inv = (torch.eye(dim, dtype=self.storage_dtype, device=device)
                                      for dim in (self.a_dim, self.g_dim))
        else:
            self.a_inv, self.g_inv = self.a_inv.to(device), self.g_inv.to(device)

    def _updated(self, side: str, inverse: Tensor, peak: float | None, v: Tensor,
                 gamma: float, rule: str, epsilon: float, zeta: float
                 ) -> tuple[Tensor, float]:
        """The next inverse of one side and its ``max |·|``.

        Passes over the matrix, in the dtype it is kept in: the matrix-vector product and the
        ``addr`` update. The result's ``max |·|`` is the next update's stabiliser trigger
        (cached, so the stabiliser does not read the matrix again). When the result provably
        cannot overflow in the arithmetic or the storage dtype (:func:`cannot_overflow`) it is
        finite, and the matrix is updated in place; if the update also keeps the inverse
        positive definite (:attr:`RankOneUpdate.definite`), its diagonal gives that maximum.
        Otherwise the update goes to a new matrix, the old one stays for the failure path, and
        a third pass takes ``max |·|`` of the result, which also checks that it is
        finite.
        """
        if peak is None:  # first update, or after load_state_dict
            peak = max_abs(inverse)
        fired = peak > epsilon  # the stabiliser: max |L⁻¹| > ε
        self.stabilisations += int(fired)
        terms = update_terms(inverse, v, gamma, rule, blend=zeta if fired else 1.0)
        safe = cannot_overflow(terms, peak, self._range_dtype)
        new = apply_update(inverse, terms, in_place=safe)
        # Every rule keeps the inverse symmetric positive definite (it starts at I), whose
        # largest entry in magnitude lies on its diagonal (|m_ij| ≤ √(m_ii m_jj)); so where
        # the result is certainly finite and stays definite, its diagonal gives max |·|.
        new_peak = max_abs(new.diagonal()) if safe and terms.definite else max_abs(new)
        if math.isfinite(new_peak):
            return new, new_peak
        self.update_failures += 1
        warnings.warn(f"{self.name}: {side}⁻¹ update is not finite in {self.storage_dtype}; "
                      f"keeping the last inverse ({self.update_failures} failures so far)",
                      stacklevel=5)
        return inverse, peak

    def precondition(self, grad: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``L⁻¹ ∇W̄ R⁻¹`` in ``grad``'s dtype (the arithmetic dtype, or float64 for
        :meth:`rescaled_in_float64`), its products in ``dtype`` (default: ``grad``'s)."""
        self._follow_weight()
        dtype = dtype or grad.dtype
        p = inverse_product(grad, self.g_inv.to(dtype), self.a_inv.to(dtype))
        return p.to(grad.dtype)

    def rescaled_in_float64(self, grad: Tensor) -> Tensor | None:
        """``P`` rescaled to ``‖∇W̄‖``, computed in float64 and returned in the arithmetic
        dtype; None if it is not finite there. For a layer whose rescale left the arithmetic
        dtype's range: inverses far from unit size (the paper's rule shrinks ``L⁻¹`` by about
        ``γ`` per update; without the stabiliser they can grow) make ``‖P‖²`` underflow to 0 or
        overflow although ``P`` and the rescaled result are ordinary numbers."""
        wide = grad.to(torch.float64)
        p = self.precondition(wide)
        p_square = float(squared_norm(p))
        if p_square > 0:
            self.wide_rescales += 1
            p.mul_(math.sqrt(float(squared_norm(wide)) / p_square))
        out = p.to(self.dtype)
        return out if bool(out.isfinite().all()) else None

    def memory_usage(self) -> dict[str, int]:
        return {"inverses": nbytes(self.a_inv, self.g_inv),
                "vectors": nbytes(self.a_vec, self.g_vec)}

    def state_dict(self) -> dict[str, Any]:
        self._follow_weight()
        return {
            "a_inv": self.a_inv.clone(), "g_inv": self.g_inv.clone(),
            "a_vec": cloned(self.a_vec), "g_vec": cloned(self.g_vec),
            "stabilisations": self.stabilisations, "update_failures": self.update_failures,
            "wide_rescales": self.wide_rescales,
            "nonfinite_preconditioned": self.nonfinite_preconditioned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, dim in (("a_inv", self.a_dim), ("g_inv", self.g_dim)):
            if tuple(state[key].shape) != (dim, dim):
                raise ValueError(f"{self.name}: saved {key} has shape {tuple(state[key].shape)}, "
                                 f"this layer needs {(dim, dim)}")
        # Copies: updates may overwrite the inverses in place.
        self.a_inv = state["a_inv"].to(self.device, self.storage_dtype, copy=True)
        self.g_inv = state["g_inv"].to(self.device, self.storage_dtype, copy=True)
        self._a_peak = self._g_peak = None
        self.a_vec = restored(state["a_vec"], self.device)
        self.g_vec = restored(state["g_vec"], self.device)
        self.stabilisations = int(state["stabilisations"])
        self.update_failures = int(state["update_failures"])
        self.wide_rescales = int(state.get("wide_rescales", 0))
        self.nonfinite_preconditioned = int(state.get("nonfinite_preconditioned", 0))


class MKORPreconditioner(Rank1Preconditioner):
    """MKOR's rank-1 second-order preconditioning of every supported layer's gradient.

    Usage: ``loss.backward(); mkor.step(); optimizer.step()``; ``step()`` rewrites ``.grad``
    of the preconditioned layers in place (other parameters keep their raw gradients). The
    mathematics and the deliberate differences from the official code (which divides its
    all-reduced statistics by the world size twice and resets the inverse factors to ``I``
    instead of blending them; ours does neither) are in this module's docstring.

    Args:
        model: The model (or its DDP wrapper); Linear (2-D and 3-D inputs) and Conv2d layers
            are preconditioned, BERT's vocabulary decoder is skipped by default.
        config: An :class:`MKORConfig`; or give its fields as keyword arguments, e.g.
            ``MKORPreconditioner(model, inv_update_steps=10, stat_decay=0.95,
            update_rule="exact")``.
        grad_scaler: An AMP ``GradScaler`` whose scale is divided out of captured gradients.
        **options: :class:`MKORConfig` fields.

    Raises:
        ConfigError: on an invalid option, naming the field and the allowed values.
    """

    config_type: ClassVar[type[Rank1Config]] = MKORConfig
    interval_field: ClassVar[str] = "inv_update_steps"
    config: MKORConfig
    layers: list[MKORLayer]

    def _make_layer(self, name: str, helper: LayerHelper) -> MKORLayer:
        storage = self.config.inverse_dtype or self.config.dtype
        return MKORLayer(name, helper, dtype=self.dtype, storage_dtype=getattr(torch, storage),
                         grad_multiplier=self._grad_multiplier)

    @property
    def _product_dtype(self) -> torch.dtype:
        """dtype of the preconditioning products: ``precondition_dtype``, else the arithmetic
        one."""
        return getattr(torch, self.config.precondition_dtype or self.config.dtype)

    def _update_layer(self, layer: MKORLayer, a: Tensor, g: Tensor) -> None:
        cfg = self.config
        layer.update(a, g, gamma=self._hyper("stat_decay"), rule=cfg.update_rule,
                     epsilon=cfg.epsilon, zeta=cfg.zeta)

    def _precondition(self, grads: list[tuple[MKORLayer, Tensor]]) -> None:
        """Write each layer's ``P``, rescaled to its gradient's norm, into ``.grad`` while ``P``
        and ``∇W̄`` are still in cache (:func:`gradient_norm_scale`; ``P`` is ours, so it is
        scaled in place or while being copied); a gradient that a tied weight's earlier layer
        writes is copied first (:func:`~core.layer_base.unaliased`).

        Then one host transfer for all layers tells which results are not ordinary numbers: a
        rescale that cannot be trusted (:func:`trusted_scales`), or without the rescale a
        ``P`` that is not finite. Those layers are done again in float64
        (:meth:`MKORLayer.rescaled_in_float64`, counted in ``wide_rescales``); one still not
        finite keeps its raw gradient, with a warning and a count
        (``nonfinite_preconditioned``); so does a float16 weight whose written ``P`` left
        float16's range (:func:`~core.layer_base.half_overflows`)."""
        rescale = self.config.rescale
        written, scales, reads = [], [], []
        for layer, (grad,) in unaliased([(layer, (grad,)) for layer, grad in grads]):
            grad = grad.to(self.dtype)
            p = layer.precondition(grad, self._product_dtype)
            scale = None
            if rescale:
                scale, g_square = gradient_norm_scale(p, grad)
                scales.append(scale)
                reads.append(g_square)
            else:
                reads.append(p.sum())  # finite exactly when every entry is
            layer.helper.set_grad(p, scale)
            written.append((layer, grad))
        if not written:
            return
        ok = (trusted_scales(scales, reads) if rescale
              else torch.stack(reads).isfinite().tolist())
        left_raw = []
        for (layer, grad), good in zip(written, ok, strict=True):
            if good:
                continue
            redone = layer.rescaled_in_float64(grad) if rescale else None
            if redone is None:
                layer.nonfinite_preconditioned += 1
                left_raw.append(layer.name)
            layer.helper.set_grad(grad.clone() if redone is None else redone)
        raw = {layer.name: grad for layer, grad in written}
        overflowed = half_overflows([layer for layer, _ in written])
        for layer in overflowed:
            layer.nonfinite_preconditioned += 1
            layer.helper.set_grad(raw[layer.name].clone())
        total = sum(x.nonfinite_preconditioned for x in self.layers)
        if left_raw:
            warnings.warn(f"non-finite preconditioned gradient in {', '.join(left_raw)}; left "
                          f"first-order this step ({total} layer-steps so far): check the "
                          "update rule and the stabiliser (epsilon)", stacklevel=4)
        if overflowed:
            warnings.warn(f"preconditioned gradient of {', '.join(x.name for x in overflowed)} "
                          "exceeds float16's range; left first-order this step "
                          f"({total} layer-steps so far): {HALF_OVERFLOW_FIX}", stacklevel=4)

    def metrics(self) -> dict[str, float]:
        """Stage times, communication volume, stabiliser firings, update failures and the
        last step's ``γ``."""
        out = super().metrics()
        out["stabilisations"] = float(sum(x.stabilisations for x in self.layers))
        out["update_failures"] = float(sum(x.update_failures for x in self.layers))
        out["wide_rescales"] = float(sum(x.wide_rescales for x in self.layers))
        out["nonfinite_preconditioned"] = float(sum(x.nonfinite_preconditioned
                                                    for x in self.layers))
        out["stat_decay"] = self._hyper("stat_decay", max(self.steps - 1, 0))  # the last step's
        return out
