"""The tables script: exact iterations, official hyper-parameters, simulated ledgers, the study."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reproductions.common.tables import load_tables
from reproductions.osawa2018 import tables
from reproductions.osawa2018.study import StudyRun, plan

#: ResNet-50's K-FAC factors as packed upper triangles, and its trainable parameters
#: (KFAC_MATH.md "Facts to check against"; BatchNorm adds 53,120 parameters).
TRIANGLES = 76_967_027
PARAMETERS = 25_557_032


def test_iterations_are_computed_from_the_configs() -> None:
    table = tables.iterations_table()
    assert table.rows == [
        [4096, 35, 10_948, "authors' repository", 10_948],
        [8192, 35, 5_478, "authors' repository", 5_474],
        [16384, 35, 2_737, "authors' repository", 2_737],
        [32768, 45, 1_760, "authors' repository", 1_760],
        [65536, 60, 1_173, "authors' repository", 1_173],
        [131072, 80, 782, "authors' repository", 782],
        [131072, 100, 978, "abstract", 978],
    ]


def test_hyperparameters_are_printed_from_the_official_configs() -> None:
    table = tables.hyperparameter_table()
    assert table.rows[0] == [4096, "bs4k.resnet50.128gpu.json", "configs/imagenet_bs4k.json",
                             35, 0.00818, 1, 11, 53, 0.997, 0.00025, 0.4]
    assert table.rows[-1][3:] == [80, 0.07, 1, 3.0, 95.0, 0.93, 0.0001, 1.0]
    assert "| 8,192 | bs8k.resnet50.256gpu.json |" in table.markdown()


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
    table = tables.communication_table((p,))
    assert [row[1] for row in table.rows][:3] == [
        "osawa (this code)", "osawa, paper's design", "osawa, chainerkfac as coded"]
    assert len(table.rows) == 7 and table.column("paper (MB)") == [None] * 7
    # at 128 GPUs, one worker per layer and one idle worker standing for the other 74
    ranks, weights = tables.representative_ranks(model, "osawa", 128, options)
    assert ranks == list(range(55)) and weights == [1] * 54 + [74]


def test_large_batch_table_reads_the_committed_study_results(tmp_path: Path) -> None:
    table = tables.large_batch_table(tables.DEFAULT_RESULTS)
    assert table.kind == "small" and table.column("mini-batch") == [256, 2048]
    final = table.column("ours: K-FAC final (%)") + table.column("ours: SGD final (%)")
    assert all(isinstance(v, float) and 50 < v <= 100 for v in final)
    assert table.notes and "Not the paper's experiment" in table.notes
    with pytest.raises(FileNotFoundError, match="study"):
        tables.large_batch_table(tmp_path)
    tables.main(["--sections", "O1", "O2", "--write", str(tmp_path / "t.json")])
    paper, written = load_tables(tmp_path / "t.json")
    assert paper == "osawa2018" and [t.id for t in written] == ["O1", "O2"]


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
