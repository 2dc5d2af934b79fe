"""Synthetic reproductions for the docs tests: results files written by ``RunRecorder``, a tables
file written by ``write_tables`` and a README with a deviations section, so the tests never depend
on committed results."""

from __future__ import annotations

import math
from pathlib import Path

from reproductions.common.results import RunRecorder
from reproductions.common.tables import Table, write_tables

REPO_ROOT = Path(__file__).resolve().parents[2]

OPTIMIZERS = ("sgd", "kfac")
STEPS = 12
STAGE_SECONDS = {"factors": 0.5, "inversion": 1.25, "precondition": 0.25}
LEDGER = {"factor_comm": {"collectives": 2, "elements": 2**20, "bytes": 4 * 2**20,
                          "traffic_bytes": 6 * 2**20},
          "grad_comm": {"collectives": 1, "elements": 2**19, "bytes": 2 * 2**20,
                        "traffic_bytes": 3 * 2**20}}
MEMORY = {"optimizer_state": 48 * 2**20, "factors": 32 * 2**20}
DEVIATION = "The data set is Fashion-MNIST, not ImageNet."
TABLE_NOTES = "Ours runs on 4 simulated ranks; the paper's numbers are from its Table 1."
TABLES_FILE = "tables.json"


def paper_tables() -> list[Table]:
    """Three tables, one per kind of ours: exact numbers, a small run whose number the paper does
    not publish (a null paper cell), and a run that needs data (a null ours cell)."""
    return [
        Table("T1", "Iterations and memory", "exact", ["quantity", "paper", "ours"],
              [["iterations at B = 131,072", 978, 978], ["optimizer memory (GB)", 23.34, 0.0469]],
              TABLE_NOTES),
        Table("T2", "Accuracy", "small", ["metric", "paper", "ours", "what differs"],
              [["top-1 accuracy (%)", None, 88.5, "Fashion-MNIST | one seed"]],
              "The paper gives no accuracy for this setting."),
        Table("T3", "Time to accuracy", "needs data", ["metric", "Paper (published)", "ours"],
              [["time to 75%", "3.1 h", None]],
              "Needs ImageNet; not run yet.\nThe paper's time is on 1,024 GPUs."),
    ]


def write_reproduction(root: Path, paper: str) -> Path:
    """Write two runs (one eval metric each), a tables file and a README for ``paper``.

    Args:
        root: A repository-like root; files go under ``root/reproductions/<paper>``.
        paper: The reproduction's slug.

    Returns:
        The reproduction's directory.
    """
    directory = root / "reproductions" / paper
    results = directory / "results"
    for index, optimizer in enumerate(OPTIMIZERS):
        recorder = RunRecorder(paper=paper, experiment="default", optimizer=optimizer,
                               config={"seed": 0, "lr": 0.1, "optimizer": optimizer})
        for step in range(STEPS):
            recorder.log_step(step, loss=2.0 * math.exp(-(index + 1) * step / STEPS),
                              time_s=0.1 + 0.05 * index, lr=0.1)
            if step % 4 == 3:
                recorder.log_eval(step, epoch=step / 4, accuracy=0.5 + 0.03 * step + 0.05 * index)
        recorder.update(optimizer_stage_time_s=STAGE_SECONDS, ledger=LEDGER, memory=MEMORY,
                        summary={"final_loss": 0.5 - 0.1 * index, "time_to_target_s": 1.5})
        recorder.finish()
        recorder.write(results / f"default-{optimizer}-0.json")
    write_tables(results / TABLES_FILE, paper, paper_tables())
    (directory / "README.md").write_text(
        f"# {paper}\n\n## Claim\n\nx\n\n## Deviations\n\n- {DEVIATION}\n\n### Detail\n\nmore\n\n"
        "## Commands\n\n`python -m x`\n", encoding="utf-8")
    return directory
