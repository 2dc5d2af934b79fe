"""The BERT model of the reproduction: ``BertForPreTraining`` from a config, never downloaded.

The pre-training loss is computed here rather than by the model so that its two parts (masked
language model and next-sentence prediction) can be logged separately; their sum is exactly the
``loss`` that ``BertForPreTraining`` returns when given both kinds of labels.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, BertForPreTraining

from data.errors import DataUnavailableError
from reproductions.common.checkpoint import CheckpointError
from reproductions.mkor.config import MAX_POSITIONS, MODEL_PRESETS


def bert_config(preset: str, vocab_size: int, dropout: float) -> BertConfig:
    """The ``BertConfig`` of a preset (see :data:`reproductions.mkor.config.MODEL_PRESETS`).

    Args:
        preset: The shape's name, e.g. ``"bert-large"``.
        vocab_size: The tokenizer's vocabulary, rounded up to a multiple of 8 (as NVIDIA's
            BERT pads 30522 to 30528) so the decoder's matrix shapes suit tensor cores.
        dropout: Hidden and attention dropout probability.
    """
    padded = -(-vocab_size // 8) * 8
    return BertConfig(vocab_size=padded, max_position_embeddings=MAX_POSITIONS,
                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                      **MODEL_PRESETS[preset])


def _checkpoint_fix(preset: str) -> str:
    return (f"pass --init-checkpoint a save_pretrained directory or a torch.save'd state dict "
            f"of a {preset!r} BERT with this tokenizer (config field init_checkpoint)")


def existing_checkpoint(preset: str, init_checkpoint: str | Path) -> Path:
    """``init_checkpoint`` as a path, checked to exist (before a run deletes anything).

    Raises:
        DataUnavailableError: it does not exist; the message says what to pass.
    """
    path = Path(init_checkpoint).expanduser()
    if not path.exists():
        raise DataUnavailableError(f"init_checkpoint {path}", _checkpoint_fix(preset))
    return path


def build_model(preset: str, vocab_size: int, dropout: float,
                init_checkpoint: str | Path | None = None) -> BertForPreTraining:
    """A freshly initialised ``BertForPreTraining``, optionally loaded from a checkpoint.

    Args:
        preset: The shape's name.
        vocab_size: The tokenizer's vocabulary size.
        dropout: Dropout probability.
        init_checkpoint: A ``save_pretrained`` directory or a ``.pt`` model state dict (e.g. a
            warm start's or phase 1's final weights); None keeps the random initialisation.

    Raises:
        DataUnavailableError: ``init_checkpoint`` does not exist.
        CheckpointError: it cannot be read, or its weights do not fit the preset and vocabulary
            (the message lists the mismatches).
    """
    model = BertForPreTraining(bert_config(preset, vocab_size, dropout))
    if init_checkpoint is None:
        return model
    path = existing_checkpoint(preset, init_checkpoint)
    fix = _checkpoint_fix(preset)
    state = _read_weights(path, fix)
    own = model.state_dict()
    bad = [k for k, v in state.items()
           if k in own and not (isinstance(v, Tensor) and own[k].shape == v.shape)]
    missing = sorted(set(own) - set(state))
    if bad or missing:
        raise CheckpointError(f"init_checkpoint {path} does not fit model {preset!r}: shape "
                              f"mismatches {bad[:5]}, missing {missing[:5]}; {fix}")
    model.load_state_dict(state, strict=False)
    return model


def _read_weights(path: Path, fix: str) -> dict[str, Tensor]:
    """The state dict of an existing ``save_pretrained`` directory or ``.pt`` file.

    Any failure to read it (no weights in the directory, a damaged or foreign file, a file
    holding something other than a dict) comes from the user's file, not from a bug, so it is
    reported in one line.

    Raises:
        CheckpointError: naming ``path``, why it cannot be read, and ``fix``.
    """
    try:
        if path.is_dir():
            return BertForPreTraining.from_pretrained(path, local_files_only=True).state_dict()
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever the loader raises, the file is not usable weights
        raise CheckpointError(f"init_checkpoint {path} cannot be loaded "
                              f"({describe_load_error(exc)}); {fix}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"init_checkpoint {path} holds a {type(state).__name__}, not a "
                              f"state dict; {fix}")
    return state


def describe_load_error(exc: Exception) -> str:
    """``"<type>: <first sentence>"`` of an error that torch or transformers raised loading a file.

    The first sentence says what failed; the next ones advise the loader's own callers (e.g. to
    load without ``weights_only``), not the person running a command, so they are left out.
    """
    first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def pretraining_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Forward a batch and return ``(mlm + nsp, mlm, nsp)`` losses (means over the batch).

    Args:
        model: A ``BertForPreTraining`` (or its DDP wrapper).
        batch: ``input_ids``, ``token_type_ids``, ``attention_mask``, ``labels`` (-100 where not
            masked) and ``next_sentence_label``.
    """
    out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                attention_mask=batch["attention_mask"])
    logits = out.prediction_logits
    mlm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                          batch["labels"].reshape(-1), ignore_index=-100)
    nsp = F.cross_entropy(out.seq_relationship_logits.float(), batch["next_sentence_label"])
    return mlm + nsp, mlm, nsp
