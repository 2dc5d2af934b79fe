"""Keep freed CPU memory in the process, so each training step reuses it instead of faulting
it in afresh from the kernel.

PyTorch's CPU allocator has no cache of its own: every tensor goes to C's ``malloc`` and back.
glibc serves a block above its mmap threshold (at most 32 MiB) from a fresh mapping and unmaps
it when freed, and gives the top of its heap back to the system once more than its trim
threshold is free there. So a training step whose tensors are large (the small BERT's 33 MB
logits and their gradients, K-FAC's batch factors, decomposition copies and preconditioned
gradients) faults most of its memory in again every step: on this project's 2-core VM the small
BERT's first-order step took 0.82-1.63 s, of which 0.02-0.75 s was kernel time spent on some
333 fresh huge pages and 5,300-6,900 small ones per step, against 0.77-0.87 s with almost no
kernel time when freed memory stays in the heap (docs/benchmarks.md, "Freed memory").

:func:`keep_freed_memory` makes glibc keep it: no block is served by a mapping of its own
(``M_MMAP_MAX`` 0) and the heap is not trimmed (``M_TRIM_THRESHOLD`` at its maximum). What a
step frees is reused by the next, as a GPU's caching allocator does; the process's resident
memory stays at its peak, so a peak measured from it counts the heap's holes too (the
benchmark measures memory with freed memory returned). An explicit ``malloc_trim(0)`` still
returns free pages.
"""

from __future__ import annotations

import ctypes

#: ``mallopt`` parameters (glibc's ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: The largest trim threshold ``mallopt`` takes (an ``int``): free memory at the heap's top is
#: kept below 2 GiB.
MAX_TRIM_THRESHOLD = 2**31 - 1
#: glibc's defaults, which ``keep=False`` puts back: at most this many mapped blocks, and the
#: heap's top trimmed above 128 KiB free.
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024


def keep_freed_memory(keep: bool = True) -> bool:
    """Make this process's ``malloc`` (glibc) keep freed memory for reuse, or (``keep``
    False) return it to the system again.

    It applies to allocations and frees from now on, in this process only (a process started
    later calls it itself). Blocks mapped before are still unmapped when freed. ``keep=False``
    puts back glibc's default values and returns the free pages the heap holds
    (``malloc_trim``); glibc's adjustment of its thresholds to the sizes freed stays off once
    any is set, so the mmap threshold then stays at 128 KiB, and blocks that fit in the heap's
    free space are served from it (faulted in again, their pages having been returned).

    Returns:
        Whether both settings were applied: False where the C library is not glibc (musl,
        macOS, Windows), which then keeps its own behaviour.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mapped, trim = (0, MAX_TRIM_THRESHOLD) if keep else (DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
    applied = bool(mallopt(M_MMAP_MAX, mapped)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
    if not keep:
        malloc_trim(0)
    return applied
