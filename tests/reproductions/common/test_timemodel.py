"""The alpha-beta time model on fixed inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.distributed import simulate
from reproductions.common.cost import FlopCost
from reproductions.common.shapes import LayerShape
from reproductions.common.timemodel import (
    STAGES,
    AlphaBeta,
    coefficients,
    fit_alpha_beta,
    stage_seconds,
)

NET = AlphaBeta(alpha_s=1e-5, bandwidth=1e9, label="test")


def test_collective_formulas() -> None:
    assert NET.collective("all_reduce", 4e6, 4) == pytest.approx(6e-5 + 6e-3)
    assert NET.collective("broadcast", 4e6, 64) == pytest.approx(6e-5 + 4e-3)
    assert NET.collective("all_gather", 4e6, 5) == pytest.approx(4e-5 + 3.2e-3)
    assert coefficients("reduce_scatter", 10.0, 2) == (1.0, 5.0)
    assert NET.collective("broadcast", 123, 1) == 0.0
    with pytest.raises(ValueError, match="no cost model"):
        coefficients("gather", 1.0, 2)


def test_fit_recovers_the_network() -> None:
    samples = [(op, n, p, NET.collective(op, n, p)) for op in ("all_reduce", "broadcast")
               for n in (1e3, 1e5, 1e7) for p in (2, 4)]
    fitted = fit_alpha_beta(samples, "synthetic")
    assert fitted.alpha_s == pytest.approx(1e-5) and fitted.bandwidth == pytest.approx(1e9)


def test_stage_seconds_of_d_kfac_and_dp_kfac() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(7, 3, bias=False), nn.Linear(3, 2))
    shapes = [LayerShape("0", 7, 3, 5), LayerShape("1", 4, 2, 5)]
    cost = FlopCost("inverse")  # "seconds" = FLOPs, to keep the arithmetic exact
    params = 7 * 3 + 3 * 2 + 2
    d_kfac = stage_seconds(simulate(model, "d-kfac", 2), shapes, cost, NET, 0.5)
    assert list(d_kfac) == list(STAGES)
    factors_bytes = 4 * (7**2 + 3**2 + 4**2 + 2**2)
    assert d_kfac == pytest.approx({
        "FF&BP": 0.5,
        "grad all-reduce": NET.collective("all_reduce", 4 * params, 2),
        "factor comp": 2 * 5 * (7**2 + 3**2 + 4**2 + 2**2),
        "factor comm": NET.collective("all_reduce", factors_bytes, 2),
        "inversion": 2 * (7**3 + 3**3 + 4**3 + 2**3),
        "inverse comm": 0.0,
        "precondition": 2 * (3 * 3 * 7 + 3 * 7 * 7 + 2 * 2 * 4 + 2 * 4 * 4),
        "P broadcast": 0.0,
    })
    dp = stage_seconds(simulate(model, "dp-kfac", 2, assignment="round-robin"), shapes, cost,
                       NET, 0.5)
    assert dp["factor comm"] == 0.0
    assert dp["factor comp"] == 2 * 5 * (7**2 + 3**2)          # rank 0 owns the larger layer
    assert dp["inversion"] == 2 * (7**3 + 3**3)
    # readiness flags (1 byte per factor), then each owner broadcasts its P to the other
    assert dp["inverse comm"] == pytest.approx(NET.collective("all_reduce", 4, 2))
    assert dp["P broadcast"] == pytest.approx(NET.collective("broadcast", 4 * 3 * 7, 2)
                                              + NET.collective("broadcast", 4 * 2 * 4, 2))


def test_fit_clamps_a_negative_inverse_bandwidth_to_an_infinite_bandwidth() -> None:
    from reproductions.common.timemodel import fit_alpha_beta

    # the larger message measured faster: only latency explains the times
    network = fit_alpha_beta([("all_reduce", 4096, 2, 0.002), ("all_reduce", 65536, 2, 0.001)],
                             "noisy")
    assert network.bandwidth == float("inf")
    assert 0.0005 < network.alpha_s < 0.001  # two all-reduce latency terms of 1-2 ms
