"""Capture and restore every random generator a training run draws from, for exact resume.

Covered: Python's ``random``, numpy's global generator (``datasets`` and some collators use it),
torch's CPU generator and, when CUDA is available, every CUDA device's generator. The captured
state holds only tensors, lists, tuples, numbers and strings, so it can be stored in a checkpoint
loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Snapshot the generators.

    Returns:
        ``{"python": tuple, "numpy": list, "torch": ByteTensor, "cuda": [ByteTensor] or None}``.
    """
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back to a :func:`capture_rng_state` snapshot.

    The CUDA states are restored when this process has CUDA and as many devices as the
    snapshot; otherwise they are skipped with a warning (e.g. a GPU run resumed on a CPU).

    Args:
        state: A snapshot, possibly after a save/load round trip (lists in place of tuples).
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda is None:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
    else:
        warnings.warn(f"the RNG snapshot has {len(cuda)} CUDA generator(s) but this process has "
                      f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; CUDA "
                      "random streams will differ from the original run", RuntimeWarning,
                      stacklevel=2)
