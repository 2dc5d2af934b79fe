"""The model: shapes from presets, the loss split, loading initial weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.errors import DataUnavailableError
from reproductions.common.checkpoint import CheckpointError
from reproductions.mkor import bert
from reproductions.mkor.model import build_model, pretraining_loss


def test_loss_parts_sum_to_the_models_own_loss() -> None:
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=61, dropout=0.0)
    assert model.config.vocab_size == 64  # padded to a multiple of 8
    ids = torch.randint(5, 61, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
             "attention_mask": torch.ones_like(ids), "labels": labels,
             "next_sentence_label": torch.tensor([0, 1])}
    total, mlm, nsp = pretraining_loss(model, batch)
    reference = model(**{k: v for k, v in batch.items()}).loss
    torch.testing.assert_close(total, reference)
    torch.testing.assert_close(total, mlm + nsp)


def test_initial_weights(tmp_path: Path) -> None:
    source = build_model("tiny", vocab_size=64, dropout=0.1)
    source.save_pretrained(tmp_path / "hf")
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    for path in (tmp_path / "hf", tmp_path / "weights.pt"):
        loaded = build_model("tiny", vocab_size=64, dropout=0.1, init_checkpoint=path)
        for name, value in source.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], value), name


def bad_initial_weights(tmp_path: Path) -> dict[str, tuple[Path, type[Exception], str]]:
    """Each kind of unusable ``init_checkpoint`` for a tiny model of vocabulary 64: the path,
    the error it must raise and a part of its message."""
    torch.save(build_model("small", vocab_size=64, dropout=0.1).state_dict(),
               tmp_path / "small.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    (tmp_path / "empty").mkdir()
    return {"missing": (tmp_path / "none.pt", DataUnavailableError, "is not available. Fix:"),
            "other size": (tmp_path / "small.pt", CheckpointError, "does not fit model 'tiny'"),
            "junk": (tmp_path / "junk.pt", CheckpointError, "cannot be loaded (UnpicklingError"),
            "not a dict": (tmp_path / "list.pt", CheckpointError, "holds a list"),
            "no weights": (tmp_path / "empty", CheckpointError, "no file named model")}


def test_unusable_initial_weights_are_user_errors_naming_the_file_and_fix(
        tmp_path: Path) -> None:
    for case, (path, error, text) in bad_initial_weights(tmp_path).items():
        with pytest.raises(error) as info:
            build_model("tiny", vocab_size=64, dropout=0.1, init_checkpoint=path)
        message = str(info.value)
        assert message.startswith(f"init_checkpoint {path} "), case
        assert text in message and "\n" not in message, case
        assert "pass --init-checkpoint a save_pretrained directory" in message, case


def test_bad_init_checkpoint_ends_the_command_in_one_line(
        run_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Missing, foreign-sized, junk, non-dict and empty: status 1 and one line, no traceback."""
    for case, (path, _, text) in bad_initial_weights(tmp_path).items():
        with pytest.raises(SystemExit) as info:
            bert.main([*run_args, "--optimizers", "lamb", "--wandb", "disabled",
                       "--init-checkpoint", str(path)])
        assert info.value.code == 1, case
        err = capsys.readouterr().err
        (line,) = [line for line in err.splitlines() if "error:" in line]
        assert line.startswith(f"python -m reproductions.mkor.bert: error: init_checkpoint "
                               f"{path} "), case
        assert text in line and "Traceback" not in err, case
