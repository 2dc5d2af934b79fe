"""Synthetic reproductions for the docs tests: results files written by ``RunRecorder``, a tables
file and a README with a deviations section, so the tests never depend on committed results."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from reproductions.common.results import RunRecorder
from scripts.make_docs_pages import TABLES_SCHEMA

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
TABLE_DEVIATION = "Ours runs on 4 simulated ranks."


def tables_data(paper: str) -> dict[str, Any]:
    """A tables file with one table: a published number, an unpublished one, a missing run."""
    return {"schema": TABLES_SCHEMA, "paper": paper, "tables": [{
        "id": "T1", "title": "Iterations and memory", "source": "the paper's Table 1",
        "deviations": [TABLE_DEVIATION],
        "rows": [
            {"what": "iterations at B = 131,072", "paper": 978, "ours": 978, "kind": "exact",
             "note": "same formula"},
            {"what": "optimizer memory", "unit": "GB", "paper": 23.34, "ours": 0.0469,
             "kind": "small", "note": "a small model on a CPU"},
            {"what": "top-1 accuracy", "unit": "%", "paper": None, "ours": 88.25,
             "kind": "small", "note": "Fashion-MNIST | one seed"},
            {"what": "time to 75%", "paper": "3.1 h", "ours": None, "kind": "needs data",
             "note": "needs ImageNet"},
        ]}]}


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
    (results / "tables.json").write_text(json.dumps(tables_data(paper)), encoding="utf-8")
    (directory / "README.md").write_text(
        f"# {paper}\n\n## Claim\n\nx\n\n## Deviations\n\n- {DEVIATION}\n\n### Detail\n\nmore\n\n"
        "## Commands\n\n`python -m x`\n", encoding="utf-8")
    return directory
