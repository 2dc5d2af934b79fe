"""The configuration of a BERT pre-training comparison, its files and its command-line overrides.

One :class:`PretrainConfig` describes one experiment: the model, the corpus, the schedule and
every optimizer's options. Experiments live as JSON files in ``reproductions/mkor/configs/``
(``default.json`` is the CPU-sized built-in run, ``bert_large_phase2.json`` the paper's phase 2);
the entry point loads one and applies flags and ``--set key=value`` overrides. Every field is
checked on construction and a bad value raises :class:`core.config.ConfigError` naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from core.config import ConfigError, check_choice, check_number
from core.optim import FIRST_ORDER, OPTIMIZERS, check_preconditioner_options

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""Where the experiment files live; ``--config NAME`` also finds ``CONFIG_DIR/NAME.json``."""

MAX_POSITIONS = 512
"""Position embeddings of every preset (BERT's), so a model can run any seq_len up to 512."""

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64},
    "small": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 512},
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072},
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "intermediate_size": 4096},
}
"""BERT shapes by name; ``bert-large`` is the paper's BERT-Large-Uncased (24 x 1024, 16 heads)."""

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SCHEDULES = ("poly", "linear")

_FINITE = {"high": math.inf, "high_inclusive": False}


def _check_strings(name: str, value: Any) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a non-empty list of strings."""
    if (not isinstance(value, list) or not value
            or not all(isinstance(item, str) for item in value)):
        raise ConfigError(name, value, "a non-empty list of strings")


def _check_distinct(name: str, value: list[str]) -> None:
    """Raise :class:`ConfigError` if an item of ``value`` repeats (an optimizer listed twice
    would run twice into one run directory)."""
    repeated = sorted({item for item in value if value.count(item) > 1})
    if repeated:
        raise ConfigError(name, value, "distinct names, each listed once: "
                          + ", ".join(f"{item!r}" for item in repeated) + " more than once")


def _help(text: str, default: Any = MISSING, factory: Any = MISSING) -> Any:
    """A dataclass field carrying its help text (shown by ``--help`` and the README)."""
    if factory is not MISSING:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass(kw_only=True)
class WarmStart:
    """A short LAMB pre-training run whose final weights every compared optimizer starts from.

    The paper runs only phase 2 with each optimizer, from one LAMB phase-1 checkpoint; at small
    scale the warm start plays phase 1 (shorter sequences, LAMB, same corpus and batch size).
    """

    steps: int = _help("LAMB steps of the warm start", 200)
    seq_len: int = _help("sequence length of the warm start (the paper's phase 1 uses 128)", 64)
    lr: float = _help("peak learning rate of the warm start (phase 1: 6e-3)", 6e-3)
    warmup: float = _help("fraction of warm-start steps with a linear warm-up (phase 1: 0.2843)",
                          0.2843)

    def __post_init__(self) -> None:
        check_number("warm_start.steps", self.steps, low=1, integer=True)
        check_number("warm_start.seq_len", self.seq_len, low=8, high=MAX_POSITIONS,
                     integer=True)
        check_number("warm_start.lr", self.lr, low=0.0, low_inclusive=False, **_FINITE)
        check_number("warm_start.warmup", self.warmup, low=0.0, high=1.0)


@dataclass(kw_only=True)
class PretrainConfig:
    """All settings of one experiment; the field help texts are the reference documentation."""

    experiment: str = _help("experiment name: W&B group, results sub-directory", "default")
    description: str = _help("what the experiment reproduces (informational)", "")
    launch: str = _help("the exact command that runs it (informational)", "")
    model: str = _help("BERT shape: " + ", ".join(MODEL_PRESETS), "small")
    corpus: list[str] = _help(
        "'builtin' (the English corpus of data/), local .txt/.parquet/.json(l) files, or a "
        "Hugging Face dataset name[:config] (needs network)", factory=lambda: ["builtin"])
    text_column: str = _help("text column of parquet/json/Hub corpora", "text")
    tokenizer: str = _help(
        "'wordpiece' (train a lowercase WordPiece vocabulary on the corpus, cached; builtin or "
        "one .txt corpus), a directory with vocab.txt or a saved tokenizer, or a Hub "
        "tokenizer name", "wordpiece")
    vocab_size: int = _help("WordPiece vocabulary size when tokenizer is 'wordpiece'", 8000)
    seq_len: int = _help("tokens per example: [CLS] A [SEP] B [SEP] (phase 2: 512)", 128)
    batch_size: int = _help("global examples per optimizer step (phase 2: 32768)", 32)
    micro_batch_size: int | None = _help(
        "examples per process per forward pass; batch_size / (micro_batch_size * processes) "
        "micro-batches are accumulated (default: no accumulation)", None)
    steps: int = _help("optimizer steps per compared optimizer (phase 2: 1563)", 300)
    optimizers: list[str] = _help("optimizers to compare, in order: " + ", ".join(OPTIMIZERS),
                                  factory=lambda: ["lamb", "kfac", "mkor", "mkor-h", "eva"])
    base: str = _help("first-order optimizer under the second-order ones (the paper: lamb)",
                      "lamb")
    lr: float = _help("peak learning rate, the same for every optimizer (phase 2: 4e-3)", 4e-3)
    warmup: float = _help("fraction of steps with a linear LR warm-up (phase 2: 0.128)", 0.128)
    schedule: str = _help("LR decay after warm-up: 'poly' (power poly_power, NVIDIA's) or "
                          "'linear'", "poly")
    poly_power: float = _help("power of the polynomial decay", 0.5)
    weight_decay: float = _help("weight decay (not on biases and LayerNorms)", 0.01)
    preconditioner: dict[str, dict[str, Any]] = _help(
        "options per second-order optimizer, passed to core.build_optimizer (e.g. "
        "{'kfac': {'factor_update_steps': 50, 'inv_update_steps': 50}})", factory=dict)
    dropout: float = _help("hidden and attention dropout", 0.1)
    mlm_probability: float = _help("fraction of tokens masked for the MLM loss", 0.15)
    eval_fraction: float = _help("fraction of examples held out for evaluation", 0.01)
    eval_every: int = _help("evaluate every this many steps (and after the last)", 50)
    eval_batches: int = _help("held-out batches per evaluation", 8)
    checkpoint_every: int = _help("checkpoint (and rewrite the results file) every this many "
                                  "steps, and after the last", 100)
    smooth_window: int = _help("steps averaged for the final loss and the time-to-target", 20)
    seed: int = _help("seed of weights, data order, masking and dropout (same for every "
                      "optimizer)", 0)
    precision: str = _help("'auto' (bf16 autocast on GPUs that have it, else fp16 with loss "
                           "scaling; fp32 on CPU), 'fp32', 'bf16' or 'fp16'", "auto")
    warm_start: WarmStart | None = _help("a LAMB run whose final weights all optimizers start "
                                         "from (null: start from init_checkpoint or scratch)",
                                         None)
    init_checkpoint: str | None = _help(
        "weights to start from: a directory saved by save_pretrained (e.g. a phase-1 "
        "checkpoint) or a .pt state dict; overrides warm_start", None)

    def __post_init__(self) -> None:
        for name in ("experiment", "description", "launch", "text_column", "tokenizer"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "a string")
        if not isinstance(self.init_checkpoint, str | None):
            raise ConfigError("init_checkpoint", self.init_checkpoint, "a path or null")
        if isinstance(self.warm_start, dict):
            self.warm_start = _from_dict(WarmStart, self.warm_start, "warm_start.")
        if not isinstance(self.warm_start, WarmStart | None):
            raise ConfigError("warm_start", self.warm_start, "an object of WarmStart fields or "
                              "null")
        check_choice("model", self.model, tuple(MODEL_PRESETS))
        _check_strings("optimizers", self.optimizers)
        for name in self.optimizers:
            check_choice("optimizers", name, OPTIMIZERS)
        _check_distinct("optimizers", self.optimizers)
        check_choice("base", self.base, FIRST_ORDER)
        if not isinstance(self.preconditioner, dict):
            raise ConfigError("preconditioner", self.preconditioner,
                              "an object of options per second-order optimizer")
        for name, options in self.preconditioner.items():
            check_choice("preconditioner", name, tuple(o for o in OPTIMIZERS
                                                       if o not in FIRST_ORDER))
            if not isinstance(options, dict):
                raise ConfigError(f"preconditioner.{name}", options, "an object of options")
            try:  # now, not after the corpus and the model are loaded
                check_preconditioner_options(name, options)
            except ConfigError as err:
                raise ConfigError(f"preconditioner.{name}.{err.field_name}", err.value,
                                  err.allowed) from None
        _check_strings("corpus", self.corpus)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("schedule", self.schedule, SCHEDULES)
        for name, low in (("vocab_size", 16), ("batch_size", 1), ("steps", 1),
                          ("eval_every", 1), ("eval_batches", 1), ("checkpoint_every", 1),
                          ("smooth_window", 1), ("seed", 0)):
            check_number(name, getattr(self, name), low=low, integer=True)
        check_number("seq_len", self.seq_len, low=8, high=MAX_POSITIONS, integer=True)
        if self.micro_batch_size is not None:
            check_number("micro_batch_size", self.micro_batch_size, low=1, integer=True)
        check_number("lr", self.lr, low=0.0, low_inclusive=False, **_FINITE)
        for name in ("warmup", "dropout"):
            check_number(name, getattr(self, name), low=0.0, high=1.0)
        # below 1: holding out every line leaves nothing to train on
        check_number("eval_fraction", self.eval_fraction, low=0.0, high=1.0,
                     high_inclusive=False)
        check_number("mlm_probability", self.mlm_probability, low=0.0, high=1.0,
                      low_inclusive=False)
        check_number("poly_power", self.poly_power, low=0.0, low_inclusive=False, **_FINITE)
        check_number("weight_decay", self.weight_decay, low=0.0, **_FINITE)

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per process per step; ``batch_size`` must split evenly.

        Raises:
            ConfigError: ``batch_size`` is not a multiple of ``micro_batch_size * world_size``.
        """
        micro = self.micro_batch_size or self.batch_size // world_size
        if micro < 1 or self.batch_size % (micro * world_size):
            raise ConfigError("batch_size", self.batch_size,
                              f"a multiple of micro_batch_size ({micro}) x processes "
                              f"({world_size})")
        return self.batch_size // (micro * world_size)

    def micro_batch(self, world_size: int) -> int:
        """Examples per process per forward pass."""
        return self.batch_size // (self.accumulation_steps(world_size) * world_size)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON data (for results files, W&B and checkpoints)."""
        return asdict(self)


def _from_dict(kind: type, data: dict[str, Any], prefix: str = "") -> Any:
    names = [f.name for f in fields(kind)]
    for key in data:
        if key not in names:
            raise ConfigError(prefix + key, data[key], f"a {kind.__name__} field: "
                              + ", ".join(names))
    return kind(**data)


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A config file by path, or by name in :data:`CONFIG_DIR` (``default`` -> default.json).

    Raises:
        ConfigError: neither exists; the message lists the shipped configs.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{path.name.removesuffix('.json')}.json"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
    raise ConfigError("config", str(name_or_path), f"a JSON file or a shipped config: {names}")


def load_config(name_or_path: str | Path) -> PretrainConfig:
    """Read and validate a JSON experiment file.

    Raises:
        ConfigError: no such file, not a JSON object, or an unknown or invalid field (named,
            with the file).
    """
    path = resolve_config_path(name_or_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), f"line {exc.lineno}", f"valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), data, "a JSON object of PretrainConfig fields")
    try:
        return _from_dict(PretrainConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"{exc.field_name} (in {path})", exc.value, exc.allowed) from None


def apply_overrides(config: PretrainConfig, overrides: dict[str, Any]) -> PretrainConfig:
    """A copy of ``config`` with dotted-key overrides applied and validated.

    Args:
        config: The loaded configuration.
        overrides: ``{"lr": 1e-3, "preconditioner.kfac.damping": 0.01,
            "warm_start.steps": 50, "warm_start": None}``; None values from absent flags
            must be dropped by the caller.

    Raises:
        ConfigError: an unknown field or an invalid value.
    """
    data = config.to_dict()
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for i, key in enumerate(parents):
            if key not in node and not (i == 1 and parents[0] == "preconditioner"):
                raise ConfigError(dotted, value, "a config field (see --help)")
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                raise ConfigError(dotted, value, f"a config field ({key} has no fields)")
        if not parents and leaf not in data:
            raise ConfigError(dotted, value, "a config field (see --help)")
        node[leaf] = value
    return _from_dict(PretrainConfig, data)


def parse_assignment(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as JSON when it parses (``0.1``, ``null``, ``[1,2]``),
    else as a string.

    Raises:
        ConfigError: no ``=`` or no key (named as the ``--set`` option).
    """
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError("--set", text, "KEY=VALUE with a JSON value, e.g. lr=0.001")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def field_help() -> list[tuple[str, str, Any]]:
    """``(name, help, default)`` of every field, warm-start fields as ``warm_start.<name>``."""
    rows = []
    for kind, prefix in ((PretrainConfig, ""), (WarmStart, "warm_start.")):
        for f in fields(kind):
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((prefix + f.name, f.metadata["help"], default))
    return rows

