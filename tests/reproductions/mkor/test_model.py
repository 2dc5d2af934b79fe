"""The model: shapes from presets, the loss split, loading initial weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    with pytest.raises(ValueError, match="does not fit model 'small'"):
        build_model("small", vocab_size=64, dropout=0.1, init_checkpoint=tmp_path / "weights.pt")
    with pytest.raises(FileNotFoundError):
        build_model("tiny", vocab_size=64, dropout=0.1, init_checkpoint=tmp_path / "none.pt")
