"""BLAS and LAPACK kernels on CPU tensors' own memory, where PyTorch has none or adds
whole-matrix passes around its own.

PyTorch has no ``syrk``, and its CPU Cholesky zeroes the triangle LAPACK leaves untouched,
which on the column-major view of a row-major matrix is a strided pass costing a quarter to a
third of the factorisation itself (docs/benchmarks.md). Both run here on the tensor's memory
with no copy. The factorisation calls LAPACK's documented ``?potrf_`` in the library PyTorch
itself links (MKL in the x86 wheels: 1.2-2x faster than SciPy's OpenBLAS on this project's
CPUs, and on torch's thread count already), found by its exported symbol; where that library
exports none, and for ``syrk`` (which PyTorch's library does not export), SciPy's OpenBLAS
runs instead, first given as many threads as torch has so a process pinned to one thread is
not oversubscribed. The mirror that completes a ``syrk`` result is NumPy's transposed copy,
faster than PyTorch's strided one.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.linalg import blas, lapack
from threadpoolctl import ThreadpoolController
from torch import Tensor

from core.timing import traced

_SYRK: dict[torch.dtype, Callable[..., Any]] = {torch.float32: blas.ssyrk,
                                                 torch.float64: blas.dsyrk}
_POTRF: dict[torch.dtype, Callable[..., Any]] = {torch.float32: lapack.spotrf,
                                                  torch.float64: lapack.dpotrf}
_POTRI: dict[torch.dtype, Callable[..., Any]] = {torch.float32: lapack.spotri,
                                                  torch.float64: lapack.dpotri}
#: dtypes the kernels here take.
DTYPES = tuple(_SYRK)
_INT = ctypes.POINTER(ctypes.c_int)


def _linked_lapack(name: str) -> Callable[..., None] | None:
    """The LP64 Fortran LAPACK routine ``name`` (a ``?potrf_`` or ``?potri_``: arguments
    ``uplo, n, a, lda, info``) exported by PyTorch's own CPU library, or None where that library
    is not found or does not export it."""
    for path in sorted((Path(torch.__file__).parent / "lib").glob("*torch_cpu.*")):
        try:
            routine = getattr(ctypes.CDLL(str(path)), name)
        except (OSError, AttributeError):
            continue
        routine.restype = None
        routine.argtypes = [ctypes.c_char_p, _INT, ctypes.c_void_p, _INT, _INT]
        return routine
    return None


#: ``?potrf_`` of PyTorch's own LAPACK, per dtype (None: SciPy's runs). A module attribute, so
#: tests can run either.
LINKED_POTRF: dict[torch.dtype, Callable[..., None] | None] = {
    torch.float32: _linked_lapack("spotrf_"), torch.float64: _linked_lapack("dpotrf_")}
#: ``?potri_`` of PyTorch's own LAPACK, per dtype, likewise.
LINKED_POTRI: dict[torch.dtype, Callable[..., None] | None] = {
    torch.float32: _linked_lapack("spotri_"), torch.float64: _linked_lapack("dpotri_")}
_openblas_threads = 0


def cpuinfo_field(key: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first ``key`` line's value in ``cpuinfo`` (Linux's ``/proc/cpuinfo``), such as
    ``vendor_id`` or ``model name``; None where that file is absent, unreadable or has no such
    value (whatever follows it then takes its default rather than stop an import)."""
    try:
        text = cpuinfo.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip() or None
    return None


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's vendor string, such as ``GenuineIntel`` or ``AuthenticAMD`` (None where
    ``cpuinfo`` names none: :func:`cpuinfo_field`).

    Some BLAS kernels run at rates that differ by vendor, so a few kernel choices here follow
    it (:data:`core.inverse.TRANSPOSED_SOLVE_MIN_ROWS`).
    """
    return cpuinfo_field("vendor_id", cpuinfo)


def match_blas_threads() -> None:
    """Give SciPy's OpenBLAS as many threads as torch has (``torch.set_num_threads``). The
    loaded libraries are looked up only when the count changes (first use included)."""
    global _openblas_threads
    threads = torch.get_num_threads()
    if threads != _openblas_threads:
        ThreadpoolController().select(internal_api="openblas").limit(limits=threads)
        _openblas_threads = threads


@traced("syrk")
def syrk_upper(out: Tensor, m: Tensor, scale: float, beta: float) -> None:
    """``out ← beta·out + scale·m mᵀ`` on and above ``out``'s diagonal, in place.

    ``out`` is row-major, so BLAS sees its transpose and fills its "lower" triangle; ``m`` goes
    to BLAS without a copy when either it or its transpose is contiguous.

    Raises:
        ValueError: if ``out`` is not contiguous (BLAS would write to a copy of it).
    """
    if not out.is_contiguous():
        raise ValueError("syrk_upper writes into a contiguous (row-major) out; pass "
                         "out.contiguous() and copy the result back")
    if m.shape[1] == 0:  # no rows: BLAS rejects k = 0, and beta·out is the whole answer
        if beta == 0.0:
            out.zero_()
        else:
            out.mul_(beta)
        return
    match_blas_threads()
    m = m.detach()
    if m.is_contiguous():  # (dim, rows) row-major = (rows, dim) column-major: mᵀ·m in BLAS
        a, trans = m.T.numpy(), 1
    elif m.T.is_contiguous():  # column-major (dim, rows): m·mᵀ in BLAS
        a, trans = m.numpy(), 0
    else:
        a, trans = m.contiguous().T.numpy(), 1
    _SYRK[out.dtype](scale, a, beta=beta, c=out.numpy().T, trans=trans, lower=1, overwrite_c=1)


#: Most rows per panel of :func:`mirror_upper`: a 64-row panel and its transposed target stay
#: in cache while NumPy copies it.
MIRROR_PANEL = 64
#: Addresses this many bytes apart fall in the same set of the L1 data cache (64 sets of
#: 64-byte lines on this project's x86 CPUs, Intel and AMD alike).
L1_ALIAS_BYTES = 4096
#: Lines of one L1 set a panel's column may take. Both hosts' L1 is 12-way (48 KiB, 64 sets);
#: 8 leaves room for the lines the copy writes, and panels sized by 12 measured the same
#: within the noise on the AMD EPYC host.
L1_WAYS = 8


def mirror_panel(row_bytes: int) -> int:
    """Rows per panel of :func:`mirror_upper` for a matrix whose rows are ``row_bytes`` long.

    The transposed copy reads one column of a panel at a time, a line from each of its rows.
    Where the row length shares a large power of two with :data:`L1_ALIAS_BYTES` (factors
    1,024 or 2,048 wide, ``G`` of 512 channels, ``A`` of 4,608), those lines fall in a few L1
    sets and a 64-row panel evicts its own lines; the panel is cut to what those sets hold, at
    least 16 rows. On the AMD EPYC host this mirrors a 1,024-wide factor in 0.72 ms instead of
    1.45, a 2,048 one in 1.75 instead of 4.28 and a 4,608 one in 12.8 instead of 17.1; odd
    widths keep 64 rows (docs/benchmarks.md).
    """
    sets = L1_ALIAS_BYTES // math.gcd(row_bytes, L1_ALIAS_BYTES)
    return min(MIRROR_PANEL, max(16, L1_WAYS * sets))


@functools.cache
def _strictly_lower(size: int) -> np.ndarray:
    return np.tri(size, size, -1, dtype=bool)


@traced("mirror")
def mirror_upper(matrix: Tensor) -> None:
    """Copy the upper triangle of the square, row-major CPU ``matrix`` onto its lower one, in
    place, so that it is exactly symmetric (what ``syrk`` leaves it needing).

    NumPy's copy of a transposed panel is 1.3-1.6x faster than PyTorch's strided block copy on
    factors of 512-4,608 (docs/benchmarks.md); panels are :func:`mirror_panel` rows.
    """
    a = matrix.detach().numpy()
    n = a.shape[0]
    panel = mirror_panel(a.strides[0])
    for r0 in range(0, n, panel):
        r1 = min(r0 + panel, n)
        diagonal = a[r0:r1, r0:r1]
        np.copyto(diagonal, diagonal.T, where=_strictly_lower(r1 - r0))
        a[r1:, r0:r1] = a[r0:r1, r1:].T


def _lapack_in_place(linked: dict[torch.dtype, Callable[..., None] | None],
                     fallback: dict[torch.dtype, Callable[..., Any]], matrix: Tensor,
                     lapack_lower: bool, **options: int) -> int:
    """Run a LAPACK routine of arguments ``uplo, n, a, lda, info`` on the column-major view
    ``matrix.T`` of the contiguous ``matrix`` (the same memory), on LAPACK's lower triangle
    (the row-major upper one) if ``lapack_lower``; its ``info``. PyTorch's own (``linked``)
    where exported, else SciPy's (``fallback``, given ``options``)."""
    if not matrix.is_contiguous():
        raise ValueError("the LAPACK kernels in place need a contiguous (row-major) matrix")
    routine = linked.get(matrix.dtype)
    if routine is not None:
        n, info = ctypes.c_int(matrix.shape[0]), ctypes.c_int(0)
        routine(b"L" if lapack_lower else b"U", ctypes.byref(n), matrix.data_ptr(),
                ctypes.byref(n), ctypes.byref(info))
        return info.value
    match_blas_threads()
    *_, info = fallback[matrix.dtype](matrix.numpy().T, lower=int(lapack_lower), **options)
    return int(info)


@traced("potrf")
def cholesky_in_place(matrix: Tensor, *, lower_in_matrix: bool) -> int:
    """Cholesky-factor the symmetric, row-major (contiguous) ``matrix`` in its own memory;
    LAPACK's ``info`` (0 on success, else the order of the first minor that is not positive
    definite).

    LAPACK ``potrf`` works on the column-major view ``matrix.T`` (the same matrix) and writes
    the factor over one triangle of it: with ``lower_in_matrix`` the row-major ``matrix`` then
    holds ``L`` (``A = L Lᵀ``) on and below its diagonal, otherwise ``Lᵀ`` on and above it. The
    other triangle keeps the input's entries: neither ``potri`` nor a triangular solve reads
    them, and a caller that needs zeros there writes them in one contiguous pass.
    """
    # LAPACK's upper triangle of the column-major view is the row-major lower triangle.
    return _lapack_in_place(LINKED_POTRF, _POTRF, matrix, lapack_lower=not lower_in_matrix,
                            overwrite_a=1, clean=0)


@traced("potri")
def inverse_from_cholesky_in_place(matrix: Tensor) -> int:
    """Overwrite ``matrix``, holding ``Lᵀ`` on and above its diagonal as
    :func:`cholesky_in_place` leaves it with ``lower_in_matrix=False``, with ``(L Lᵀ)⁻¹``, exactly
    symmetric; LAPACK's ``info`` (0 when done, else the order of a zero pivot of ``L``, and
    ``matrix`` is spent).

    ``potri`` writes one triangle of the inverse in place and :func:`mirror_upper` the other;
    ``torch.cholesky_inverse`` fills it in a strided pass that costs a tenth of the inverse of
    a 4,608-wide factor (docs/benchmarks.md).
    """
    info = _lapack_in_place(LINKED_POTRI, _POTRI, matrix, lapack_lower=True, overwrite_c=1)
    if info == 0:
        mirror_upper(matrix)
    return info
