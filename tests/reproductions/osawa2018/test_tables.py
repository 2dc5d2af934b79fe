"""The tables script: exact iterations, official hyper-parameters, simulated ledgers, the study."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from reproductions.common.checkpoint import CheckpointError
from reproductions.common.cost import KernelRates
from reproductions.common.results import ResultsError
from reproductions.common.shapes import LayerShape
from reproductions.common.tables import load_tables
from reproductions.common.timemodel import AlphaBeta
from reproductions.osawa2018 import study, tables
from reproductions.osawa2018.study import StudyRun, finished, plan
from tests.reliability.test_bad_input import Parsed, assert_clear_error, invoke

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
    ideal = tables.per_worker(tables.accounted(report, "ideal"), weights)
    coded = tables.per_worker(tables.accounted(report, "as-coded"), weights)
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
    assert "MB = 10⁶ bytes" in table.notes  # not MiB: O4's MB were undefined
    # at 128 GPUs, one worker per layer and one idle worker standing for the other 74
    ranks, weights = tables.representative_ranks(model, "osawa", 128, options)
    assert ranks == list(range(55)) and weights == [1] * 54 + [74]


def test_large_batch_table_reads_the_committed_study_results(tmp_path: Path) -> None:
    table = tables.large_batch_table(tables.DEFAULT_RESULTS)
    assert table.kind == "small"
    assert table.column("mini-batch") == [256, 512, 1024, 2048, 4096, 8192, 16384]
    kfac, sgd = (table.column(f"ours: {o} iterations to target") for o in ("K-FAC", "SGD"))
    assert kfac[4:6] == [37, 26] and sgd[4:6] == ["not reached"] * 2  # the committed study
    final = table.column("ours: K-FAC final (%)") + table.column("ours: SGD final (%)")
    assert all(isinstance(v, float) and 50 < v <= 100 for v in final)
    assert table.notes and "Not the paper's experiment" in table.notes
    with pytest.raises(ResultsError, match="study"):  # a user error, reported in one line
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


@pytest.mark.parametrize(("argv", "needle"), [
    (["--jobs", "0"], "--jobs"),  # hung: the scheduling loop never started a run
    (["--batch-sizes", "100"], "256, 512, 1024"),  # KeyError: names the study's sizes
    (["--optimizers", "kfac", "--batch-sizes", "256", "100"], "--batch-sizes"),
    (["--study", "/nonexistent/study.json"], "--study"),  # FileNotFoundError
    (["--study", str(Path(__file__))], "--study"),  # not JSON
    (["--study", str(Path(__file__).parents[3] / "reproductions" / "osawa2018" / "results"
                     / "tables.json")], "--study"),  # JSON of another shape: a KeyError
])
def test_study_refuses_bad_options_in_one_line(argv: list[str], needle: str,
                                               tmp_path: Path) -> None:
    """Every option is checked before a run starts; a bad one ends the study with one line."""
    never_run = mock.patch.object(study, "execute", side_effect=Parsed)
    outcome, stderr = invoke(study.main, [*argv, "--out", str(tmp_path / "runs"),
                                          "--results-dir", str(tmp_path / "results")], never_run)
    assert_clear_error(outcome, stderr, set())
    assert needle in stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--sections", "O4", "--gpus", "0"], "argument --gpus: 0 is not >= 1"),  # ValueError
    (["--sections", "O4", "--gpus", "-8"], "argument --gpus: -8 is not >= 1"),
    (["--sections", "O5", "--rates", "/nonexistent/rates.json"],  # FileNotFoundError
     "invalid --rates='/nonexistent/rates.json': expected a kernel-rates file (No such file"),
    (["--sections", "O5", "--rates", __file__], "(not JSON: "),  # JSONDecodeError
])
def test_tables_refuse_bad_options_in_one_line(argv: list[str], needle: str) -> None:
    """Each ended in a traceback; now argparse's exit, status 2, one line naming the option."""
    never_measured = mock.patch.object(tables, "measure_rates", side_effect=Parsed)
    outcome, stderr = invoke(tables.main, [*argv, "--write", "-"], never_measured)
    assert_clear_error(outcome, stderr, set())
    assert needle in stderr.strip().splitlines()[-1]


def test_tables_report_a_missing_results_dir_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--sections O2 --results-dir DIR`` without results files: a FileNotFoundError traceback;
    now status 1 and one line naming the directory and the command that fills it."""
    with pytest.raises(SystemExit) as info:
        tables.main(["--sections", "O2", "--results-dir", str(tmp_path / "none"), "--write", "-"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{tmp_path / 'none'}: no results files" in err
    assert "python -m reproductions.osawa2018.study" in err


@pytest.mark.parametrize("device", ["cuda", "foo"])
def test_tables_refuse_a_device_this_machine_lacks(device: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cuda`` without CUDA ("Found no NVIDIA driver") and a name torch cannot parse
    ended O5 in a traceback; argparse refuses them before anything is built."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    never_measured = mock.patch.object(tables, "measure_rates", side_effect=Parsed)
    outcome, stderr = invoke(tables.main, ["--sections", "O5", "--device", device,
                                           "--write", "-"], never_measured)
    assert_clear_error(outcome, stderr, set())
    assert "argument --device: " in stderr.strip().splitlines()[-1]


def test_a_finished_run_is_reused_only_with_the_studys_settings(tmp_path: Path) -> None:
    """A finished run was reused whatever its settings, so after the study config was edited
    table O2 showed results under settings the config no longer had. The committed results
    match today's study; one with another learning rate is refused, naming the setting."""
    study = json.loads((tables.CONFIG_DIR / "fmnist_study.json").read_text())
    _, runs = plan(study, quick=False)
    run = next(r for r in runs if r.name == "kfac_bs256")
    out = tmp_path / run.name
    out.mkdir()
    shutil.copyfile(tables.DEFAULT_RESULTS / "kfac_bs256.json", out / "results.json")
    assert finished(run, out)
    study["runs"]["kfac"]["256"] = {**study["runs"]["kfac"]["256"], "lr": 5.0}
    _, edited = plan(study, quick=False)
    changed = next(r for r in edited if r.name == "kfac_bs256")
    with pytest.raises(CheckpointError, match=r"other settings \(lr: .* saved, 5\.0 now\).*"
                                              r"delete .*kfac_bs256 to run it again"):
        finished(changed, out)


#: Rates for O5 tests (of the order measured on one CPU thread), so no test measures anything.
RATES = KernelRates("cholesky", gemm_flops=6e10, decomposition_flops=5e10,
                    forward_backward_s_per_image=0.3, workload="resnet50@224", source="given.")


@pytest.mark.parametrize(("scheme", "alphas", "wire_bytes"), [
    # gradient all-reduce 2α + 116, factor reduce-scatter α + 188/2, readiness all-reduce
    # 2α + 4, preconditioned-gradient all-gather α + 116/2 (bytes; p = 2)
    ("ours", 6, 116 + 94 + 4 + 58),
    ("ideal", 5, 58 + 94 + 4 + 58),                  # the gradients only reduce-scattered
    ("as-coded", 8, 116 + 188 + 4 + 116),            # both V-collectives as all-reduces
])
def test_o5_stage_model_of_two_layers_on_two_workers_by_hand(scheme: str, alphas: int,
                                                             wire_bytes: int) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(7, 3, bias=False), nn.Linear(3, 2))
    options = {**tables.RECIPE_OPTIONS, "assignment": "contiguous"}
    report = tables.accounted(tables.simulate(model, "osawa", 2, **options), scheme)
    shapes = [LayerShape("0", 7, 3, 5), LayerShape("1", 4, 2, 5)]  # batch 5
    rates = KernelRates("cholesky", gemm_flops=1e9, decomposition_flops=1e8,
                        forward_backward_s_per_image=0.25, workload="tiny", source="test")
    network = AlphaBeta(alpha_s=1e-5, bandwidth=1e9, label="test")
    seconds = tables.iteration_seconds(report, shapes, rates, network, batch=5)
    assert list(seconds) == list(tables.O5_STAGES)
    assert seconds == pytest.approx({
        "forward+backward": 0.25 * 5,
        "factor computation": 2 * 5 * (7**2 + 3**2 + 4**2 + 2**2) / 1e9,  # every worker, all
        "communication": alphas * 1e-5 + wire_bytes / 1e9,
        "inversion": (7**3 + 3**3) / 1e8,                  # rank 0 owns the larger layer
        "preconditioning": 2 * (3 * 3 * 7 + 3 * 7 * 7) / 1e9,
    }, rel=1e-12)
    assert tables.layers_owned(report) == 1


def test_o5_traffic_is_o4s_and_the_stages_are_consistent() -> None:
    counts = (2, 4)
    o4 = tables.communication_table(counts)
    o5 = tables.breakdown_table(RATES, "given", counts)
    assert o5.kind == "modelled" and "[NF]" in o5.notes and "Modelled, not measured" in o5.notes
    assert o5.column("paper (s)") == [None] * len(o5.rows)
    assert [r[:2] for r in o5.rows] == [r[:2] for r in o4.rows]
    assert o5.column("ours: traffic per worker, max (MB)") == o4.column("ours: total, max (MB)")
    rows = {(r[0], r[1]): dict(zip(o5.columns, r, strict=True)) for r in o5.rows}
    stages = [f"ours: {s} (s)" for s in tables.O5_STAGES]
    for row in rows.values():
        assert row["ours: total (s)"] == pytest.approx(sum(row[s] for s in stages))
        assert row["ours: communication share (%)"] == pytest.approx(
            100 * row["ours: communication (s)"] / row["ours: total (s)"])
        assert 0 < row["ours: communication, latency α part (s)"] < row["ours: communication (s)"]
        assert row["ours: forward+backward (s)"] == pytest.approx(0.3 * 32)
    for p in counts:
        comm = [rows[p, f"osawa{s}"]["ours: communication (s)"]
                for s in (", paper's design", " (this code)", ", chainerkfac as coded")]
        assert comm == sorted(comm) and len(set(comm)) == 3
        assert rows[p, "d-kfac"]["ours: layers owned per worker, max"] == 54
        assert rows[p, "dp-kfac"]["ours: factor computation (s)"] < rows[p, "d-kfac"][
            "ours: factor computation (s)"]
    osawa = [rows[p, "osawa (this code)"] for p in counts]
    assert [r["ours: layers owned per worker, max"] for r in osawa] == [27, 14]
    assert osawa[1]["ours: inversion (s)"] < osawa[0]["ours: inversion (s)"]
    assert (osawa[1]["ours: communication, latency α part (s)"]
            > osawa[0]["ours: communication, latency α part (s)"])


def test_tables_cli_prints_o5_with_rates_from_a_file(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rates = RATES.save(tmp_path / "rates.json")
    assert KernelRates.load(rates) == RATES
    tables.main(["--sections", "O5", "--gpus", "4", "--rates", str(rates),
                 "--write", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert "### O5: Modelled per-iteration time per stage" in out and "(modelled)" in out
    paper, written = load_tables(tmp_path / "t.json")
    assert [t.id for t in written] == ["O5"] and len(written[0].rows) == 7
    assert "read from `rates.json`" in written[0].notes
    (tmp_path / "other.json").write_text(json.dumps(
        {**json.loads(rates.read_text()), "workload": "resnet18@224"}))
    outcome, stderr = invoke(tables.main, ["--sections", "O5", "--rates",
                                           str(tmp_path / "other.json"), "--write", "-"])
    assert_clear_error(outcome, stderr, set())
    assert "expected rates for resnet50@224" in stderr
    saved = json.loads(rates.read_text())
    for bad in (0, None, True, "fast", float("inf")):  # null and "fast" raised a TypeError
        (tmp_path / "bad.json").write_text(json.dumps({**saved, "gemm_flops": bad}))
        with pytest.raises(ValueError, match="'gemm_flops' must be a positive number"):
            KernelRates.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text(json.dumps([saved]))  # a list raised AttributeError
    with pytest.raises(ValueError, match="schema"):
        KernelRates.load(tmp_path / "bad.json")


_SLEEPING_STUDY = """
import sys, time
from pathlib import Path
from reproductions.osawa2018 import study

class Sleeper(study.StudyRun):
    def command(self, out, wandb, data_dir):
        return [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); "
                "time.sleep(120)"]

study.execute([Sleeper("a", "fmnist_default", {})], Path(sys.argv[1]), jobs=1,
              wandb="disabled", data_dir=None)
"""


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupted_study_stops_its_runs(tmp_path: Path, how: str) -> None:
    """A study stopped by a signal to itself alone stops the training runs it started: they
    went on writing, beside a study started again, into the checkpoints it resumes from."""
    repo = Path(__file__).resolve().parents[3]
    runner = subprocess.Popen([sys.executable, "-c", _SLEEPING_STUDY, str(tmp_path)], cwd=repo,
                              env={**os.environ, "PYTHONPATH": str(repo)})
    log = tmp_path / "a" / "train.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(log.read_text().split()[0])
    runner.send_signal(getattr(signal, how))
    assert runner.wait(timeout=60) != 0
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the study
        os.kill(child, 0)
