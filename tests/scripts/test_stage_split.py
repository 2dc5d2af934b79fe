"""scripts/stage_split.py attributes each stage's time to the calls in it."""

from __future__ import annotations

import pytest
import torch

from core.timing import StageTimer, traced
from scripts import stage_split


@traced("demo_kernel")
def _demo_kernel(x: torch.Tensor) -> torch.Tensor:
    return x @ x


def test_split_gives_each_op_to_its_innermost_named_range_and_sums_to_the_stage() -> None:
    x = torch.randn(64, 64)
    timer = StageTimer()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with timer.stage("factors"):
            _demo_kernel(x)
            _demo_kernel(x)
            torch.add(x, x)
        with timer.stage("inversion"):
            x.sum()
        x.mul(2.0)  # outside every stage: not counted
    events = profile.events()
    parts = stage_split.split(events)
    assert set(parts) == {"factors", "inversion"}
    factors = parts["factors"]
    assert set(factors) == {"demo_kernel", "aten::add", stage_split.BETWEEN_OPS}
    assert factors["demo_kernel"].calls == 2 and factors["aten::add"].calls == 1
    assert set(parts["inversion"]) == {"aten::sum", stage_split.BETWEEN_OPS}
    # the parts' self times add up to the stage range's duration
    for stage, found in parts.items():
        ranges = [e for e in events if e.name == f"core.stage.{stage}"]
        assert sum(p.seconds for p in found.values()) == pytest.approx(
            sum(e.cpu_time_total for e in ranges) / 1e6, rel=1e-6)


def test_kfac_inverse_split_counts_one_decomposition_per_factor() -> None:
    out = stage_split.main(["--workload", "tiny-cnn", "--method", "kfac-inverse",
                            "--steps", "1"])
    factors = 2 * out["layers"]
    inversion, forming = out["parts"]["inversion"], out["parts"]["factors"]
    assert inversion["potrf"]["calls"] == inversion["potri"]["calls"] == factors
    # checked before and after each decomposition; one damped copy and state copy each
    assert inversion["finiteness_check"]["calls"] == 2 * factors
    assert inversion["damped_copy"]["calls"] == inversion["state_copy"]["calls"] == factors
    assert forming["running_average"]["calls"] == factors
    assert forming["batch_finiteness_check"]["calls"] == out["layers"]
    for stage, seconds in out["profiled"].items():
        assert seconds == pytest.approx(sum(p["seconds"] for p in out["parts"][stage].values()))
