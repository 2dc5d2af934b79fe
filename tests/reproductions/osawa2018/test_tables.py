"""The tables script: exact iterations, official hyper-parameters, simulated ledgers, the study."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reproductions.osawa2018 import tables
from reproductions.osawa2018.study import StudyRun, plan

#: ResNet-50's K-FAC factors as packed upper triangles, and its trainable parameters
#: (KFAC_MATH.md "Facts to check against"; BatchNorm adds 53,120 parameters).
TRIANGLES = 76_967_027
PARAMETERS = 25_557_032


def test_iterations_are_computed_from_the_configs() -> None:
    table = tables.iterations_table()
    assert "| 4,096 | 35 | 10,948 (authors' repository) | 10,948 |  |" in table
    assert "| 8,192 | 35 | 5,478 (authors' repository) | 5,474 | differs by +4 |" in table
    assert "| 131,072 | 100 | 978 (abstract) | 978 |  |" in table
    assert "| 32,768 | 45 | 1,760 (authors' repository) | 1,760 |  |" in table


def test_hyperparameters_are_printed_from_the_official_configs() -> None:
    table = tables.hyperparameter_table()
    assert "| 4,096 | 35 | 0.00818 | 1 | 11 | 53 | 0.997 | 0.00025 | 0.4 |" in table
    assert "| 131,072 | 80 | 0.07 | 1 | 3 | 95 | 0.93 | 0.0001 | 1 |" in table


def test_simulated_per_worker_traffic_of_the_three_osawa_accountings() -> None:
    model = tables.resnet50_meta()
    p = 4
    options = {**tables.RECIPE_OPTIONS, "assignment": "contiguous"}
    ranks, weights = tables.representative_ranks(model, "osawa", p, options)
    assert ranks == [0, 1, 2, 3] and weights == [1] * 4
    report = tables.simulate(model, "osawa", p, ranks=ranks, **options)
    ours = tables.per_worker(report, weights)
    ideal = tables.per_worker(report, weights, scheme="ideal")
    coded = tables.per_worker(report, weights, scheme="as-coded")
    ring = (p - 1) / p
    assert ours.mean("grad_allreduce") == pytest.approx(2 * ring * 4 * PARAMETERS, rel=1e-3)
    assert ideal.mean("grad_allreduce") == pytest.approx(ring * 4 * PARAMETERS, rel=1e-3)
    assert ours.mean("factor_comm") == pytest.approx(ring * 4 * TRIANGLES, rel=1e-6)
    assert coded.mean("factor_comm") == pytest.approx(2 * ring * 4 * TRIANGLES, rel=1e-6)
    assert ideal.mean() < ours.mean() < coded.mean()
    # at 128 GPUs, one worker per layer and one idle worker standing for the other 74
    ranks, weights = tables.representative_ranks(model, "osawa", 128, options)
    assert ranks == list(range(55)) and weights == [1] * 54 + [74]


def test_large_batch_table_reads_the_committed_study_results() -> None:
    table = tables.large_batch_table(tables.DEFAULT_RESULTS)
    assert "O2. Large-batch study, small scale" in table
    assert "| 256 |" in table and "| 2,048 |" in table
    with pytest.raises(FileNotFoundError, match="study"):
        tables.large_batch_table(Path("/nonexistent"))


def test_study_plan_builds_valid_runs() -> None:
    study = json.loads((tables.CONFIG_DIR / "fmnist_study.json").read_text())
    name, runs = plan(study, quick=False)
    assert name == "fmnist_large_batch"
    assert {r.overrides["batch_size"] for r in runs} == {256, 512, 1024, 2048, 4096, 8192, 16384}
    big = next(r for r in runs if r.name == "kfac_bs16384")
    assert big.overrides["micro_batch_size"] == study["max_micro_batch"]
    quick_name, quick = plan(study, quick=True)
    assert quick_name.endswith("quick") and [r.name for r in quick] == [
        "kfac_bs256", "kfac_bs2048", "sgd_bs256", "sgd_bs2048"]
    command = StudyRun("x", "fmnist_default", {"lr": 0.1, "name": "n"}).command(
        Path("out"), "disabled", None)
    assert command[-3:] == ["--set", "lr=0.1", 'name="n"']
