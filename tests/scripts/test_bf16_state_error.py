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
        assert e.kept == "-" and e.guarded_error == e.relative_error  # all within 5%
    assert "| layer | A width | G width | relative error | cosine |" in capsys.readouterr().out


def test_the_tolerance_keeps_the_factors_that_lose_the_product() -> None:
    """Under tiny damping the rank-deficient factors lose their products when rounded; the
    tolerance keeps those in fp32, and what is left is within a few times the tolerance."""
    errors = script.main(["--workload", "tiny-cnn", "--steps", "3", "--damping", "1e-3",
                          "--tolerance", "0.02"])
    lost = [e for e in errors if e.relative_error > 0.2]
    assert lost, "this setting should show the cancellation"
    for e in errors:
        assert (e.kept != "-") == (e.guarded_error != e.relative_error)
        assert e.guarded_error < 0.1, e
    assert all(e.kept != "-" for e in lost)


def test_batches_differ_by_seed_and_default_to_the_fixed_one() -> None:
    make = bench.WORKLOADS["tiny-cnn"].batch
    cpu = bench.torch.device("cpu")
    assert bench.torch.equal(make(cpu)["x"], make(cpu, seed=0)["x"])
    assert not bench.torch.equal(make(cpu)["x"], make(cpu, seed=1)["x"])


def test_mkor_inverses_are_compared_rounded_to_bf16() -> None:
    """``--method mkor``: each layer's product with MKOR's updated inverse factors against
    their bf16 rounding; nothing is kept in fp32, and only rounding separates the two."""
    errors = script.main(["--workload", "tiny-bert", "--steps", "3", "--method", "mkor"])
    assert errors and [e.relative_error for e in errors] == sorted(
        e.relative_error for e in errors)
    for e in errors:
        assert 1e-5 < e.relative_error < 0.1 and e.cosine > 0.99, e
        assert e.kept == "-" and e.guarded_error == e.relative_error
