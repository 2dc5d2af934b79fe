"""Inversion of damped Kronecker factors and the preconditioning products.

Four methods (KFAC_MATH.md "Inversion and damping"):

* ``eigen``: ``P = Q_G [(Q_Gᵀ ∇W̄ Q_A) ⊘ (d_G d_Aᵀ + λ)] Q_Aᵀ = (G ⊗ A + λI)⁻¹ vec ∇W̄``;
  the damping enters at preconditioning time, so it can change without a new decomposition.
  With pre-divided eigenvalues (KAISA's default) the decomposing rank keeps
  ``1/(d_G d_Aᵀ + λ)`` instead of ``d_A`` and ``d_G``, with the damping of that inversion.
* ``inverse`` / ``cholesky``: ``P = (G + λ_G I)⁻¹ ∇W̄ (A + λ_A I)⁻¹`` with the damping split
  ``full`` (``λ_A = λ_G = λ``) or ``pi`` (``λ_A = π√λ``, ``λ_G = √λ/π``).
* ``cholesky_solve``: the same ``P``, from the Cholesky factors ``L`` of the damped factors by
  triangular solves, without forming the inverses: each inverse update costs the factorisation
  only (about a third of ``cholesky``'s work), and a step's solves cost what its products do.

Failure policy: a decomposition that raises or returns non-finite values is retried in fp64; if
that fails too, :class:`DecompositionError` is raised and the caller keeps its last good state.
Running out of device memory, and device errors, are raised as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import Tensor

from core import host_kernels
from core.timing import traced

#: The two Kronecker factors of a layer; a distributed strategy may invert them on different ranks.
SIDES = ("a", "g")
#: On the CPU, factor and invert in the damped matrix's own memory through LAPACK's column-major
#: view (one scratch matrix per decomposition), the factorisation by SciPy's LAPACK
#: (:mod:`core.host_kernels`); other devices use torch's out-of-place kernels. A switch, so the
#: tests also run the other devices' path on the CPU.
HOST_IN_PLACE = True


class DecompositionError(RuntimeError):
    """A factor could not be decomposed in the requested dtype nor in fp64."""


def extremes(tensor: Tensor) -> Tensor:
    """``[min, max]`` of ``tensor`` in one pass without a temporary; NaN if any entry is NaN."""
    return torch.stack(torch.aminmax(tensor))


@traced("finiteness_check")
def all_finite(tensors: Sequence[Tensor], reductions: Sequence[Tensor] | None = None) -> bool:
    """Whether every entry of every tensor is finite (one sync, two if a sum overflows).

    One summation pass per tensor decides almost always: a sum is finite only if every term
    is (an inf or NaN term leaves every partial sum it enters non-finite, and finite terms
    never make a NaN). Finite entries whose sum overflows are then told apart by one
    ``aminmax`` pass (:func:`extremes`) per tensor. Summation is the fastest reduction here
    (1.6-2.7x faster than ``aminmax`` on 257- to 4,608-square factors), and
    ``isfinite(t).all()`` writes a boolean temporary as large as ``t``.

    Args:
        tensors: The tensors to check.
        reductions: Sums the caller has already taken over all of ``tensors``' entries, of
            terms that are finite exactly where the entries are (squared norms, say); then no
            pass of its own is needed unless their total overflows.
    """
    present = [t for t in tensors if t.numel()]
    if not present:
        return True
    sums = [t.sum() for t in present] if reductions is None else list(reductions)
    total = sums[0] if len(sums) == 1 else torch.stack([s.float() for s in sums]).sum()
    if math.isfinite(float(total)):
        return True
    return bool(torch.stack([extremes(t) for t in present]).isfinite().all())


class _SidedState:
    """Tensors listed ``A`` side first, then ``G`` side (in equal numbers unless
    :attr:`a_side_count` says otherwise).

    Attributes:
        symmetric: Whether every tensor is a symmetric matrix (may travel as an upper triangle).
        kind: The name that :func:`make_state` rebuilds the state from (saved in checkpoints).
        a_side_count: How many of the tensors describe ``A``; None: half of them.
    """

    symmetric: ClassVar[bool]
    kind: ClassVar[str]
    a_side_count: ClassVar[int | None] = None

    def tensors(self) -> list[Tensor]:
        raise NotImplementedError

    @classmethod
    def shapes(cls, a_dim: int, g_dim: int) -> list[tuple[int, ...]]:
        """The shapes of :meth:`tensors` for factors of dimensions ``a_dim`` and ``g_dim``."""
        raise NotImplementedError

    def _split(self, items: list, side: str) -> list:
        count = len(items) // 2 if self.a_side_count is None else self.a_side_count
        return items[:count] if side == "a" else items[count:]

    def side_tensors(self, side: str) -> list[Tensor]:
        """The tensors describing factor ``side`` (``"a"`` or ``"g"``)."""
        return self._split(self.tensors(), side)

    def _side_fields(self, side: str) -> list[str]:
        return self._split([f.name for f in fields(self)], side)  # type: ignore[arg-type]

    def side_dtype(self, side: str) -> torch.dtype:
        """The dtype factor ``side``'s tensors are kept in (both sides may differ: see
        :func:`kept_dtype`)."""
        return self.side_tensors(side)[0].dtype

    @traced("state_copy")
    def set_side(self, side: str, values: Sequence[Tensor], dtype: torch.dtype | None = None
                 ) -> None:
        """Make a fresh decomposition of factor ``side`` this state's, kept in ``dtype``
        (default: the side's current dtype).

        ``values`` must be fresh tensors that no one else holds or writes (a decomposition's
        outputs, :meth:`rounded_side`'s): where one is row-major and of ``dtype`` it is taken
        over as it is, which spares a pass over the inverse's bytes per factor; otherwise it
        is copied. Nothing keeps a state tensor across steps (a broadcast reads
        :meth:`side_tensors` when it starts), so replacing one is safe.
        """
        dtype = dtype or self.side_dtype(side)
        for name, src in zip(self._side_fields(side), values, strict=True):
            adopt = src.dtype == dtype and src.is_contiguous()
            setattr(self, name, src if adopt else src.to(
                dtype, memory_format=torch.contiguous_format, copy=True))

    @traced("state_rounding")
    def rounded_side(self, side: str, values: Sequence[Tensor], dtype: torch.dtype
                     ) -> list[Tensor]:
        """``values`` (a fresh decomposition of factor ``side``) rounded to ``dtype``: written
        over this state's own tensors of the side when they are kept in ``dtype`` (so a
        rounding checked by :func:`kept_dtype` needs no second copy, nor its memory), else
        into new tensors. :meth:`set_side` with the result then copies nothing."""
        if dtype != self.side_dtype(side):
            return [t.to(dtype, memory_format=torch.contiguous_format) for t in values]
        own = self.side_tensors(side)
        for dst, src in zip(own, values, strict=True):
            dst.copy_(src)
        return own

    def convert_side(self, side: str, dtype: torch.dtype) -> None:
        """Keep factor ``side`` in ``dtype`` from now on (its values cast), e.g. before a
        broadcast of the owner's state in that dtype overwrites them."""
        if dtype != self.side_dtype(side):
            self.set_side(side, self.side_tensors(side), dtype)


@dataclass
class EigenState(_SidedState):
    """Eigenbases and clamped eigenvalues of ``A`` and ``G``."""

    qa: Tensor
    da: Tensor
    qg: Tensor
    dg: Tensor
    symmetric: ClassVar[bool] = False
    kind: ClassVar[str] = "eigen"

    def tensors(self) -> list[Tensor]:
        return [self.qa, self.da, self.qg, self.dg]

    @classmethod
    def shapes(cls, a_dim: int, g_dim: int) -> list[tuple[int, ...]]:
        return [(a_dim, a_dim), (a_dim,), (g_dim, g_dim), (g_dim,)]


@dataclass
class PredividedEigenState(_SidedState):
    """Eigenbases of ``A`` and ``G`` and the damped reciprocal eigenvalue products
    ``1/(d_G d_Aᵀ + λ)`` (``g × a``), with the damping of the inversion that made them:
    KAISA's ``prediv_eigenvalues``, its default. Each step's product saves forming and dividing
    by ``d_G d_Aᵀ + λ``; the state holds and sends ``a·g − a − g`` more values than
    :class:`EigenState`, and a damping changed between inversions takes effect at the next one.

    The ratios need both factors' eigenvalues, so both are decomposed on one rank; they travel
    with ``G``'s side (``A``'s side is its eigenbasis alone).
    """

    qa: Tensor
    qg: Tensor
    dgda: Tensor
    symmetric: ClassVar[bool] = False
    kind: ClassVar[str] = "eigen_prediv"
    a_side_count: ClassVar[int | None] = 1

    def tensors(self) -> list[Tensor]:
        return [self.qa, self.qg, self.dgda]

    @classmethod
    def shapes(cls, a_dim: int, g_dim: int) -> list[tuple[int, ...]]:
        return [(a_dim, a_dim), (g_dim, g_dim), (g_dim, a_dim)]


@dataclass
class InverseState(_SidedState):
    """Damped inverses ``(A + λ_A I)⁻¹`` and ``(G + λ_G I)⁻¹``."""

    a_inv: Tensor
    g_inv: Tensor
    symmetric: ClassVar[bool] = True
    kind: ClassVar[str] = "inverse"

    def tensors(self) -> list[Tensor]:
        return [self.a_inv, self.g_inv]

    @classmethod
    def shapes(cls, a_dim: int, g_dim: int) -> list[tuple[int, ...]]:
        return [(a_dim, a_dim), (g_dim, g_dim)]


@dataclass
class CholeskyState(_SidedState):
    """Lower-triangular Cholesky factors ``L_A``, ``L_G`` of the damped factors
    (``A + λ_A I = L_A L_Aᵀ``, ``G + λ_G I = L_G L_Gᵀ``), row-major, zero above the diagonal.

    Not symmetric: packing a symmetric upper triangle would send the zeros and lose ``L``.
    """

    a_chol: Tensor
    g_chol: Tensor
    symmetric: ClassVar[bool] = False
    kind: ClassVar[str] = "cholesky_solve"

    def tensors(self) -> list[Tensor]:
        return [self.a_chol, self.g_chol]

    @classmethod
    def shapes(cls, a_dim: int, g_dim: int) -> list[tuple[int, ...]]:
        return [(a_dim, a_dim), (g_dim, g_dim)]


SecondOrderState = EigenState | PredividedEigenState | InverseState | CholeskyState

#: The state class of each inverse method (``inverse`` and ``cholesky`` share theirs), and of
#: ``eigen`` with pre-divided eigenvalues (:attr:`core.config.KFACConfig.state_method`).
STATE_TYPES: dict[str, type[SecondOrderState]] = {
    "eigen": EigenState, "eigen_prediv": PredividedEigenState, "inverse": InverseState,
    "cholesky": InverseState, "cholesky_solve": CholeskyState,
}


def make_state(method: str, tensors: Sequence[Tensor]) -> SecondOrderState:
    """The state of ``method`` (or of a state's :attr:`~_SidedState.kind`) built from its
    tensors in :meth:`tensors` order."""
    return STATE_TYPES[method](*tensors)


def _with_fp64_retry(name: str, fn: Callable[[Tensor], tuple[Tensor, ...]], matrix: Tensor,
                     dtype: torch.dtype, *, retry: bool = True) -> tuple[Tensor, ...]:
    """Run ``fn`` in ``dtype``; on an error or non-finite output, once more in fp64 (unless
    ``retry`` is False: the caller then retries parts of ``matrix`` on their own).

    The fp64 result is cast back to ``dtype`` and must be finite there too: the damped inverse
    of a singular factor can exceed fp32's range (a tiny damping), and is then a failure.
    Running out of device memory, or a device error, is no failure of the matrix and is
    raised as it is: taken for one, it was retried in fp64 (twice the memory) and then left
    the layer first-order with a warning at every inversion, the run going on.
    """
    errors = []
    for attempt in dict.fromkeys([dtype, torch.float64] if retry else [dtype]):
        try:
            out = tuple(t.to(dtype) for t in fn(matrix.to(attempt)))
        except (torch.OutOfMemoryError, torch.AcceleratorError):
            raise
        except RuntimeError as err:  # torch.linalg.LinAlgError is a RuntimeError
            errors.append(f"{attempt}: {err}")
            continue
        if all_finite(out):
            return out
        errors.append(f"{attempt}: non-finite result in {dtype}")
    raise DecompositionError(f"{name} failed ({'; '.join(errors)})")


def _require_finite(name: str, factor: Tensor) -> None:
    """Raise :class:`DecompositionError` (for method ``name``) if ``factor`` is not finite."""
    if not all_finite([factor]):
        raise DecompositionError(f"{name} failed: the factor has non-finite entries")


def eigen_decompose(factor: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Eigenbasis and non-negative eigenvalues (ascending) of a symmetric factor.

    Rows and columns that are entirely zero (a channel that is zero over the whole batch: a
    dead ReLU, or a convolution tap that only ever sees padding) are eigenvectors of
    eigenvalue 0, and only the rest is decomposed: LAPACK's divide and conquer (``syevd``,
    behind ``torch.linalg.eigh``) fails to converge on a factor with thousands of zero rows,
    in fp32 and often in fp64 too (ResNet-18's 2,304- and 4,608-wide factors over inputs of
    1x1 pixel), and on a smaller matrix it is also faster.
    """
    _require_finite("eigh", factor)

    def eigh(m: Tensor) -> tuple[Tensor, Tensor]:
        d, q = torch.linalg.eigh(m)
        return q, d.clamp_(min=0.0)

    zero = factor.diagonal() == 0
    if bool(zero.any()):
        zero = (factor == 0).all(dim=1)
    if not bool(zero.any()):
        q, d = _with_fp64_retry("eigh", eigh, factor, dtype)
        return q, d
    dead, kept = zero.nonzero().squeeze(1), (~zero).nonzero().squeeze(1)
    n, k = factor.shape[0], kept.numel()
    q = torch.zeros(n, n, dtype=dtype, device=factor.device)
    d = torch.zeros(n, dtype=dtype, device=factor.device)
    q[dead, torch.arange(n - k, device=factor.device)] = 1.0
    if k:
        q_kept, d[n - k:] = _with_fp64_retry(
            "eigh", eigh, factor.index_select(0, kept).index_select(1, kept), dtype)
        q[kept.unsqueeze(1), torch.arange(n - k, n, device=factor.device)] = q_kept
    return q, d


def symmetrised(m: Tensor) -> Tensor:
    """``(m + mᵀ) / 2``, in ``m``'s memory when it is row-major (LAPACK results are often
    column-major; those are copied to row-major first). Both transposes are contiguous
    copies: a strided element-wise transpose of a large matrix is many times slower."""
    m = m.contiguous()
    return m.add_(m.T.contiguous()).mul_(0.5)


#: A damped factor whose mean diagonal lies beyond ``2^±RESCALE_EXPONENT`` is decomposed
#: scaled by a power of two to a mean diagonal near 1 (:func:`_damped`).
RESCALE_EXPONENT = 16


@traced("damped_copy")
def _damped(m: Tensor, shift: float) -> tuple[Tensor, int]:
    """``(m + shift·I) · 2⁻ᵉ`` in a fresh row-major matrix, and the even exponent ``e``.

    A factor far from unit scale is brought near it before its Cholesky factorisation:
    output-gradient factors can sit at ``2⁻⁴⁷`` (the attention key projections of a BERT at
    initialisation, under DP-KFAC's π-split damping), where LAPACK's arithmetic meets
    subnormal numbers, which x86 CPUs run in microcode: a 256-wide ``potrf`` took 8 ms instead
    of 0.08 ms. A power of two scales exactly, so the decomposition is the same up to those
    subnormals; ``e`` is even so the Cholesky factor unscales exactly too (by ``2^(e/2)``).
    Factors within ``2^±``:data:`RESCALE_EXPONENT` are not scaled (``e = 0``), which spares
    their result a pass.
    """
    mean_diagonal = float(m.diagonal().sum()) / m.shape[0] + shift
    exponent = 0
    if mean_diagonal > 0 and math.isfinite(mean_diagonal):
        exponent = 2 * round(math.log2(mean_diagonal) / 2)
    # 2⁻ᵉ must be finite in the factor's dtype (a mean diagonal below float64's normal range
    # overflowed the Python float): beyond it the factor is brought as near unit scale as it goes
    limit = math.frexp(torch.finfo(m.dtype).max)[1] - 2  # even for every floating dtype
    exponent = max(-limit, min(limit, exponent))
    if abs(exponent) <= RESCALE_EXPONENT:
        exponent = 0
    out = torch.empty_like(m, memory_format=torch.contiguous_format)
    torch.mul(m, 2.0**-exponent, out=out)
    out.diagonal().add_(shift * 2.0**-exponent)
    return out, exponent


def _unscaled(m: Tensor, factor: float) -> Tensor:
    """``m · factor`` in ``m``'s memory, skipping the pass when ``factor`` is 1."""
    return m if factor == 1.0 else m.mul_(factor)


def _host_path(matrix: Tensor) -> bool:
    return HOST_IN_PLACE and matrix.device.type == "cpu" and matrix.dtype in host_kernels.DTYPES


def inverse_in_place(matrix: Tensor) -> int:
    """Overwrite the symmetric, row-major CPU ``matrix`` with its inverse from its Cholesky
    factor, in its own memory; LAPACK's ``info`` (0 when done, else the order of the first minor
    that is not positive definite, and ``matrix`` is spent).

    ``potrf`` and then ``potri`` (:mod:`core.host_kernels`) both work on the column-major view
    ``matrix.T``, which is the same matrix: no copy and no scratch matrix.
    """
    info = host_kernels.cholesky_in_place(matrix, lower_in_matrix=False)
    if info == 0:
        info = host_kernels.inverse_from_cholesky_in_place(matrix)
    return info


def _lower_cholesky_in_place(matrix: Tensor) -> int:
    """Overwrite the symmetric row-major ``matrix`` with ``L`` (``A = L Lᵀ``), zero above the
    diagonal; LAPACK's ``info``. On the CPU (:data:`HOST_IN_PLACE`) SciPy's LAPACK leaves the
    upper triangle as it was and one contiguous pass zeroes it; elsewhere torch factors the
    column-major view (the same matrix) and zeroes it itself."""
    if _host_path(matrix):
        info = host_kernels.cholesky_in_place(matrix, lower_in_matrix=True)
        if info == 0:
            matrix.tril_()
        return info
    column_major = matrix.T
    info_out = torch.empty((), dtype=torch.int32, device=matrix.device)
    torch.linalg.cholesky_ex(column_major, upper=True, out=(column_major, info_out))
    return int(info_out)


def _not_positive_definite(info: int) -> RuntimeError:
    return RuntimeError(f"matrix not positive definite (minor {info})")


def damped_inverse(factor: Tensor, shift: float, method: str, dtype: torch.dtype) -> Tensor:
    """``(F + shift·I)⁻¹``, exactly symmetric.

    Both methods factor the damped matrix by Cholesky and form the inverse from it (half the
    FLOPs of an LU inverse). ``"cholesky"`` fails when the matrix is not positive definite,
    in ``dtype`` and then in fp64; ``"inverse"`` then falls back to ``torch.linalg.inv`` (LU)
    in fp64, so it inverts whatever ``torch.linalg.inv`` inverts. On the CPU the
    factorisation and the inverse overwrite one copy of the factor (LAPACK works in place on
    the column-major view of the symmetric matrix), so a decomposition needs one matrix of
    scratch memory, not three.
    """
    _require_finite(method, factor)

    def invert(m: Tensor) -> tuple[Tensor]:
        matrix, exponent = _damped(m, shift)
        unscale = 2.0**-exponent
        if _host_path(matrix):
            info = inverse_in_place(matrix)
            if info == 0:
                return (_unscaled(matrix, unscale),)
        else:
            chol, info_tensor = torch.linalg.cholesky_ex(matrix)
            info = int(info_tensor)
            if info == 0:
                return (_unscaled(symmetrised(torch.cholesky_inverse(chol)), unscale),)
        # A narrower attempt goes to fp64's Cholesky first: an LU inverse of the same
        # rounded matrix returns finite garbage for a damped rank-deficient factor.
        if method == "cholesky" or m.dtype != torch.float64:
            raise _not_positive_definite(info)
        matrix, exponent = _damped(m, shift)
        return (_unscaled(symmetrised(torch.linalg.inv(matrix)), 2.0**-exponent),)

    (inv,) = _with_fp64_retry(method, invert, factor, dtype)
    return inv


def damped_cholesky(factor: Tensor, shift: float, dtype: torch.dtype) -> Tensor:
    """The lower-triangular ``L`` with ``F + shift·I = L Lᵀ`` (row-major, zero above the
    diagonal), for method ``"cholesky_solve"``.

    Like ``"cholesky"`` there is no LU fallback: a damped factor that is not positive definite
    in fp64 either is a failure. So is one whose damped inverse would leave ``dtype``'s range
    (the failure ``"cholesky"`` detects in its inverse): ``(LLᵀ)⁻¹_ii = Σ_k (L⁻¹)_ki² ≥
    1/L_ii²``, so a pivot whose ``1/L_ii²`` overflows means an inverse entry at least as large,
    and solves that would scale the gradient by it.

    Raises:
        DecompositionError: if ``factor`` is not finite, the damped factor is not positive
            definite in ``dtype`` nor in fp64, or its inverse exceeds ``dtype``'s range.
    """
    _require_finite("cholesky_solve", factor)

    def factorise(m: Tensor) -> tuple[Tensor]:
        matrix, exponent = _damped(m, shift)
        info = _lower_cholesky_in_place(matrix)
        if info:
            raise _not_positive_definite(info)
        return (_unscaled(matrix, 2.0 ** (exponent // 2)),)

    (chol,) = _with_fp64_retry("cholesky_solve", factorise, factor, dtype)
    if not all_finite([chol.diagonal().square().reciprocal()]):
        raise DecompositionError(f"cholesky_solve failed: the damped inverse exceeds {dtype}'s "
                                 "range (a pivot's reciprocal square overflows)")
    return chol


def pi_split(a: Tensor, g: Tensor) -> float:
    """``π = sqrt((tr A / dim A) / (tr G / dim G))`` (Martens & Grosse's trace-norm split)."""
    a_avg = float(torch.trace(a)) / a.shape[0]
    g_avg = float(torch.trace(g)) / g.shape[0]
    if a_avg <= 0 or g_avg <= 0 or not math.isfinite(a_avg / g_avg):
        return 1.0
    return math.sqrt(a_avg / g_avg)


def factor_shifts(a: Tensor, g: Tensor, damping: float, split: str) -> tuple[float, float]:
    """Damping added to ``A`` and to ``G`` under ``split`` (``"full"`` or ``"pi"``)."""
    if split == "full":
        return damping, damping
    pi = pi_split(a, g)
    root = math.sqrt(damping)
    return pi * root, root / pi


def compute_sides(a: Tensor, g: Tensor, *, method: str, damping: float, split: str,
                  dtype: torch.dtype, sides: Iterable[str] = SIDES
                  ) -> dict[str, tuple[Tensor, ...]]:
    """Decompose or invert the requested factors of one layer.

    Both factors are needed even for one side: the ``pi`` damping split reads both traces.

    Returns:
        Per side, its tensors in the ``side_tensors`` order of ``method``'s state.
    """
    if method == "eigen":
        return {side: eigen_decompose(a if side == "a" else g, dtype) for side in sides}
    shifts = dict(zip(SIDES, factor_shifts(a, g, damping, split), strict=True))

    def damped(side: str) -> Tensor:
        factor = a if side == "a" else g
        if method == "cholesky_solve":
            return damped_cholesky(factor, shifts[side], dtype)
        return damped_inverse(factor, shifts[side], method, dtype)

    return {side: (damped(side),) for side in sides}


def predivided(parts: dict[str, tuple[Tensor, ...]], damping: float
               ) -> dict[str, tuple[Tensor, ...]]:
    """Both factors' eigen decompositions (:func:`compute_sides` of ``eigen``) as the sides of
    a :class:`PredividedEigenState`: ``A``'s eigenbasis, and ``G``'s with ``1/(d_G d_Aᵀ + λ)``
    in the decompositions' dtype."""
    (qa, da), (qg, dg) = parts["a"], parts["g"]
    return {"a": (qa,), "g": (qg, torch.outer(dg, da).add_(damping).reciprocal_())}


def _a_side_first(a: Tensor, g: Tensor) -> bool:
    """Whether ``A``'s state is kept wider than ``G``'s, so its product goes first."""
    return a.element_size() > g.element_size()


def precondition(grad: Tensor, state: SecondOrderState, damping: float) -> Tensor:
    """The preconditioned gradient matrix ``P`` of ``∇W̄`` (shape ``(g_dim, a_dim)``).

    Each product runs in the dtype of the side it applies (its operand cast to it). The
    sides' dtypes may differ (:func:`kept_dtype`); then the wider side multiplies first, on
    the unrounded gradient: a factor kept wide because rounding noise in its operand would be
    amplified must not receive the narrow side's rounded output. The result is in the dtype
    of the side applied last (the caller casts it). ``damping`` is the one in force for
    ``eigen``; a :class:`PredividedEigenState` holds the damping of its inversion instead, and
    the inverse states theirs.
    """
    if isinstance(state, CholeskyState):
        # P = L_G⁻ᵀ L_G⁻¹ ∇W̄ L_A⁻ᵀ L_A⁻¹, four triangular solves in a row-major copy of ∇W̄:
        # with out=B, torch transposes the equation for a row-major B rather than copying it,
        # and passes either layout of L to BLAS as is, so no L is copied or transposed (A's
        # side may run on a transposed copy of ∇W̄ where that is faster: solve_from_right).
        solve = torch.linalg.solve_triangular
        a_chol, g_chol = state.a_chol, state.g_chol

        def solve_g(p: Tensor) -> Tensor:
            p = p.to(g_chol.dtype)
            solve(g_chol, p, upper=False, out=p)
            return solve(g_chol.mT, p, upper=True, out=p)

        if _a_side_first(a_chol, g_chol):
            p = grad.to(a_chol.dtype, memory_format=torch.contiguous_format, copy=True)
            return solve_g(solve_from_right(p, a_chol))
        p = grad.to(g_chol.dtype, memory_format=torch.contiguous_format, copy=True)
        return solve_from_right(solve_g(p), a_chol)
    if isinstance(state, EigenState | PredividedEigenState):
        qg, qa = state.qg, state.qa
        if _a_side_first(qa, qg):
            rotated = qg.T @ (grad.to(qa.dtype) @ qa).to(qg.dtype)
        else:
            rotated = (qg.T @ grad.to(qg.dtype)).to(qa.dtype) @ qa
        if isinstance(state, PredividedEigenState):
            rotated *= state.dgda.to(rotated.dtype)  # damped at the inversion
        else:
            rotated /= torch.outer(state.dg.to(rotated.dtype), state.da.to(rotated.dtype)
                                   ).add_(damping)
        return (qg @ rotated.to(qg.dtype)).to(qa.dtype) @ qa.T
    return inverse_product(grad, state.g_inv, state.a_inv)


def inverse_product(grad: Tensor, g_inv: Tensor, a_inv: Tensor) -> Tensor:
    """``G⁻¹ ∇W̄ A⁻¹`` with symmetric inverses, each product in the dtype of the inverse it
    applies (:func:`precondition`'s rules); the result is in the dtype of the side applied
    last. K-FAC's inverses are exactly symmetric; MKOR's to within fp32 rounding, far below
    the bf16 rounding of the one product that applies ``A⁻¹ᵀ`` for ``A⁻¹``."""
    if _a_side_first(a_inv, g_inv):
        return g_inv @ (grad.to(a_inv.dtype) @ a_inv).to(g_inv.dtype)
    if a_inv.dtype == g_inv.dtype == torch.bfloat16 and a_inv.shape[0] > g_inv.shape[0]:
        # Both sides rounded alike, so either may go first: A's, as (A⁻¹·∇W̄ᵀ)ᵀ (A⁻¹ is
        # exactly symmetric), which oneDNN's bf16 kernels run 17-30% faster than ∇W̄·A⁻¹ when
        # A is the wider side (docs/benchmarks.md); the G product reads that transposed
        # result as is and writes P row-major. fp32 keeps G first: there the orientation
        # gains nothing, and with a rank-deficient factor the order moves the product's
        # rounding error.
        return g_inv @ (a_inv @ grad.to(a_inv.dtype).T).T
    return (g_inv @ grad.to(g_inv.dtype)).to(a_inv.dtype) @ a_inv


def transposes_a_side(rows: int, device: torch.device) -> bool:
    """Whether :func:`solve_from_right` solves a gradient of ``rows`` rows on ``device`` on a
    transposed copy: on the CPU from :data:`TRANSPOSED_SOLVE_MIN_ROWS` rows."""
    threshold = TRANSPOSED_SOLVE_MIN_ROWS
    return device.type == "cpu" and threshold is not None and rows >= threshold


def solve_from_right(p: Tensor, chol: Tensor, *, transposed: bool | None = None) -> Tensor:
    """``p L⁻ᵀ L⁻¹`` (``A``'s side of ``cholesky_solve``, ``L`` lower triangular), row-major,
    in ``L``'s dtype, written into ``p`` where the dtypes agree (``p`` is the caller's working
    copy and must be row-major).

    Args:
        p: ``(rows, n)``, row-major.
        chol: ``L``, ``(n, n)``.
        transposed: Solve ``(p L⁻ᵀ L⁻¹)ᵀ = L⁻ᵀ L⁻¹ pᵀ`` from the left in a transposed copy
            (two buffers alive) instead of from the right in place; None: as
            :func:`transposes_a_side` decides.
    """
    solve = torch.linalg.solve_triangular
    if transposed is None:
        transposed = transposes_a_side(p.shape[0], p.device)
    if not transposed:
        p = p.to(chol.dtype)
        solve(chol.mT, p, upper=True, left=False, out=p)
        return solve(chol, p, upper=False, left=False, out=p)
    t = p.mT.to(chol.dtype, memory_format=torch.contiguous_format, copy=True)
    solve(chol, t, upper=False, out=t)
    solve(chol.mT, t, upper=True, out=t)
    out = p if p.dtype == t.dtype else torch.empty(p.shape, dtype=t.dtype, device=p.device)
    return out.copy_(t.mT)


#: From this many gradient rows (``g_dim``), ``cholesky_solve`` applies ``A``'s side on the CPU
#: as solves from the left on a transposed copy rather than from the right in place; None:
#: never. MKL's right-side solves ran at half the rate of its left-side ones on an AMD EPYC
#: core (28-35 vs 52-80 GFLOP/s with a 257-wide ``L``), so there the two copies pay for
#: themselves from about 32 rows (1.2-1.8x faster ``A`` sides with 64 to 1,024 rows; with
#: fewer the right-side solves are the faster, 2-5x with 2-10 rows). On an Intel Xeon core the
#: right-side solves were the faster at nearly every ResNet-18 and BERT shape (0.84-1.01x the
#: transposed path's time, 257- to 4,608-wide ``L``, 64 to 1,024 rows, ``scripts/solve_sides.py``),
#: and they need one gradient-sized buffer fewer, so the transposed path is taken on AMD CPUs
#: alone, the one vendor where it was measured to pay (docs/benchmarks.md). Other vendors,
#: Hygon's AMD-derived chips included, were not measured; ``python -m scripts.solve_sides``
#: measures both ways on a host.
TRANSPOSED_SOLVE_MIN_ROWS: int | None = (
    64 if host_kernels.cpu_vendor() == "AuthenticAMD" else None)
#: Most gradient rows (or columns) :func:`kept_dtype` multiplies: a sketch of the product
#: whose error it measures, at a small fraction of a decomposition's cost.
PROBE_VECTORS = 32


def probe_vectors(grad: Tensor, side: str) -> Tensor:
    """Up to :data:`PROBE_VECTORS` evenly spaced vectors of ``∇W̄`` that factor ``side``
    multiplies, as the columns of an ``(n, k)`` matrix: rows of ``∇W̄`` for ``A`` (the
    product ``∇W̄ A⁻¹`` is their transpose's ``A⁻¹ ∇W̄ᵀ``, ``A⁻¹`` being symmetric), columns
    for ``G``."""
    vectors = grad.T if side == "a" else grad
    stride = max(1, vectors.shape[1] // PROBE_VECTORS)
    return vectors[:, ::stride][:, :PROBE_VECTORS]


def apply_side(tensors: Sequence[Tensor], kind: str, shift: float, x: Tensor) -> Tensor:
    """One factor's damped inverse times ``x`` (``(n, k)``), from its state tensors of
    ``kind`` and in their dtype, as :func:`precondition` multiplies: ``F⁻¹ x`` for an inverse,
    two triangular solves for a Cholesky factor, ``Q (Qᵀ x ⊘ (d + shift))`` for an eigenbasis
    (the side's own damped inverse; the eigen product damps ``d_G d_Aᵀ`` as a whole)."""
    if kind == "eigen":
        q, d = tensors
        rotated = q.T @ x.to(q.dtype)
        rotated /= (d + shift).unsqueeze(1)
        return q @ rotated
    (matrix,) = tensors
    if kind == "cholesky_solve":
        return torch.cholesky_solve(x.to(matrix.dtype), matrix)
    return matrix @ x.to(matrix.dtype)


def rounding_error(tensors: Sequence[Tensor], kind: str, shift: float, x: Tensor,
                   dtype: torch.dtype, rounded: Sequence[Tensor] | None = None) -> float:
    """``‖F̃⁻¹ x̃ − F⁻¹ x‖ / ‖F⁻¹ x‖`` (Frobenius) with ``F̃⁻¹`` the state rounded to ``dtype``
    (``rounded`` if given, the tensors already rounded so) and ``x̃`` its operand rounded
    alike: how far keeping the state in ``dtype`` moves the product (see
    :func:`apply_side`); 0 for a zero product."""
    exact = apply_side(tensors, kind, shift, x)
    narrow = rounded if rounded is not None else [t.to(dtype) for t in tensors]
    moved = apply_side(narrow, kind, shift, x).to(exact.dtype)
    norm = torch.linalg.vector_norm(exact)
    if float(norm) == 0.0:
        return 0.0
    return float(torch.linalg.vector_norm(moved - exact) / norm)


@traced("rounding_check")
def kept_dtype(tensors: Sequence[Tensor], kind: str, shift: float, grad: Tensor, side: str,
               narrow: torch.dtype, tolerance: float, rounded: Sequence[Tensor] | None = None
               ) -> torch.dtype:
    """The dtype to keep one factor's fresh state in: ``narrow`` (``precondition_dtype``)
    unless, tried on this step's gradient, rounding to it moves the side's product by more
    than ``tolerance`` (:func:`rounding_error` on :func:`probe_vectors`, of ``rounded`` if
    given: the tensors already rounded to ``narrow``); then the state's own dtype.

    Rounding to bf16 moves each entry by at most 2⁻⁸ relative, but where a factor is
    rank-deficient next to the damping (fewer rows than its width; a classifier's input, an
    attention value projection) its inverse has entries of order ``1/λ`` in directions the
    gradient never excites, and the rounding noise excites them: the product can lose all its
    digits.
    """
    error = rounding_error(tensors, kind, shift, probe_vectors(grad, side), narrow, rounded)
    return narrow if error <= tolerance else tensors[0].dtype


def kl_clip_scale(products: float, lr: float, kl_clip: float) -> float:
    """``ν = min(1, sqrt(κ / |Σ (P ⊙ ∇W̄) · lr²|))``; 1 when the sum or ``lr`` is zero (or
    the sum NaN), 0 when it is infinite."""
    if math.isnan(products):
        return 1.0
    # as a ratio of square roots: an overflowing (or infinite) |products|·lr² clips to 0,
    # where the product form read inf as "no clip"; one that underflows to 0 does not clip
    denominator = math.sqrt(abs(products)) * lr
    return 1.0 if denominator == 0.0 else min(1.0, math.sqrt(kl_clip) / denominator)


def kl_product(p: Tensor, grad: Tensor) -> Tensor:
    """One layer's ``Σ (P ⊙ ∇W̄)`` in ``P``'s dtype, as a 0-d tensor (no host sync)."""
    return torch.dot(p.reshape(-1), grad.to(p.dtype).reshape(-1))
