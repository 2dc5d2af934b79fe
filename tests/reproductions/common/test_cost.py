"""FLOP counts and measured-time scaling against hand-computed values on a small model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.distributed import simulate
from reproductions.common import kernels
from reproductions.common.cost import FlopCost, busiest, worker_compute
from reproductions.common.kernels import Budget, KernelTimes
from reproductions.common.shapes import LayerShape, layer_shapes


def small_model() -> nn.Module:
    """Conv 3→4 (3×3, no bias) on 8×8 inputs, then Linear 256→10 (bias)."""
    with torch.device("meta"):
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.Flatten(),
                             nn.Linear(256, 10))


SHAPES = [LayerShape("0", 27, 4, 2 * 64), LayerShape("2", 257, 10, 2)]
CONV_FACTORS = 2 * 128 * (27**2 + 4**2)       # 190,720
FC_FACTORS = 2 * 2 * (257**2 + 10**2)         # 264,596
CONV_EIGEN = 9 * (27**3 + 4**3)               # 177,723
FC_EIGEN = 9 * (257**3 + 10**3)               # 152,780,337


def test_layer_shapes_rows() -> None:
    assert layer_shapes(small_model(), 2, 8) == SHAPES


def test_d_kfac_every_worker_does_everything() -> None:
    report = simulate(small_model(), "d-kfac", 2, average_grads=False)
    for w in worker_compute(report, SHAPES, FlopCost("eigen")):
        assert (w.factors, w.inversion) == (CONV_FACTORS + FC_FACTORS, CONV_EIGEN + FC_EIGEN)
        assert w.precondition == 2 * 2 * (4 * 4 * 27 + 4 * 27 * 27 + 10 * 10 * 257
                                          + 10 * 257 * 257)


def test_dp_kfac_owners_build_only_their_layers() -> None:
    report = simulate(small_model(), "dp-kfac", 2, average_grads=False,
                      assignment="round-robin")
    workers = worker_compute(report, SHAPES, FlopCost("eigen"))
    assert [(w.factors, w.inversion) for w in workers] == [(CONV_FACTORS, CONV_EIGEN),
                                                           (FC_FACTORS, FC_EIGEN)]
    assert busiest(workers).rank == 1
    mpd = worker_compute(simulate(small_model(), "mpd-kfac", 2, average_grads=False,
                                  assignment="round-robin"), SHAPES, FlopCost("cholesky"))
    assert [(w.factors, w.inversion) for w in mpd] == [
        (CONV_FACTORS + FC_FACTORS, 27**3 + 4**3), (CONV_FACTORS + FC_FACTORS, 257**3 + 10**3)]


def test_kernel_times_scale_and_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut GEMMs scale linearly; large decompositions follow the fitted c·n³."""
    monkeypatch.setattr(kernels, "timed", lambda fn, reps, device, warm_up=True: 2.0)
    times = KernelTimes("eigen", Budget(gemm_macs=1e4, min_rows=16, direct_dim=8,
                                        anchor_dims=(4, 8), reps=1))
    assert times.factor(10**6, 8) == pytest.approx(2.0 * 10**6 / 157)  # cut = ⌈1e4 / 64⌉
    assert times.factor(100, 8) == 2.0                                 # short enough: as is
    assert times.precondition(4, 8) == 2 * (2.0 + 2.0)                 # two GEMM pairs
    c = 2.0 * (4**3 + 8**3) / (4**6 + 8**6)
    assert times.cubic_coefficient == pytest.approx(c)
    assert times.decomposition(16) == pytest.approx(c * 16**3)
    assert times.decomposition(8) == 2.0
    # the note names the CPU the times belong to (they move between hosts)
    monkeypatch.setattr(kernels.host_kernels, "cpuinfo_field", lambda key: f"{key}: Test CPU")
    assert times.describe().startswith("Kernels timed on CPU (model name: Test CPU), ")
