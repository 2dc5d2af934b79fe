"""The results schema: what RunRecorder writes validates; broken files give clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from reproductions.common.results import (
    SCHEMA,
    ResultsError,
    RunRecorder,
    git_revision,
    hardware_info,
    load_results,
)
from reproductions.common.scrub import REDACTED


def recorder() -> RunRecorder:
    rec = RunRecorder(paper="mkor", experiment="tiny", optimizer="lamb",
                      config={"lr": 1e-3, "wandb_api_key": "abc"})
    rec.log_step(0, loss=2.5, time_s=0.1, lr=1e-3)
    rec.log_step(1, loss=math.nan, time_s=0.1, lr=1e-3)
    rec.log_eval(1, loss=2.4)
    rec.update(summary={"final_loss": 2.4}, memory={"optimizer_state_bytes": 10},
               optimizer_stage_time_s={"precondition": 0.5})
    rec.finish()
    return rec


def test_written_file_loads_and_validates(tmp_path: Path) -> None:
    path = recorder().write(tmp_path / "out" / "run.json")
    data = load_results(path)
    assert data["schema"] == SCHEMA and data["paper"] == "mkor"
    assert data["config"] == {"lr": 1e-3, "wandb_api_key": REDACTED}
    assert data["steps"][1]["loss"] is None  # NaN is written as null (strict JSON)
    assert data["finished"] is not None and data["ledger"] is None
    assert {"cpu", "threads", "torch", "cuda", "world_size"} <= set(data["hardware"])
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    again = RunRecorder.from_data(data)
    again.log_step(2, loss=2.0, time_s=0.1)
    assert len(again.data["steps"]) == 3 and len(data["steps"]) == 2


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ResultsError, match=r"absent\.json: no such results file"):
        load_results(tmp_path / "absent.json")


def test_truncated_file(tmp_path: Path) -> None:
    path = recorder().write(tmp_path / "run.json")
    path.write_text(path.read_text()[:50])
    with pytest.raises(ResultsError, match=r"run\.json: not valid JSON .*truncated or corrupt"):
        load_results(path)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(schema="other/v0"), "field 'schema'"),
    (lambda d: d.pop("optimizer"), "field 'optimizer'"),
    (lambda d: d["steps"][1].pop("time_s"), r"field 'steps\[1\]' lacks 'time_s'"),
    (lambda d: d["steps"][0].update(loss="low"), r"field 'steps\[0\].loss' must be a finite"),
    (lambda d: d["steps"][1].update(step=0), r"steps\[1\].step' is 0, not after"),
    (lambda d: d["hardware"].pop("threads"), "field 'hardware.threads'"),
    (lambda d: d.update(wandb={"project": "p"}), "field 'wandb'"),
    (lambda d: d.pop("ledger"), "field 'ledger' is missing"),
    (lambda d: d["steps"][0].update(time_s=math.inf), r"steps\[0\].time_s' must be a finite"),
    (lambda d: d["steps"][0].update(loss=math.nan), r"steps\[0\].loss' must be a finite"),
    (lambda d: d["optimizer_stage_time_s"].update(precondition=math.nan),
     "optimizer_stage_time_s.precondition' must be a finite number"),
    (lambda d: d["hardware"].update(threads=True), "field 'hardware.threads' must be a int"),
    (lambda d: d["steps"][0].pop("loss"), r"field 'steps\[0\]' lacks 'loss'"),
    (lambda d: d["steps"][0].update(time_s=-1.0), r"steps\[0\].time_s' must be a finite .* >= 0"),
    (lambda d: d.update(paper=""), "field 'paper' must be a non-empty string"),
    (lambda d: d.pop("wandb"), "field 'wandb' is missing"),
    (lambda d: d["hardware"].pop("cuda"), "field 'hardware.cuda' must be the GPU's name"),
])
def test_invalid_fields_are_named(tmp_path: Path, change, message: str) -> None:
    data = json.loads(recorder().write(tmp_path / "run.json").read_text())
    change(data)
    (tmp_path / "run.json").write_text(json.dumps(data))
    with pytest.raises(ResultsError, match=message) as info:
        load_results(tmp_path / "run.json")
    assert str(info.value).startswith(str(tmp_path / "run.json"))


def test_non_finite_values_anywhere_are_written_as_null_in_strict_json(tmp_path: Path) -> None:
    """A summary or memory value that is NaN or infinite (a diverged run's scores) becomes null,
    so the file is strict JSON that any reader parses."""
    rec = recorder()
    rec.update(summary={"final_loss": math.nan, "scores": [1.0, math.inf]},
               memory={"peak": -math.inf})
    path = rec.write(tmp_path / "run.json")
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict {name}"))
    assert data["summary"] == {"final_loss": None, "scores": [1.0, None]}
    assert data["memory"] == {"peak": None}


def test_an_infinite_setting_in_the_config_is_recorded_as_null(tmp_path: Path) -> None:
    """``threshold=-inf`` (MKOR-H: never switch) is a valid setting; strict JSON has no -inf."""
    rec = RunRecorder(paper="mkor", experiment="tiny", optimizer="mkor-h",
                      config={"preconditioner": {"mkor-h": {"threshold": -math.inf}}})
    data = load_results(rec.write(tmp_path / "run.json"))
    assert data["config"] == {"preconditioner": {"mkor-h": {"threshold": None}}}


def test_recorder_rejects_bad_entries() -> None:
    rec = recorder()
    with pytest.raises(ResultsError, match="lacks 'time_s'"):
        rec.log_step(5, loss=1.0)
    with pytest.raises(ResultsError, match=r"steps\[2\].step' is 1, not after"):
        rec.log_step(1, loss=1.0, time_s=0.1)
    with pytest.raises(KeyError, match="steps"):
        rec.update(steps=[])


def test_revision_and_hardware() -> None:
    revision = git_revision()
    assert revision is None or len(revision.removesuffix("-dirty")) == 40
    info = hardware_info(world_size=4, device="cpu")
    assert info["world_size"] == 4 and info["cuda"] is None and info["threads"] >= 1
    assert type(info["torch"]) is str  # not torch's TorchVersion: weights-only checkpoints
