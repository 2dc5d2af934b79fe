"""The tables script on the committed results (M3) and at small shapes (M1, M2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.preconditioner import discover_layers
from reproductions.common.results import ResultsError
from reproductions.common.tables import load_tables
from reproductions.mkor import tables
from reproductions.mkor.measure import linear_layer, measure_costs
from reproductions.mkor.model import build_model


def test_tables_from_the_committed_results(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tables.json"
    built = tables.main(["--model", "tiny", "--cnn", "resnet18", "--dims", "32,64",
                         "--kfac-ranks", "2", "--out", str(out)])
    paper, written = load_tables(out)
    assert paper == "mkor" and [t.id for t in written] == list(tables.SECTIONS)
    assert [t.rows for t in written] == [t.rows for t in built]
    # --sections rebuilds some tables and keeps the others in the file
    again = tables.main(["--sections", "M4", "M8", "--out", str(out)])
    assert [t.id for t in again] == ["M4", "M8"]
    assert [t.id for t in load_tables(out)[1]] == list(tables.SECTIONS)
    text = capsys.readouterr().out
    for table in built:
        assert f"### {table.id}:" in text

    m1 = {(row[0], row[1]): row for row in built[0].rows}
    exponent = built[0].columns.index("ours: fitted exponent of d")
    assert m1[("MKOR", "memory (bytes)")][exponent] == pytest.approx(2, abs=0.1)
    assert m1[("MKOR", "communication per update (bytes)")][exponent] == pytest.approx(1, abs=0.1)
    assert m1[("KAISA (K-FAC)", "communication per update (bytes)")][exponent] == pytest.approx(
        2, abs=0.1)
    assert m1[("Eva", "memory (bytes)")][exponent] == pytest.approx(1, abs=0.1)
    flops = "update: statistics + inversion (FLOPs counted, 64 rows)"
    first = built[0].columns.index("ours: d = 32")
    # by hand at d = 32 (a = 33, g = 32, 64 rows): K-FAC 2·64·(a² + g²) + 9·(a³ + g³),
    # MKOR 64·32·2 + 4·(a² + g²), Eva 64·32·2; LAMB counts nothing
    assert m1[("KAISA (K-FAC)", flops)][first] == 2 * 64 * (33**2 + 32**2) + 9 * (33**3 + 32**3)
    assert m1[("MKOR", flops)][first] == 64 * 32 * 2 + 4 * (33**2 + 32**2)
    assert m1[("Eva", flops)][first] == 64 * 32 * 2
    assert m1[("LAMB", flops)][first] is None

    m2 = {(row[0], row[1]): row for row in built[1].rows}
    second = built[1].columns.index("ours: second-order state")
    assert m2[("tiny", "LAMB")][second] == 0 < m2[("tiny", "Eva")][second]
    assert m2[("tiny", "Eva")][second] < m2[("tiny", "MKOR")][second]
    assert m2[("tiny", "MKOR")][second] < m2[("tiny", "KAISA (K-FAC) mem-opt")][second]
    assert m2[("resnet18", "SGD")][second] == 0 < m2[("resnet18", "MKOR")][second]
    assert m2[("resnet18", "MKOR")][second] < m2[("resnet18", "KAISA (K-FAC) comm-opt")][second]
    # The paper's numbers stand beside the paper's shapes only (bert-large, resnet50).
    assert set(built[1].column("paper: GB per GPU")) == {None}

    m3 = built[2]
    assert m3.column("optimizer") == ["LAMB", "KAISA (K-FAC)", "MKOR", "MKOR-H", "Eva"]
    lamb = m3.rows[0]
    steps_run = m3.columns.index("ours: steps run")
    reached = m3.columns.index("ours: steps to LAMB's final loss")
    assert lamb[reached] is not None and lamb[reached] <= lamb[steps_run]
    assert built[3].kind == "needs data" and set(built[3].column("ours")) == {None}


def test_fitted_exponent() -> None:
    assert tables.fitted_exponent([2, 4, 8], [4, 16, 64]) == pytest.approx(2)
    assert tables.fitted_exponent([2, 4], [0, 1]) is None


def test_memory_table_has_a_resnet50_half_and_states_the_kaisa_modes() -> None:
    """M2: BERT over LAMB (KAISA mem-opt, as the official MKOR BERT runner) and the paper's
    ResNet-50 over SGD (KAISA comm-opt, KAISA's ImageNet default), each beside Table 3.5."""
    table = tables.memory_table("tiny", world_size=64, kfac_ranks=2)
    assert table.id == "M2" and table.kind == "exact"
    col = {name: i for i, name in enumerate(table.columns)}
    assert "derived from paper: extra over LAMB/SGD" in col  # never read as a printed number
    assert [(row[0], row[1]) for row in table.rows] == [
        ("tiny", "LAMB"), ("tiny", "KAISA (K-FAC) mem-opt"), ("tiny", "MKOR"), ("tiny", "Eva"),
        ("resnet50", "SGD"), ("resnet50", "KAISA (K-FAC) comm-opt"), ("resnet50", "MKOR")]
    resnet = {row[1].split(" (")[0]: row for row in table.rows if row[0] == "resnet50"}
    assert [resnet[m][col["paper: GB per GPU"]] for m in ("SGD", "KAISA", "MKOR")] == [
        "3.01", "5.83", "3.88"]
    assert [resnet[m][col["derived from paper: extra over LAMB/SGD"]]
            for m in ("SGD", "KAISA", "MKOR")] == ["0.00", "2.82", "0.87"]
    first = col["ours: first-order state (LAMB moments / SGD momentum)"]
    second = col["ours: second-order state"]
    # By hand: SGD's momentum is ResNet-50's 25,557,032 fp32 parameters; KAISA comm-opt holds
    # every layer's factors (Φ = 153,851,562 values), their all-reduce buckets (Φ again) and
    # eigenbases with pre-divided eigenvalues (Φ + Ψ, Ψ = Σ a·g = 25,503,912): 1,948.2 MB, as
    # DP-KFAC's D2; MKOR's fp16 inverse factors are 307.7 MB, plus its fp32 rank-1 vectors.
    assert resnet["SGD"][first] * tables.GB == 4 * 25_557_032
    assert resnet["KAISA"][second] * tables.GB == 4 * (3 * 153_851_562 + 25_503_912)
    assert 307.7e6 < resnet["MKOR"][second] * tables.GB < 308.1e6
    for row in table.rows:
        total = col["ours: optimizer state GB per GPU"]
        assert row[total] == pytest.approx(row[first] + row[second])
        assert row[col["ours: extra over LAMB/SGD"]] == row[second]
    for said in ("KAISA mem-opt", "comm_method=MEM_OPT", "KAISA comm-opt",
                 "optimizer state only", "extra over the first-order optimizer",
                 "BertLMPredictionHead", "skipping only the vocabulary decoder"):
        assert said in table.notes


def test_paper_scale_kaisa_is_the_official_runners() -> None:
    """bert_large_phase2.json's K-FAC: mem-opt, the whole LM-prediction head first-order."""
    kfac = tables.second_order_options()["kfac"]
    assert kfac["strategy"] == "mem-opt"
    model = build_model("tiny", vocab_size=64, dropout=0.0)
    kept = [name for name, _ in discover_layers(model, kfac["skip_layers"])]
    assert kept and not any(name.startswith("cls.predictions") for name in kept)
    assert "cls.seq_relationship" in kept  # the NSP classifier is preconditioned
    # MKOR keeps the training code's default: only the vocabulary decoder is skipped.
    mkor = [name for name, _ in discover_layers(model, tables.second_order_options()["mkor"][
        "skip_layers"])]
    assert "cls.predictions.transform.dense" in mkor and "cls.predictions.decoder" not in mkor


def test_measure_costs_of_sgd_and_a_subset_of_methods() -> None:
    model, loss = linear_layer(8)
    costs = measure_costs(model, loss, world_size=4, options={}, methods=("sgd", "lamb"))
    assert list(costs) == ["sgd", "lamb"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert costs["sgd"].state_bytes == params and costs["lamb"].state_bytes == 2 * params
    with pytest.raises(ValueError, match="adam"):
        measure_costs(model, loss, world_size=4, options={}, methods=("adam",))


@pytest.mark.parametrize(("argv", "status", "says"), [
    (["--dims", "a,b"], 2, "argument --dims: 'a,b' is not comma-separated integers"),
    (["--world-size", "0"], 2, "argument --world-size: 0 is not >= 1"),
    # M3 of a directory without runs was written empty ("BERT ?"), over the committed one
    (["--results", "/nonexistent", "--sections", "M3"], 1,
     "/nonexistent: no lamb run of experiment 'default' (no runs)"),
])
def test_bad_options_end_in_one_line_and_write_nothing(
        argv: list[str], status: int, says: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tables.json"
    with pytest.raises(SystemExit) as info:
        tables.main([*argv, "--out", str(out)])
    assert info.value.code == status and not out.exists()
    err = capsys.readouterr().err
    assert "Traceback" not in err and says in err


def _committed_runs(tmp_path: Path) -> Path:
    """A copy of the committed default experiment's results files."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for path in (tables.RESULTS_DIR / "default").glob("*.json"):
        (runs / path.name).write_text(path.read_text())
    return runs


@pytest.mark.parametrize(("change", "says"), [
    # a LAMB run of another length beside MKOR's: the notes said "identical batches"
    (lambda run: run["config"].update(steps=run["config"]["steps"] - 1),
     "mkor.json: made with steps="),
    (lambda run: run.update(finished=None), "mkor.json: an unfinished run; M3 compares"),
    (lambda run: run["config"].update(init_checkpoint="/elsewhere/phase1"),
     "mkor.json: made with init_checkpoint="),
])
def test_m3_refuses_runs_that_were_not_made_alike(
        tmp_path: Path, change: Any, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """M3 put a LAMB run of 4 steps beside an MKOR run of 6 as one comparison, and listed an
    interrupted run as an ordinary row."""
    runs = _committed_runs(tmp_path)
    mkor = json.loads((runs / "mkor.json").read_text())
    change(mkor)
    (runs / "mkor.json").write_text(json.dumps(mkor))
    with pytest.raises(SystemExit) as info:
        tables.main(["--results", str(runs), "--sections", "M3",
                     "--out", str(tmp_path / "t.json")])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_m3_compares_runs_whose_config_prose_differs(tmp_path: Path) -> None:
    """A reworded description or launch line does not change an experiment."""
    runs = _committed_runs(tmp_path)
    mkor = json.loads((runs / "mkor.json").read_text())
    mkor["config"].update(description="reworded", launch="torchrun ...")
    (runs / "mkor.json").write_text(json.dumps(mkor))
    assert len(tables.load_runs(runs, "default")) == 5


def test_m3_refuses_two_runs_of_one_optimizer(tmp_path: Path) -> None:
    runs = _committed_runs(tmp_path)
    (runs / "again").mkdir()
    (runs / "again" / "mkor.json").write_text((runs / "mkor.json").read_text())
    with pytest.raises(ResultsError, match="a second mkor run of experiment 'default'"):
        tables.load_runs(runs, "default")


def test_m3_and_m4_quote_the_paper_tables_they_name() -> None:
    """M3 was titled "Tables 2-3" but holds Table 2's (SQuAD) iterations and times, which
    Table 3 (GLUE) does not share; M4 quoted one of Table 3's two MKOR rows as "MKOR" and left
    out Table 4's per-task scores, which TABLES.md lists."""
    m3 = tables.speedup_table([], "default", "nowhere")
    assert m3.title.startswith("Table 2:")
    assert "8.93 h" in m3.notes and "1,536" in m3.notes
    m4 = {(row[0], row[1]): row[2] for row in tables.finetune_table().rows}
    assert m4[("GLUE average", "MKOR (1,500 iterations)")] == "0.8214"
    assert m4[("GLUE average", "MKOR (600 iterations)")] == "0.8078"
    assert ("GLUE average", "MKOR") not in m4
    assert m4[("GLUE MNLI (acc)", "LAMB")] == "0.841"
    assert m4[("GLUE RTE (acc)", "MKOR (1,500 iterations)")] == "0.690"
    for method, scores in tables.PAPER_GLUE_TASKS.items():  # Table 4 against its averages
        assert sum(map(float, scores)) / 8 == pytest.approx(
            float(tables.PAPER_GLUE_AVERAGE[method]), abs=1.1e-3)  # Eva: 0.810 vs 0.809
