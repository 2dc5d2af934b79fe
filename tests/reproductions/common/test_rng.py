"""Every generator a run draws from comes back exactly after a checkpoint round trip."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from reproductions.common.checkpoint import load_latest_checkpoint, save_checkpoint
from reproductions.common.rng import capture_rng_state, restore_rng_state


def draw() -> tuple:
    return (random.random(), random.gauss(0, 1), float(np.random.rand()),
            torch.rand(3).tolist())


def test_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    save_checkpoint(tmp_path, 0, {"rng": capture_rng_state()})
    expected = draw()
    draw()
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None
    restore_rng_state(loaded["rng"])
    assert draw() == expected
