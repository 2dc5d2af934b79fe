"""GLUE and SQuAD fine-tuning on tiny files in the official formats, from a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import AutoTokenizer

from reproductions.common.checkpoint import checkpoint_step, list_checkpoints
from reproductions.common.results import load_results
from reproductions.mkor import data, finetune, glue, squad
from reproductions.mkor.model import build_model


@pytest.fixture(scope="module")
def model_dir(corpus_file: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Path:
    """A tiny pre-trained-model directory as reproductions.mkor.bert writes it."""
    corpus = data.load_corpus([str(corpus_file)], data_dir=data_dir)
    tokenizer = data.load_tokenizer("wordpiece", corpus, vocab_size=200, max_length=64,
                                    data_dir=data_dir)
    here = tmp_path_factory.mktemp("pretrained") / "mkor-s0" / "model"
    build_model("tiny", len(tokenizer), dropout=0.1).save_pretrained(here)
    tokenizer.save_pretrained(here)
    return here


def write_tsv(path: Path, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")


def common_args(data: Path, model: Path, out: Path) -> list[str]:
    return ["--data-dir", str(data), "--model", str(model), "--out", str(out), "--epochs", "2",
            "--batch-size", "4", "--max-seq-len", "32", "--device", "cpu", "--wandb",
            "disabled"]


def test_glue_rte_cola_and_stsb(model_dir: Path, tmp_path: Path) -> None:
    glue_dir = tmp_path / "glue_data"
    rte = [["index", "sentence1", "sentence2", "label"]] + [
        [str(i), f'The model "learns" step {i}.', "It learns.",
         ("entailment", "not_entailment")[i % 2]] for i in range(6)]
    write_tsv(glue_dir / "RTE" / "train.tsv", rte)
    write_tsv(glue_dir / "RTE" / "dev.tsv", rte[:4])
    cola = [["src", str(i % 2), "*" if i % 2 == 0 else "", f"the vector moves {i}"]
            for i in range(6)]  # CoLA has no header
    write_tsv(glue_dir / "CoLA" / "train.tsv", cola)
    write_tsv(glue_dir / "CoLA" / "dev.tsv", cola)
    sts = [["index", "genre", "filename", "year", "old_index", "source1", "source2",
            "sentence1", "sentence2", "score"]] + [
        [str(i), "g", "f", "y", "0", "s", "s", "a small model", "a large model", f"{i * 0.8}"]
        for i in range(6)]
    write_tsv(glue_dir / "STS-B" / "train.tsv", sts)
    write_tsv(glue_dir / "STS-B" / "dev.tsv", sts)
    for task, metric in (("rte", "accuracy"), ("cola", "mcc"), ("stsb", "pearson")):
        results = glue.main(["--task", task, *common_args(glue_dir, model_dir, tmp_path / "o")])
        assert results["optimizer"] == "mkor-s0" and results["experiment"] == f"glue-{task}"
        assert len(results["steps"]) == 4 and len(results["evals"]) == 2
        assert -1.0 <= results["summary"][metric] <= 1.0
        load_results(tmp_path / "o" / f"glue-{task}" / "mkor-s0" / "results.json")


def rte_data(glue_dir: Path) -> Path:
    """Six RTE examples (train) and four (dev) in the official format."""
    rte = [["index", "sentence1", "sentence2", "label"]] + [
        [str(i), f"The model learns step {i}.", "It learns.",
         ("entailment", "not_entailment")[i % 2]] for i in range(6)]
    write_tsv(glue_dir / "RTE" / "train.tsv", rte)
    write_tsv(glue_dir / "RTE" / "dev.tsv", rte[:4])
    return glue_dir


def test_an_interrupted_finetuning_run_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    """Stopped mid-epoch and mid-way through the next, then resumed twice: the same losses,
    learning rates and scores as an uninterrupted run, and one checkpoint file per save kept."""
    glue_dir = rte_data(tmp_path / "glue_data")
    # 6 examples in batches of 4: 2 steps an epoch, 3 epochs.
    base = ["--task", "rte", *common_args(glue_dir, model_dir, tmp_path / "whole"),
            "--epochs", "3"]
    whole = glue.main(base)
    parts = ["--task", "rte", *common_args(glue_dir, model_dir, tmp_path / "parts"),
             "--epochs", "3"]
    first = glue.main([*parts, "--stop-after", "1"])
    assert first["finished"] is None and len(first["steps"]) == 1 and not first["evals"]
    checkpoints = tmp_path / "parts" / "glue-rte" / "mkor-s0" / "checkpoints"
    assert [checkpoint_step(p) for p in list_checkpoints(checkpoints)] == [1]
    second = glue.main([*parts, "--resume", "--stop-after", "2"])
    assert len(second["steps"]) == 3 and len(second["evals"]) == 1
    resumed = glue.main([*parts, "--resume"])
    assert resumed["finished"] is not None
    assert resumed["config"]["stop_after"] is None  # the finishing invocation's, not the first's
    for key in ("loss", "lr"):
        assert [s[key] for s in resumed["steps"]] == [s[key] for s in whole["steps"]], key
    assert resumed["evals"] == whole["evals"] and resumed["summary"] == whole["summary"]
    assert [s["step"] for s in resumed["steps"]] == list(range(6))
    assert [checkpoint_step(p) for p in list_checkpoints(checkpoints)] == [4, 6]
    again = glue.main([*parts, "--resume"])  # a finished run is not trained again
    assert again["steps"] == resumed["steps"]


def test_finetuning_resume_refuses_other_options_and_a_fresh_run_starts_over(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--resume with another learning rate: status 1 naming the setting; without --resume the
    earlier checkpoints are deleted, so the run trains from step 0."""
    glue_dir = rte_data(tmp_path / "glue_data")
    args = ["--task", "rte", *common_args(glue_dir, model_dir, tmp_path / "o")]
    glue.main([*args, "--stop-after", "1"])
    with pytest.raises(SystemExit) as info:
        glue.main([*args, "--resume", "--lr", "0.5"])
    assert info.value.code == 1
    line = one_error_line(capsys, "python -m reproductions.mkor.glue")
    assert "saved by a run with other settings (lr: 2e-05 saved, 0.5 now)" in line
    fresh = glue.main(args)
    assert [s["step"] for s in fresh["steps"]] == [0, 1, 2, 3]


def test_a_fresh_run_stopped_before_its_first_checkpoint_resumes_as_itself(
        model_dir: Path, tmp_path: Path) -> None:
    """A fresh run deletes the earlier run's results with its checkpoints: stopped before its
    own first checkpoint, then resumed, it starts afresh (before, the earlier run's results
    file was checked against it, and refused its settings)."""
    glue_dir = rte_data(tmp_path / "glue_data")
    args = ["--task", "rte", *common_args(glue_dir, model_dir, tmp_path / "o")]
    glue.main(args)
    with mock.patch.object(finetune, "epoch_batches", side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            glue.main([*args, "--lr", "0.5"])
    resumed = glue.main([*args, "--lr", "0.5", "--resume"])
    assert resumed["finished"] is not None and resumed["config"]["lr"] == 0.5
    assert [s["step"] for s in resumed["steps"]] == [0, 1, 2, 3]


def one_error_line(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    """The single ``<prog>: error: ...`` line on stderr, checked to come without a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    return line


def test_glue_data_errors_end_in_one_line_naming_the_file(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing TSV, a foreign label, a file without examples, one not in UTF-8 and an STS-B
    score that is not a number: status 1, the file (and line) and the fix. The last two were
    UnicodeDecodeError and float()'s ValueError tracebacks."""
    write_tsv(tmp_path / "RTE" / "train.tsv", [["index", "sentence1", "sentence2", "label"],
                                               ["0", "a", "b", "maybe"]])
    write_tsv(tmp_path / "SST-2" / "train.tsv", [["sentence", "label"]])
    (tmp_path / "QNLI").mkdir()
    (tmp_path / "QNLI" / "train.tsv").write_bytes(b"index\tquestion\tsentence\tlabel\n"
                                                  b"0\tCaf\xe9?\tYes.\tentailment\n")
    write_tsv(tmp_path / "STS-B" / "train.tsv", [["sentence1", "sentence2", "score"],
                                                 ["a", "b", "1.5"], ["a", "c", "high"]])
    for task, text in (("mrpc", "MRPC/train.tsv is not available. Fix: --data-dir must hold"),
                       ("rte", "RTE/train.tsv:2: label 'maybe' is not one of"),
                       ("sst2", "SST-2/train.tsv: no examples. Fix: --data-dir must hold"),
                       ("qnli", "QNLI/train.tsv: not UTF-8 text ('utf-8' codec can't decode "
                                "byte 0xe9"),
                       ("stsb", "STS-B/train.tsv:3: score 'high' is not a number. Fix: "
                                "--data-dir must hold")):
        with pytest.raises(SystemExit) as info:
            glue.main(["--task", task, *common_args(tmp_path, model_dir, tmp_path / "o")])
        assert info.value.code == 1, task
        assert text in one_error_line(capsys, "python -m reproductions.mkor.glue"), task


def test_finetuning_refuses_a_missing_model_in_one_line(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No directory, or one without a tokenizer and weights: status 1, naming it and the fix."""
    (tmp_path / "empty").mkdir()
    for model in (tmp_path / "nonexistent", tmp_path / "empty"):
        for entry in (glue, squad):  # (a stride that fits squad's 32-token windows)
            task = ["--task", "rte"] if entry is glue else ["--doc-stride", "8"]
            with pytest.raises(SystemExit) as info:
                entry.main([*task, *common_args(tmp_path, model, tmp_path / "o")])
            assert info.value.code == 1
            line = one_error_line(capsys, f"python -m {entry.__name__}")
            assert str(model) in line and "Fix: pass --model the model directory" in line


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--epochs", "0", "0 is not >= 1"), ("--epochs", "-1", "-1 is not >= 1"),
    ("--batch-size", "0", "0 is not >= 1"), ("--max-seq-len", "0", "0 is not >= 1"),
    ("--max-steps", "0", "0 is not >= 1"),
    ("--lr", "0", "0.0 is not > 0.0"),  # AdamW's ValueError traceback before
    ("--warmup", "1.5", "1.5 is not [0.0, 1.0]"),  # accepted silently before
    ("--weight-decay", "-0.1", "-0.1 is not >= 0.0"),
    ("--lr", "nan", "nan is not > 0.0"),
])
def test_finetuning_refuses_numbers_out_of_range(option: str, value: str, says: str,
                                                 model_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's exit (status 2, one line naming the option) before anything is loaded."""
    for entry in (glue, squad):
        task = ["--task", "rte"] if entry is glue else []
        with pytest.raises(SystemExit) as info:
            entry.main([*task, *common_args(tmp_path, model_dir, tmp_path / "o"), option, value])
        assert info.value.code == 2
        assert f"argument {option}: {says}" in one_error_line(capsys,
                                                             f"python -m {entry.__name__}")


def test_finetuning_refuses_cuda_without_cuda_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """``--device cuda`` passed argparse and failed with a traceback once the model and data
    were loaded; now argparse refuses it (status 2, one line) before anything is read."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for entry in (glue, squad):
        task = ["--task", "rte"] if entry is glue else []
        with pytest.raises(SystemExit) as info:
            entry.main([*task, *common_args(tmp_path, tmp_path / "model", tmp_path / "o"),
                        "--device", "cuda"])
        assert info.value.code == 2
        assert "argument --device: 'cuda': no CUDA device here" in one_error_line(
            capsys, f"python -m {entry.__name__}")


def test_finetuning_refuses_an_out_that_cannot_be_created_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A regular file in the place of --out ended in a traceback once the run wrote to it;
    now it is refused (status 2, one line) before the model is loaded."""
    blocked = tmp_path / "afile"
    blocked.write_text("")
    for entry in (glue, squad):
        task = ["--task", "rte"] if entry is glue else []
        with pytest.raises(SystemExit) as info:
            entry.main([*task, *common_args(tmp_path, tmp_path / "model", blocked)])
        assert info.value.code == 2
        line = one_error_line(capsys, f"python -m {entry.__name__}")
        assert f"invalid --out='{blocked}'" in line and "is not a directory" in line


def test_finetuning_refuses_a_sequence_longer_than_the_models_positions(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was accepted, and the embedding lookup failed mid-run."""
    with pytest.raises(SystemExit) as info:
        glue.main(["--task", "rte", *common_args(tmp_path, model_dir, tmp_path / "o"),
                   "--max-seq-len", "100000"])
    assert info.value.code == 2
    assert "--max-seq-len=100000" in one_error_line(capsys, "python -m reproductions.mkor.glue")

def test_glue_files_as_distributed_mrpc_bom_and_qqp_short_rows(tmp_path: Path) -> None:
    """MRPC's official files start with a byte-order mark, QQP's training file has rows with
    too few columns: the first is read, the second skipped with a warning counting them."""
    mrpc = tmp_path / "train.tsv"
    mrpc.write_text("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
                    "1\t1\t2\tA cat.\tA feline.\n0\t3\t4\tRain.\tSun.\n", encoding="utf-8")
    rows = glue.read_split(mrpc, glue.TASKS["mrpc"])
    assert rows == {"text_a": ["A cat.", "Rain."], "text_b": ["A feline.", "Sun."],
                    "label": [1, 0]}
    qqp = tmp_path / "qqp.tsv"
    qqp.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                   "0\t1\t2\tWhy?\tHow?\t0\n1\t3\t4\tbroken row\n"
                   "2\t5\t6\tWho?\tWhom?\t1\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"skipped 1 rows with fewer than 6 columns \(lines \[3\]"):
        rows = glue.read_split(qqp, glue.TASKS["qqp"])
    assert rows["label"] == [0, 1] and rows["text_a"] == ["Why?", "Who?"]


@pytest.mark.parametrize(("metric", "predictions", "labels", "expected"), [
    ("accuracy", [1, 0, 1], [1, 1, 1], 2 / 3),
    ("f1", [1, 0, 1, 0], [1, 1, 0, 0], 0.5),
    ("mcc", [1, 0, 1, 0], [1, 0, 1, 0], 1.0),
    ("mcc", [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0], 1 / 3),  # tp 2, fp 1, fn 1, tn 2
    ("mcc", [1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0], 0.0),  # tp 1, fp 2, fn 1, tn 2
    ("pearson", [1.0, 2.0, 3.0], [2.0, 4.0, 6.0], 1.0),
])
def test_glue_metrics(metric: str, predictions: list, labels: list, expected: float) -> None:
    assert glue.score(metric, predictions, labels) == pytest.approx(expected)


def squad_file(path: Path) -> None:
    context = ("The optimizer keeps a small factor for every layer. The factor is updated "
               "every ten steps with a rank one update, which is cheap.")
    qas = [{"id": f"q{i}", "question": question,
            "answers": [{"text": answer, "answer_start": context.index(answer)}]}
           for i, (question, answer) in enumerate([
               ("What does the optimizer keep?", "a small factor"),
               ("How often is the factor updated?", "every ten steps"),
               ("What kind of update is it?", "a rank one update")])]
    path.write_text(json.dumps({"version": "1.1", "data": [
        {"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}), encoding="utf-8")


def test_squad(model_dir: Path, tmp_path: Path) -> None:
    squad_dir = tmp_path / "squad"
    squad_dir.mkdir()
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        squad_file(squad_dir / name)
    # A 32-token window with stride 8 splits the context: answers fall into later windows.
    results = squad.main([*common_args(squad_dir, model_dir, tmp_path / "o"), "--doc-stride",
                          "8"])
    assert results["experiment"] == "squad-v1.1" and len(results["evals"]) == 2
    assert 0 <= results["summary"]["exact_match"] <= results["summary"]["f1"] <= 100


def test_squad_refuses_a_stride_as_long_as_the_window_up_front(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--max-seq-len 128 with the default --doc-stride 128 loaded the model, then failed in the
    tokenizer with a traceback; now it ends in one line before anything is loaded."""
    with pytest.raises(SystemExit) as info:
        squad.main([*common_args(tmp_path, tmp_path / "model", tmp_path / "o"),
                    "--max-seq-len", "128"])
    assert info.value.code == 2
    line = one_error_line(capsys, "python -m reproductions.mkor.squad")
    assert "invalid --doc-stride=128: expected fewer than the 125 context tokens" in line


def test_squad_refuses_a_stride_the_longest_question_leaves_no_room_for(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stride below --max-seq-len - 3 may still not fit beside a question: the tokenizer's
    ValueError was a traceback; now one line names --doc-stride and the question's length."""
    squad_dir = tmp_path / "squad"
    squad_dir.mkdir()
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        squad_file(squad_dir / name)
    with pytest.raises(SystemExit) as info:
        squad.main([*common_args(squad_dir, model_dir, tmp_path / "o"), "--doc-stride", "25"])
    assert info.value.code == 2
    line = one_error_line(capsys, "python -m reproductions.mkor.squad")
    assert "invalid --doc-stride=25: expected fewer than the " in line
    assert "beside the longest question" in line


def test_squad_data_not_in_utf8_ends_in_one_line_naming_the_file(
        model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A train-v1.1.json with a Latin-1 byte was a UnicodeDecodeError traceback; now it is
    the one line (status 1) that truncated JSON gets."""
    squad_dir = tmp_path / "squad"
    squad_dir.mkdir()
    squad_file(squad_dir / "dev-v1.1.json")
    (squad_dir / "train-v1.1.json").write_bytes(b'{"version": "1.1", "data": "caf\xe9"}')
    with pytest.raises(SystemExit) as info:
        squad.main([*common_args(squad_dir, model_dir, tmp_path / "o"), "--doc-stride", "8"])
    assert info.value.code == 1
    line = one_error_line(capsys, "python -m reproductions.mkor.squad")
    assert f"{squad_dir / 'train-v1.1.json'}: not SQuAD v1.1 JSON (UnicodeDecodeError: " in line
    assert line.endswith("Fix: --data-dir must hold the official train-v1.1.json and "
                         "dev-v1.1.json")


def test_squad_scoring_and_spans(model_dir: Path, tmp_path: Path) -> None:
    assert squad.exact_match_and_f1("The Factor", ["factor", "x"]) == (1.0, 1.0)
    assert squad.exact_match_and_f1("small factor here", ["a small factor"]) == (0.0, 0.8)
    squad_file(tmp_path / "s.json")
    questions = squad.read_squad(tmp_path / "s.json")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    features = squad.training_features(tokenizer, questions, 32, 8)
    assert sum(row["start_positions"] > 0 for row in features) >= len(questions)
    for row in features:  # labelled spans decode to the answer (or point at [CLS])
        if row["start_positions"]:
            span = row["input_ids"][row["start_positions"]:row["end_positions"] + 1]
            assert tokenizer.decode(span) in {q["answers"][0] for q in questions}
    with pytest.raises(ValueError, match="not SQuAD v1.1"):
        (tmp_path / "bad.json").write_text('{"data": [{"paragraphs": [{}]}]}')
        squad.read_squad(tmp_path / "bad.json")


def test_a_finished_runs_unreadable_results_file_is_written_again_on_resume(
        model_dir: Path, tmp_path: Path) -> None:
    """A results file cut short after the run finished: ``--resume`` passes over it with a
    warning (its fix had been to restore it from git, which does not keep runs), finds the
    final checkpoint, and writes the file again as it was."""
    glue_dir = rte_data(tmp_path / "glue_data")
    args = ["--task", "rte", *common_args(glue_dir, model_dir, tmp_path / "o")]
    finished = glue.main(args)
    path = tmp_path / "o" / "glue-rte" / "mkor-s0" / "results.json"
    path.write_text(path.read_text()[:50])
    with pytest.warns(UserWarning, match="not valid JSON"):
        again = glue.main([*args, "--resume"])
    assert again["steps"] == finished["steps"] and load_results(path)["steps"] == again["steps"]


def test_squad_normalisation_drops_every_article_and_a_stride_must_leave_new_context() -> None:
    assert squad.exact_match_and_f1("an apple", ["apple"]) == (1.0, 1.0)
    assert squad.exact_match_and_f1("The apple", ["a apple"]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="stride"):
        squad.check_doc_stride(125, 128)  # 125 context tokens per window: none new
