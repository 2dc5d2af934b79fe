"""W&B: the tables' figures logged offline and read back; the report and workspace specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr

from reproductions.common.tables import Table
from reproductions.common.tracking import read_offline_history
from scripts.make_docs_pages import PAPERS, read_paper
from scripts.wandb_dashboards import (
    build_report,
    build_workspace,
    discover_metrics,
    group_filter,
    log_tables,
    main,
    panels,
    project_name,
    row_slugs,
    table_figures,
)
from tests.docs.helpers import paper_tables, write_reproduction

MKOR = next(p for p in PAPERS if p.slug == "mkor")
EXPERIMENTS = {"default": ["eval/accuracy", "loss", "time/factors", "time/inversion"],
               "bert_large_phase2": ["loss"]}


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> list:
    root = tmp_path_factory.mktemp("repo")
    return read_paper(write_reproduction(root, "mkor")).tables


def test_table_figures_carry_every_number_under_one_key_scheme(tables: list) -> None:
    assert table_figures(tables) == {
        "T1/iterations_at_b_131_072/paper": 978.0, "T1/iterations_at_b_131_072/ours": 978.0,
        "T1/optimizer_memory_gb/paper": 23.34, "T1/optimizer_memory_gb/ours": 0.0469,
        "T2/top_1_accuracy/ours": 88.5,  # the paper gives none; T3's "3.1 h" is not a number
    }


def test_repeated_or_empty_row_labels_get_keys_of_their_own() -> None:
    table = Table("D1", "t", "exact", ["model", "paper", "ours"],
                  [["ResNet-50", 1, 2], ["ResNet-50", 3, 4], [None, 5, 6], ["ResNet-50", 7, 8]],
                  "n")
    assert row_slugs(table) == ["resnet_50", "resnet_50_2", "row_3", "resnet_50_3"]
    assert len(table_figures([table])) == 8


def test_keys_never_collide_across_rows_or_columns() -> None:
    """Columns ``ours (MB)`` and ``ours: MB`` shared one key, and a repeated row ``a`` took
    the key ``a_2`` of a row so named: 9 numeric cells gave 4 figures."""
    table = Table("D1", "t", "exact", ["model", "ours (MB)", "ours: MB", "paper"],
                  [["a", 1, 2, 3], ["a", 4, 5, 6], ["a_2", 7, 8, 9]], "n")
    assert len(table_figures([table])) == 9
    assert row_slugs(table) == ["a", "a_3", "a_2"]


def test_the_tables_run_logged_offline_reads_back(tmp_path: Path, tables: list,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = log_tables(MKOR, tables, tmp_path, mode="offline")
    assert (run.project, run.group, run.name) == (project_name("mkor"), "tables", "tables")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (logged,) = read_offline_history(run_dir, wait_s=30)  # one step: the run's summary
    assert logged["_step"] == 0
    for key, value in table_figures(tables).items():
        assert logged[key] == pytest.approx(value)
    # The wandb.Table: its reference in the history (nested keys joined by "."), its rows on disk.
    assert logged["T1/table._type"] == "table-file"
    table = json.loads((run_dir / "files" / logged["T1/table.path"]).read_text())
    assert table["columns"] == ["quantity", "paper", "ours"]
    assert table["data"] == [["iterations at B = 131,072", "978", "978"],
                             ["optimizer memory (GB)", "23.3", "0.0469"]]
    table = json.loads((run_dir / "files" / logged["T2/table.path"]).read_text())
    assert table["data"] == [["top-1 accuracy (%)", "—", "88.5", "Fashion-MNIST | one seed"]]


def test_the_report_has_the_tables_and_a_panel_grid_per_experiment(tables: list) -> None:
    report = build_report(MKOR, "someone", tables, EXPERIMENTS)
    assert (report.entity, report.project) == ("someone", "kfac-repro-mkor")
    markdown = [b.text for b in report.blocks if isinstance(b, wr.MarkdownBlock)]
    assert markdown[1:] == [table.markdown() for table in paper_tables()]  # after the citation
    grids = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == len(EXPERIMENTS)
    for grid, (experiment, metrics) in zip(grids, EXPERIMENTS.items(), strict=True):
        (runset,) = grid.runsets
        assert runset.filters == group_filter(experiment) == f"Group = '{experiment}'"
        lines = [p.y for p in grid.panels if isinstance(p, wr.LinePlot)]
        assert lines == [[m] for m in metrics if not m.startswith("time/")]
    bars = [p for p in grids[0].panels if isinstance(p, wr.BarPlot)]
    assert [b.metrics for b in bars] == [["time/factors", "time/inversion"]]


def test_the_workspace_has_a_section_per_experiment() -> None:
    workspace = build_workspace(MKOR, "someone", EXPERIMENTS)
    assert workspace.project == "kfac-repro-mkor"
    assert [s.name for s in workspace.sections] == list(EXPERIMENTS)
    assert len(workspace.sections[0].panels) == 3  # two line plots and the stage-time bars


class FakeRun:
    def __init__(self, group: str, history: list[dict], summary: dict) -> None:
        self.group, self._history, self.summary = group, history, summary

    def history(self, samples: int, pandas: bool) -> list[dict]:
        assert not pandas
        return self._history[:samples]


class FakeApi:
    def __init__(self, runs: list[FakeRun]) -> None:
        self._runs = runs

    def runs(self, path: str) -> list[FakeRun]:
        assert path == "someone/kfac-repro-mkor"
        return self._runs


def test_dashboards_plot_what_runs_log_per_step_and_their_stage_times_as_bars() -> None:
    """Summary-only values (set once at the end) have no history to plot; the entry points'
    prefixed stage times (``optimizer/time/...``) go into the stage bar chart."""
    history = [{"_step": 0, "train/loss": 2.0, "optimizer/time/factors": 0.1,
                "optimizer/time/inversion": 0.2, "flag": True, "note": "x"}]
    api = FakeApi([FakeRun("default", history, {"final_loss": 1.0, "steps": 3}),
                   FakeRun("tables", [{"T1/a/b": 1.0}], {}),
                   FakeRun("default", [{"eval/loss": 1.5}], {})])
    metrics = discover_metrics(api, "someone", project_name("mkor"))
    assert metrics == {"default": ["eval/loss", "optimizer/time/factors",
                                   "optimizer/time/inversion", "train/loss"]}
    made = panels(metrics["default"])
    assert [p.y for p in made if isinstance(p, wr.LinePlot)] == [["eval/loss"], ["train/loss"]]
    (bars,) = [p for p in made if isinstance(p, wr.BarPlot)]
    assert bars.metrics == ["optimizer/time/factors", "optimizer/time/inversion"]


def test_dashboards_without_a_login_create_nothing(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert main(["dashboards"]) == 1
    assert "Not logged in to W&B" in capsys.readouterr().err


def test_an_option_of_the_other_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--mode`` and ``--dir`` belong to ``tables``, ``--entity`` to ``dashboards``: given to
    the other command they were accepted and ignored."""
    for argv in (["dashboards", "--mode", "offline"], ["tables", "--entity", "me"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_tables_logged_with_w_b_disabled_name_no_files(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Disabled, W&B writes nothing; the line named a folder that did not exist."""
    assert main(["tables", "--mode", "disabled", "--dir", str(tmp_path), "--paper", "mkor"]) == 0
    out = capsys.readouterr().out
    assert "(disabled; nothing written)" in out and "files in" not in out
    assert not (tmp_path / "wandb").exists()
