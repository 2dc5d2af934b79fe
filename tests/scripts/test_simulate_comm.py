"""scripts/simulate_comm.py: its table reads the simulated ledgers, options included."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from scripts.simulate_comm import main, table

WORLD = 4
DIMS = [(1024, 512), (513, 256)]  # (a, g): Linear(1023, 512), Linear(512, 256), with biases


def _inverse_comm_mean(text: str, strategy: str) -> float:
    row = next(line for line in text.splitlines() if line.startswith(f"| {strategy} |"))
    return float(re.split(r"\s*\|\s*", row)[3].split(" / ")[0])


def test_pre_divided_eigenvalues_add_a_times_g_to_comm_opts_state_broadcast() -> None:
    """comm-opt broadcasts each layer's state from its owner to the 3 other ranks: per layer
    a² + a + g² + g values, or a² + g² + a·g pre-divided; the mean over the 4 ranks is 3/4 of
    it (fp32, MB = 10⁶ bytes, one decimal)."""
    model = nn.Sequential(nn.Linear(1023, 512), nn.ReLU(), nn.Linear(512, 256)).to("meta")
    expected = {}
    for prediv in (False, True):
        values = sum(a * a + g * g + (a * g if prediv else a + g) for a, g in DIMS)
        expected[prediv] = round(values * 4 * (WORLD - 1) / WORLD / 1e6, 1)
        text = table("tiny", model, WORLD, {"prediv_eigenvalues": prediv}, torch.float32, 0.5)
        assert _inverse_comm_mean(text, "comm-opt") == expected[prediv]
    assert expected[True] != expected[False]


def test_a_world_size_below_two_names_the_minimum_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--world-size 0`` said ``0 is not >= 1``, and ``1`` then ``1 is not >= 2``."""
    for value in ("0", "1", "two"):
        with pytest.raises(SystemExit) as info:
            main(["--world-size", value])
        assert info.value.code == 2
        assert ">= 2" in capsys.readouterr().err
