"""The three reproductions (``osawa2018``, ``dpkfac``, ``mkor``) on the shared ``core``, and
``common``, what their entry points share.

Importing the package asks PyTorch to back large CPU tensors with transparent huge pages
(``THP_MEM_ALLOC_ENABLE``, unless the caller set it): K-FAC allocates factors, inverses and
preconditioned gradients afresh on every update, and faulting them in 4 KiB pages is a visible
share of a CPU step (docs/benchmarks.md, "Huge pages"). PyTorch reads the variable at its first
CPU allocation, so this takes effect for the entry points (``python -m reproductions...``) and
not in a process that already allocated tensors; GPU memory is unaffected.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
