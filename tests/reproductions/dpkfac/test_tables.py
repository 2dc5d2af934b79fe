"""`python -m reproductions.dpkfac.tables --quick` end to end, and D5 from a results file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.config import KFACConfig
from reproductions.common.results import RunRecorder
from reproductions.common.tables import Table, load_tables, tables_destination, write_tables
from reproductions.dpkfac import tables as dpkfac_tables
from reproductions.dpkfac.tables import (
    PAPER_CONVERGENCE,
    RESULTS_DIR,
    build_parser,
    convergence_table,
    main,
)
from reproductions.dpkfac.validation import validate
from reproductions.dpkfac.workloads import DP_KFAC, SCHEMES
from tests.reliability.test_bad_input import assert_clear_error, invoke


def test_quick_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "tables.json"
    main(["--quick", "--output", str(output), "--results-dir", str(tmp_path)])
    paper, tables = load_tables(output)
    assert paper == "dpkfac"
    by_id = {t.id: t for t in tables}
    assert list(by_id) == ["D1", "D2", "D3", "D1-D3", "D4", "D5", "D6"]
    assert "### D1: Communication per worker" in capsys.readouterr().out
    d1 = by_id["D1"]
    rows = {row[1]: dict(zip(d1.columns, row, strict=True)) for row in d1.rows}
    assert list(rows) == [s.label for s in SCHEMES]
    assert rows["DP-KFAC"]["ours: factor comm (MB)"] == 0
    assert all(r["ours: factor comm (MB)"] > 0 for label, r in rows.items() if label != "DP-KFAC")
    for table in tables:
        assert table.columns.count("paper") + sum(c.startswith("paper:") for c in table.columns)
        assert any(c.startswith("ours") for c in table.columns) and table.notes
    ratios = by_id["D1-D3"]
    assert len(ratios.rows) == 3 * (len(SCHEMES) - 1)
    assert all(row[4] > 1 for row in ratios.rows)  # DP-KFAC wins every metric at P = 8
    # "Closer to a measurement" communication: all traffic, factors whole (D1's "all, max"),
    # as the paper's code sends them; memory: D2's K-FAC totals without the gradient
    # all-reduce's buffers, which SGD holds too.
    d2 = {row[1]: dict(zip(by_id["D2"].columns, row, strict=True)) for row in by_id["D2"].rows}
    for row in ratios.rows:
        if row[2] == "communication":
            assert row[5] == pytest.approx(rows[row[1]]["ours: all, max (MB)"]
                                           / rows["DP-KFAC"]["ours: all, max (MB)"])
        if row[2] == "memory":
            assert row[4] == pytest.approx(d2[row[1]]["ours: K-FAC total (MB)"]
                                           / d2["DP-KFAC"]["ours: K-FAC total (MB)"])
    d4 = by_id["D4"]
    for row in d4.rows:
        assert row[-1] == pytest.approx(sum(row[3:-1]))
    # D3's rank column holds a rank, not a FLOP count ("busiest rank (FLOPs)" read as a unit)
    assert "ours: busiest rank (by FLOPs)" in by_id["D3"].columns
    # The paper's network is inferred from its scripts' log names, not stated (PAPERS.md §4.3)
    assert "the paper's cluster," not in d4.notes and "inferred" in d4.notes
    assert by_id["D5"].rows == []


def _write_convergence_run(results_dir: Path) -> None:
    """A finished DP-KFAC run's results file, as ``train.py`` writes it."""
    recorder = RunRecorder(paper="dpkfac", experiment="fashion_mnist", optimizer="dp-kfac",
                           config={}, world_size=4)
    recorder.log_step(0, loss=2.3, time_s=0.1)
    recorder.update(summary={"final_test_accuracy": 0.9, "best_test_accuracy": 0.91,
                             "epochs": 2.0, "steps": 936})
    recorder.finish()
    recorder.write(results_dir / "fashion_mnist-dp-kfac.json")


def test_convergence_table_reads_results(tmp_path: Path) -> None:
    _write_convergence_run(tmp_path)
    (tmp_path / "fashion_mnist-broken.json").write_text("{")
    table = convergence_table(tmp_path)
    assert table.rows == [["dp-kfac", PAPER_CONVERGENCE, 4, 2.0, 936, 0.9, 0.91, None, None,
                           "finished"]]
    assert "Skipped fashion_mnist-broken.json" in table.notes


def test_sections_rebuild_the_tables_they_name_and_keep_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--sections D5`` after new training runs: D5 from the results files, every other table
    of the file as it was, and no kernel timed nor gloo run (which on another machine would
    change D3 and D4)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("timed kernels or ran gloo for a D5-only rebuild")

    monkeypatch.setattr(dpkfac_tables, "KernelTimes", refuse)
    monkeypatch.setattr(dpkfac_tables, "validate", refuse)
    monkeypatch.setattr(dpkfac_tables, "RESULTS_DIR", tmp_path)  # the committed results
    output = tmp_path / "tables.json"
    kept = Table("D1", "communication", "exact", ["paper", "ours"], [["x", 1.5]], "kept")
    stale = Table("D5", "convergence", "small", ["paper", "ours"], [["x", 0.1]], "stale")
    write_tables(output, "dpkfac", [kept, stale])
    _write_convergence_run(tmp_path)
    main(["--sections", "D5"])  # a selection, not a variant: into the committed file
    _, tables = load_tables(output)
    assert [t.id for t in tables] == ["D1", "D5"]
    assert tables[0] == kept
    assert tables[1].rows == convergence_table(tmp_path).rows
    assert tables[1].rows[0][0] == "dp-kfac"


@pytest.mark.distributed
def test_validation_on_two_processes() -> None:
    check = validate([2], [DP_KFAC], steps=2, sizes=(4096, 65536), reps=1, timeout=120)
    network = check.networks[2]
    assert network.alpha_s >= 0 and network.bandwidth > 0
    assert {c.stage for c in check.checks} == {"grad_allreduce", "inverse_comm", "grad_comm"}
    assert all(c.predicted_s > 0 and c.measured_s > 0 for c in check.checks)


@pytest.mark.parametrize(("layers", "world_size", "colocated"), [
    (54, 64, False),   # ResNet-50 at 64 GPUs: more workers than layers, A and G apart
    (156, 64, True),   # ResNet-152: layer l's two factors together on rank l mod P
    (64, 64, True),    # as many workers as layers: together
])
def test_the_eigen_mpd_kfac_places_factors_as_its_code_does_by_default(
        layers: int, world_size: int, colocated: bool) -> None:
    """lzhangbv/kfac_pytorch's `eigen` splits a layer's A and G over workers only when there are
    more workers than layers (``distribute_layer_factors=None``); the row split them always."""
    eigen = next(s for s in SCHEMES if s.label == "MPD-KFAC (eigen)")
    assert eigen.options_for(layers, world_size) == {"assignment": "round-robin",
                                                     "colocate_factors": colocated}
    assert DP_KFAC.options_for(layers, world_size) == DP_KFAC.options


@pytest.mark.parametrize("method", ["eigen", "inverse", "cholesky"])
def test_kaisa_schemes_pre_divide_their_eigenvalues_as_kaisa_does_by_default(
        method: str) -> None:
    """KAISA's ``compute_eigenvalue_outer_product=True``: on its rows only, and only where the
    decomposition is ``eigen`` (the other methods have no eigenvalues)."""
    for scheme in SCHEMES:
        options = scheme.options_for(54, 64, method)
        expected = scheme.label.startswith("KAISA") and method == "eigen"
        assert options.get("prediv_eigenvalues", False) == expected, (scheme.label, method)
        KFACConfig(strategy=scheme.strategy, inverse_method=method, **options)


@pytest.mark.parametrize("argv", [["--quick"], ["--models", "resnet50"], ["--world-size", "8"],
                                  ["--inverse-method", "cholesky"], ["--alpha-us", "5"],
                                  ["--no-validate"], ["--validate", "2"],
                                  ["--results-dir", "elsewhere"], ["--device", "cuda"]])
def test_only_the_paper_scale_defaults_write_the_committed_tables(
        argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--quick`` (and every other variant) wrote over the committed results/tables.json
    the docs are built from; only the defaults do now, and --output always wins."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda parses
    parser = build_parser()

    def destination(args: list[str]) -> Path:
        return tables_destination(parser.parse_args(args), parser, output="output",
                                  committed=RESULTS_DIR / "tables.json", paper="dpkfac",
                                  selectors=("sections",))

    assert destination([]) == RESULTS_DIR / "tables.json"
    assert destination(["--sections", "D5", "D6"]) == RESULTS_DIR / "tables.json"
    assert destination(["--sections", "D5", *argv]) == Path("runs") / "dpkfac" / "tables.json"
    assert destination(["--output", "x.json", *argv]) == Path("x.json")
    assert destination(argv) == Path("runs") / "dpkfac" / "tables.json"


@pytest.mark.parametrize("argv", [
    ["--world-size", "1"],            # ZeroDivisionError in the simulation
    ["--world-size", "-4"],           # ValueError deep in the strategies
    ["--world-size", "0"],            # silently the default P = 64
    ["--bandwidth-gbit", "0"],        # ZeroDivisionError in the time model
    ["--bandwidth-gbit", "-5"],       # tables of "—"
    ["--alpha-us", "nan"],
    ["--alpha-us", "-1"],
    ["--device", "foo"],              # RuntimeError when the kernels were timed
    ["--device", "cuda"],             # "Found no NVIDIA driver"
    ["--quick", "--validate", "0"],   # IndexError in the gloo validation
    ["--validate", "2", "1"],
])
def test_bad_options_end_in_one_line_before_any_work(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option is checked when parsed: a bad value exits with argparse's one line naming
    it, before a model is simulated or a kernel timed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    outcome, stderr = invoke(main, ["--quick", *argv, "--output", str(tmp_path / "t.json"),
                                    "--results-dir", str(tmp_path)])
    assert_clear_error(outcome, stderr, set())
    assert argv[-2] in stderr.strip().splitlines()[-1]
