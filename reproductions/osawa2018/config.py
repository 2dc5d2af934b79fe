"""The run configuration: one typed, validated dataclass, read from ``configs/*.json``.

Every field maps to a switch of the recipe (PAPERS.md §2.2, §2.5). The official chainerkfac
ImageNet configs translate as: ``lr``, ``momentum``, ``adjust_momentum``, ``damping`` as they are;
``epoch_lr_decay_start`` → ``lr_decay_start_epoch``; ``polynomial_epoch`` → ``lr_decay_end_epoch``;
``polynomial_decay_p`` → ``lr_power``; ``cov_ema_decay`` r (weight of the *new* statistic) →
``factor_decay = 1 − r``; ``stab_coeff`` → ``bn_damping_scale``; ``normalize_weight`` →
``weight_rescaling``; ``re_rate``/``re_area_rl``/``re_area_rh``/``re_aspect_rl`` → ``erasing_*``;
the global batch is ``#GPUs × batchsize × acc_iters``; their ``epoch`` is our ``epochs`` + 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from core.batchnorm import BN_FISHER_MODES
from core.config import (
    ASSIGNMENT_POLICIES,
    PRECONDITION_DTYPES,
    STRATEGIES,
    ConfigError,
    check_choice,
    check_number,
)
from reproductions.osawa2018.mixup import MIN_ALPHA as MIN_MIXUP_ALPHA
from reproductions.osawa2018.models import MODELS

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DATASETS = ("fashion-mnist", "image-folder")
OPTIMIZERS = ("kfac", "sgd")
BN_CHOICES = (*BN_FISHER_MODES, "none")
MAX_SEED = 2**63 - 1
"""The largest seed torch's generators accept (with the rank added)."""
MAX_EPOCHS = 1e6
"""More epochs than any run trains (far beyond it ``N·epochs/B`` overflows the update count)."""

_FINITE = {"high": math.inf, "high_inclusive": False}


def _is_real(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_erasing_area(area: Any) -> None:
    """``[low, high]`` fractions of the image area with ``0 < low <= high <= 1``."""
    if (not isinstance(area, list | tuple) or len(area) != 2 or not all(map(_is_real, area))
            or not 0.0 < area[0] <= area[1] <= 1.0):
        raise ConfigError("erasing_area", area, "[low, high] with 0 < low <= high <= 1")


def _check_intervals(intervals: Any) -> None:
    """``[[epoch, interval], ...]``: epochs from 0, increasing; intervals integers >= 1."""
    allowed = ("a non-empty list of [epoch, interval] pairs, epochs increasing from 0, "
               "intervals integers >= 1")
    if (not isinstance(intervals, list) or not intervals
            or any(not isinstance(p, list | tuple) or len(p) != 2 for p in intervals)):
        raise ConfigError("factor_update_intervals", intervals, allowed)
    epochs = [epoch for epoch, _ in intervals]
    steps = [interval for _, interval in intervals]
    if (not all(map(_is_real, epochs)) or epochs[0] != 0
            or any(later <= earlier for earlier, later in zip(epochs, epochs[1:], strict=False))
            or any(not isinstance(i, int) or isinstance(i, bool) or i < 1 for i in steps)):
        raise ConfigError("factor_update_intervals", intervals, allowed)


@dataclass(kw_only=True)
class OsawaConfig:
    """One training run.

    Attributes:
        name: Experiment name (results file, W&B group).
        source: Where the values come from (free text, e.g. the official config file).
        data: ``fashion-mnist`` (built in) or ``image-folder`` (ImageNet layout).
        model: ``small_resnet`` or ``resnet50``.
        width: First-stage width of ``small_resnet``.
        image_size: Crop size for ``image-folder`` data.
        batch_size: Global mini-batch ``B`` per update.
        micro_batch_size: Examples per process per forward/backward; ``B`` must be a multiple of
            ``world_size × micro_batch_size`` and the quotient is the accumulation steps.
        epochs: Training length in (possibly fractional) epochs; updates = ceil(N·epochs/B).
        eval_every_epochs: Evaluate on the test split every this many epochs (and at the end).
        eval_batch_size: Examples per process per evaluation forward pass.
        target_accuracy: Test accuracy whose first crossing is reported (epochs and iterations).
        num_workers: DataLoader worker processes.
        optimizer: ``kfac`` (preconditioned heavy-ball momentum) or ``sgd`` (heavy-ball only).
        lr: Initial learning rate ``lr₀``.
        lr_decay_start_epoch: ``e_start`` of the polynomial decay.
        lr_decay_end_epoch: ``e_end``; the decay uses ``max(epochs, e_end)``
            (:attr:`lr_end_epoch`).
        lr_power: ``p`` of the polynomial decay.
        momentum: Base momentum ``m``.
        adjust_momentum: Scale ``m`` by ``lr_t/lr_{t-1}`` at steps where the rate fell.
        weight_decay: L2 coefficient on Conv/Linear weights, added before preconditioning.
        weight_rescaling: Cap each Conv/Linear weight's norm at ``sqrt(2·d_out)`` after updates.
        damping: K-FAC ``λ``; the preconditioner uses ``max(λ, weight_decay)``.
        factor_decay: Weight of the old running factor average (0: the current batch's factors).
        factor_update_intervals: ``[[epoch, interval], …]``: factor and inverse update interval
            in steps from each epoch on (factor-update relaxation); ``[[0, 1]]`` updates every step.
        bn_fisher: BatchNorm Fisher block: ``unit``, ``diagonal``, ``full`` or ``none``
            (first-order BatchNorm).
        bn_damping_scale: BatchNorm damping is this times ``damping`` (``stab_coeff``); not
            raised to ``weight_decay``, which BatchNorm's parameters do not take (chainerkfac
            takes the larger of each parameter's own L2 coefficient and the damping).
        strategy: Distribution strategy of K-FAC across processes (``osawa`` = the paper's).
        precondition_dtype: dtype of the inverses (``bfloat16``: half the memory and fast
            products on bf16 hardware; None: fp32, the paper's), see ``core.KFACConfig``.
        precondition_dtype_tolerance: with ``precondition_dtype``, the product error above
            which a factor stays fp32 (None: every factor rounded), see ``core.KFACConfig``.
        assignment: Layer-to-rank policy: ``contiguous`` (``np.array_split`` of the layers in
            model order; chainerkfac splits its blocks sorted by name, BatchNorm included),
            ``greedy`` (cost-balanced) or ``round-robin``.
        mixup_alpha: Beta parameter of running mixup, at least 0.01; 0 disables mixup.
        running_mixup: Mix with the previous *mixed* batch (else with the previous raw batch).
        erasing_rate: Probability of random erasing per example; 0 disables it.
        erasing_area: ``[low, high]`` erased fraction of the image area.
        erasing_min_aspect: Lower end of the erased rectangle's aspect ratio draw.
        seed: Seed of initialisation, sampling and augmentation.
    """

    name: str = "default"
    source: str = ""
    data: str = "fashion-mnist"
    model: str = "small_resnet"
    width: int = 16
    image_size: int = 224
    batch_size: int = 256
    micro_batch_size: int = 256
    epochs: float = 3.0
    eval_every_epochs: float = 1.0
    eval_batch_size: int = 1000
    target_accuracy: float | None = None
    num_workers: int = 0
    optimizer: str = "kfac"
    lr: float = 0.01
    lr_decay_start_epoch: float = 1.0
    lr_decay_end_epoch: float = 5.0
    lr_power: float = 2.0
    momentum: float = 0.9
    adjust_momentum: bool = True
    weight_decay: float = 0.0
    weight_rescaling: bool = True
    damping: float = 1e-3
    factor_decay: float = 0.0
    factor_update_intervals: list[list[float]] = field(default_factory=lambda: [[0, 1]])
    bn_fisher: str = "unit"
    bn_damping_scale: float = 64.0
    strategy: str = "osawa"
    precondition_dtype: str | None = None
    precondition_dtype_tolerance: float | None = 0.05
    assignment: str = "contiguous"
    mixup_alpha: float = 0.4
    running_mixup: bool = True
    erasing_rate: float = 0.5
    erasing_area: list[float] = field(default_factory=lambda: [0.02, 0.25])
    erasing_min_aspect: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("name", "source"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "a string")
        if not self.name or self.name in (".", "..") or "/" in self.name or "\0" in self.name:
            raise ConfigError("name", self.name, "a non-empty name usable as a directory name")
        check_choice("data", self.data, DATASETS)
        check_choice("model", self.model, MODELS)
        if self.model == "resnet50" and self.data == "fashion-mnist":
            raise ConfigError("model", self.model, "'small_resnet' for data 'fashion-mnist' "
                              "(resnet50 takes 3-channel images)")
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("bn_fisher", self.bn_fisher, BN_CHOICES)
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("assignment", self.assignment, ASSIGNMENT_POLICIES)
        if self.precondition_dtype is not None:  # checked here, before any data is read
            check_choice("precondition_dtype", self.precondition_dtype, PRECONDITION_DTYPES)
        if self.precondition_dtype_tolerance is not None:
            check_number("precondition_dtype_tolerance", self.precondition_dtype_tolerance,
                         low=0.0)
        for name in ("width", "image_size", "batch_size", "micro_batch_size", "eval_batch_size"):
            check_number(name, getattr(self, name), low=1, integer=True)
        if self.batch_size % self.micro_batch_size:
            raise ConfigError("batch_size", self.batch_size,
                              f"a multiple of micro_batch_size={self.micro_batch_size}")
        check_number("num_workers", self.num_workers, low=0, integer=True)
        check_number("seed", self.seed, low=0, high=MAX_SEED, integer=True)
        check_number("epochs", self.epochs, low=0.0, low_inclusive=False, high=MAX_EPOCHS)
        for name in ("eval_every_epochs", "damping", "bn_damping_scale"):
            check_number(name, getattr(self, name), low=0.0, low_inclusive=False, **_FINITE)
        for name in ("lr", "lr_decay_start_epoch", "lr_power", "weight_decay", "mixup_alpha"):
            check_number(name, getattr(self, name), low=0.0, **_FINITE)
        if 0 < self.mixup_alpha < MIN_MIXUP_ALPHA:
            raise ConfigError("mixup_alpha", self.mixup_alpha,
                              f"0 (no mixup) or at least {MIN_MIXUP_ALPHA} (PyTorch's Beta "
                              "sampler drifts to 1/2 below it)")
        check_number("lr_decay_end_epoch", self.lr_decay_end_epoch, low=self.lr_decay_start_epoch,
                     low_inclusive=False, **_FINITE)
        check_number("momentum", self.momentum, low=0.0, high=1.0, high_inclusive=False)
        check_number("factor_decay", self.factor_decay, low=0.0, high=1.0, high_inclusive=False)
        check_number("erasing_rate", self.erasing_rate, low=0.0, high=1.0)
        check_number("erasing_min_aspect", self.erasing_min_aspect, low=0.0, high=1.0,
                     low_inclusive=False)
        if self.target_accuracy is not None:
            check_number("target_accuracy", self.target_accuracy, low=0.0, high=1.0)
        for name in ("adjust_momentum", "weight_rescaling", "running_mixup"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "true or false")
        _check_erasing_area(self.erasing_area)
        _check_intervals(self.factor_update_intervals)

    @property
    def effective_damping(self) -> float:
        """``max(λ, weight_decay)``, the damping the K-FAC layers use (chainerkfac)."""
        return max(self.damping, self.weight_decay)

    @property
    def lr_end_epoch(self) -> float:
        """``max(epochs, lr_decay_end_epoch)``, where the rate reaches 0. chainerkfac takes
        ``max(epoch, polynomial_epoch)`` with its ``epoch`` field, which is ``epochs + 1``:
        the same for every shipped ImageNet config (their ``e_end`` ≥ ``epochs + 1``); where
        ``e_end < epochs + 1``, ours reaches 0 when training ends and theirs would not."""
        return max(self.epochs, self.lr_decay_end_epoch)

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-steps per update for ``world_size`` processes.

        Raises:
            ConfigError: ``batch_size`` is not a multiple of ``world_size × micro_batch_size``.
        """
        per_step = world_size * self.micro_batch_size
        if self.batch_size % per_step:
            raise ConfigError("batch_size", self.batch_size,
                              f"a multiple of world_size × micro_batch_size = {per_step}")
        return self.batch_size // per_step

    def total_steps(self, dataset_size: int) -> int:
        """Updates in the run: ``ceil(N · epochs / B)``, at least 1."""
        return max(1, math.ceil(dataset_size * self.epochs / self.batch_size - 1e-9))

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain JSON-compatible values."""
        return asdict(self)


def load_config(path: Path | str, overrides: dict[str, Any] | None = None) -> OsawaConfig:
    """Read a config file (a path, or a name in ``configs/`` without ``.json``) plus overrides.

    Raises:
        ConfigError: no such file, a file that is not a JSON object, an unknown key or an
            invalid value, naming it.
    """
    path = Path(path)
    if not path.exists() and (CONFIG_DIR / f"{path}.json").exists():
        path = CONFIG_DIR / f"{path}.json"
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
    try:
        values = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("config", str(path), f"a readable JSON file or one of {names} "
                          f"({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("config", str(path), f"a JSON file ({exc})") from None
    if not isinstance(values, dict):
        raise ConfigError("config", str(path), "a JSON object of OsawaConfig fields")
    values.update(overrides or {})
    known = {f.name for f in fields(OsawaConfig)}
    for key in values:
        if key not in known:
            raise ConfigError(key, values[key], "an OsawaConfig field: " + ", ".join(sorted(known)))
    return OsawaConfig(**values)


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with a JSON value (bare words are strings): ``lr=0.1``, ``bn_fisher=none``.

    Raises:
        ConfigError: ``text`` has no ``=`` (named as the ``--set`` option).
    """
    key, sep, raw = text.partition("=")
    if not sep:
        raise ConfigError("--set", text, "KEY=VALUE with a JSON value, e.g. lr=0.1")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw
