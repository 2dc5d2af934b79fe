"""scripts/bf16_state_error.py compares bf16 and fp32 states per layer on a tiny model."""

from __future__ import annotations

import pytest

from scripts import bench
from scripts import bf16_state_error as script


def test_every_preconditioned_layer_is_compared_and_only_rounding_separates_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    errors = script.main(["--workload", "tiny-cnn", "--steps", "3", "--damping", "0.1"])
    assert [e.relative_error for e in errors] == sorted(e.relative_error for e in errors)
    assert {e.name for e in errors} == {"0", "2", "4", "7"}
    for e in errors:
        assert 0 < e.relative_error < 0.1 and e.cosine > 0.99
    assert "| layer | A width | G width | relative error | cosine |" in capsys.readouterr().out


def test_batches_differ_by_seed_and_default_to_the_fixed_one() -> None:
    make = bench.WORKLOADS["tiny-cnn"].batch
    cpu = bench.torch.device("cpu")
    assert bench.torch.equal(make(cpu)["x"], make(cpu, seed=0)["x"])
    assert not bench.torch.equal(make(cpu)["x"], make(cpu, seed=1)["x"])
