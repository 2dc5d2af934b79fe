"""Experiment files and overrides: the shipped configs, the paper's settings, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import ConfigError, KFACConfig
from reproductions.mkor.config import (
    CONFIG_DIR,
    PretrainConfig,
    apply_overrides,
    load_config,
    parse_assignment,
)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_configs_load(path: Path) -> None:
    config = load_config(path)
    assert config.experiment == path.stem and config.description and config.launch


def test_paper_phase2_settings() -> None:
    config = load_config("bert_large_phase2")
    assert (config.model, config.seq_len, config.batch_size, config.steps) == (
        "bert-large", 512, 32768, 1563)
    assert (config.lr, config.warmup, config.weight_decay) == (4e-3, 0.128, 0.01)
    assert config.precision == "fp16"  # the official config's fp16 (auto is bf16 on A100)
    assert config.preconditioner["kfac"]["factor_update_steps"] == 50
    assert config.preconditioner["kfac"]["inv_update_steps"] == 50
    # KAISA's default: factors built and all-reduced in the backward hooks (valid options)
    assert KFACConfig(**config.preconditioner["kfac"]).factors_in_backward
    # KAISA as the official MKOR BERT runner builds it (comm_method=MEM_OPT, KAISA's default
    # pre-divided eigenvalues)
    assert config.preconditioner["kfac"]["strategy"] == "mem-opt"
    assert KFACConfig(**config.preconditioner["kfac"]).state_method == "eigen_prediv"
    assert config.preconditioner["mkor"]["inv_update_steps"] == 10
    assert config.preconditioner["mkor-h"]["inv_update_steps"] == 10
    assert config.accumulation_steps(64) == 64 and config.micro_batch(64) == 8
    assert "torchrun" in config.launch and "Table" in config.description


def test_overrides() -> None:
    config = apply_overrides(load_config("default"), {
        "lr": 1e-3, "preconditioner.kfac.damping": 0.01, "preconditioner.eva.kl_clip": None,
        "warm_start.steps": 5, "optimizers": ["lamb", "mkor"]})
    assert config.lr == 1e-3 and config.optimizers == ["lamb", "mkor"]
    assert config.preconditioner["kfac"]["damping"] == 0.01
    assert config.preconditioner["eva"]["kl_clip"] is None
    assert config.warm_start is not None and config.warm_start.steps == 5
    assert apply_overrides(config, {"warm_start": None}).warm_start is None
    fresh = apply_overrides(PretrainConfig(), {"warm_start.seq_len": 32})
    assert fresh.warm_start is not None and fresh.warm_start.seq_len == 32


@pytest.mark.parametrize(("overrides", "field"), [
    ({"lerning_rate": 0.1}, "lerning_rate"),
    ({"warm_start.stepz": 1}, "warm_start.stepz"),
    ({"model": "bert-huge"}, "model"),
    ({"optimizers": ["lamb", "adam"]}, "optimizers"),
    ({"preconditioner.lamb.x": 1}, "preconditioner"),
    ({"lr": -1.0}, "lr"),
    ({"warm_start.lr": 0.0}, "warm_start.lr"),
    ({"precision": "fp8"}, "precision"),
    ({"preconditioner.kfac.damping": -1.0}, "preconditioner.kfac.damping"),
    ({"preconditioner.mkor.stat_decay_typo": 0.9}, "preconditioner.mkor.stat_decay_typo"),
    ({"preconditioner.mkor-h.window": 0}, "preconditioner.mkor-h.window"),
    ({"seq_len": 1000}, "seq_len"),  # beyond the 512 positions: a traceback after the data
    ({"warm_start.seq_len": 600}, "warm_start.seq_len"),
    ({"eval_fraction": 1.0}, "eval_fraction"),  # nothing left to train on: datasets' traceback
])
def test_errors_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(load_config("tiny"), overrides)
    assert info.value.field_name == field


def test_an_optimizer_listed_twice_is_refused() -> None:
    """``--optimizers lamb,lamb`` ran LAMB twice into the same run directory."""
    with pytest.raises(ConfigError, match=r"invalid optimizers=\['lamb', 'mkor', 'lamb'\]: "
                                          r"expected distinct names, .*'lamb' more than once"):
        apply_overrides(load_config("tiny"), {"optimizers": ["lamb", "mkor", "lamb"]})


def test_accumulation_must_divide() -> None:
    config = PretrainConfig(batch_size=32, micro_batch_size=8)
    assert config.accumulation_steps(1) == 4 and config.accumulation_steps(4) == 1
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        config.accumulation_steps(3)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no-such-experiment.*default"):
        load_config("no-such-experiment")
    broken = tmp_path / "broken.json"
    broken.write_text('{"steps": 3,')
    with pytest.raises(ConfigError, match="broken.json"):
        load_config(broken)
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"stepz": 3}')
    with pytest.raises(ConfigError, match=r"stepz \(in .*unknown.json\)"):
        load_config(unknown)


def test_parse_assignment() -> None:
    assert parse_assignment("lr=0.1") == ("lr", 0.1)
    assert parse_assignment("corpus=[\"a.txt\"]") == ("corpus", ["a.txt"])
    assert parse_assignment("tokenizer=bert-base-uncased") == ("tokenizer", "bert-base-uncased")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_assignment("lr")
