"""Typed, validated configuration of the K-FAC preconditioner.

Every field is checked at construction; a bad value raises :class:`ConfigError` naming the field,
the value and what is allowed, so a typo in a long run's config fails before any compute is spent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch
from torch import nn

from core.hyper import Schedulable, value_at

INVERSE_METHODS = ("eigen", "inverse", "cholesky", "cholesky_solve")
DAMPING_SPLITS = ("full", "pi")
FACTOR_SCALINGS = ("kaisa", "kfc", "dpkfac")
FACTOR_INITS = ("batch", "identity")
STRATEGIES = ("d-kfac", "comm-opt", "hybrid-opt", "mem-opt", "mpd-kfac", "osawa", "dp-kfac")
STRATEGY_ALIASES = {"mpd-kfac": "mem-opt"}
ASSIGNMENT_POLICIES = ("greedy", "round-robin", "contiguous")
ASSIGNMENT_COSTS = ("inversion", "memory")
#: Strategies where one rank preconditions a layer, so it must hold both of its factors.
OWNER_STRATEGIES = ("osawa", "dp-kfac")
#: dtypes a second-order state may be kept in (``bfloat16``: fast products, half the bytes).
PRECONDITION_DTYPES = ("bfloat16", "float32", "float64")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""

    def __init__(self, field_name: str, value: Any, allowed: str) -> None:
        # A name typed by a user may hold a line break: quoted, the message stays one line.
        shown = field_name if str(field_name).isprintable() else repr(field_name)
        super().__init__(f"invalid {shown}={value!r}: expected {allowed}")
        self.field_name = field_name
        self.value = value
        self.allowed = allowed


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(name, value, "one of " + ", ".join(repr(c) for c in choices))


def check_schedulable(
    name: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
) -> None:
    """Check a constant-or-callable hyper-parameter; callables are checked when evaluated.

    Raises:
        ConfigError: if ``value`` is neither callable nor a finite number inside the range.
    """
    if callable(value):
        return
    _check_range(name, value, low=low, high=high, low_inclusive=low_inclusive,
                 high_inclusive=high_inclusive, integer=integer, alternative=" or a callable of "
                 "the step")


def _check_range(name: str, value: Any, *, low: float, high: float = math.inf,
                 low_inclusive: bool = True, high_inclusive: bool = True, integer: bool = False,
                 infinite: bool = False, alternative: str = "") -> None:
    """Raise :class:`ConfigError` unless ``value`` is a (non-bool) number inside the range,
    finite unless ``infinite`` (where an infinity means something, such as "never"); the
    message's allowed values end with ``alternative``."""
    lo = "[" if low_inclusive and (infinite or math.isfinite(low)) else "("
    hi = "]" if high_inclusive and (infinite or math.isfinite(high)) else ")"
    kind = "an integer" if integer else "a number"
    allowed = f"{kind} in {lo}{low}, {high}{hi}{alternative}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(name, value, allowed)
    if integer and not isinstance(value, int):
        raise ConfigError(name, value, allowed)
    if math.isnan(value) or (math.isinf(value) and not infinite):
        raise ConfigError(name, value, allowed)  # inf damping zeroes every update
    above = value > low if not low_inclusive else value >= low
    below = value < high if not high_inclusive else value <= high
    if not (above and below):
        raise ConfigError(name, value, allowed)


def check_number(name: str, value: Any, **bounds: Any) -> None:
    """Like :func:`check_schedulable`, for a hyper-parameter that must be a constant.

    Raises:
        ConfigError: if ``value`` is callable, not a number, or outside the range ``bounds``
            (the keyword arguments of :func:`check_schedulable`).
    """
    if callable(value):
        raise ConfigError(name, value, "a number (not a callable)")
    _check_range(name, value, **bounds)


#: The range of each schedulable hyper-parameter (keyword arguments of
#: :func:`check_schedulable`): a constant is checked against it when the configuration is
#: built (:func:`check_hyper`), a callable's value every time a step reads it (:func:`hyper_at`).
HYPER_BOUNDS: dict[str, dict[str, Any]] = {
    "damping": {"low": 0.0, "low_inclusive": False},
    "factor_decay": {"low": 0.0, "high": 1.0, "high_inclusive": False},
    "stat_decay": {"low": 0.0, "high": 1.0, "low_inclusive": False, "high_inclusive": False},
    "kl_clip": {"low": 0.0, "low_inclusive": False},
    "lr": {"low": 0.0},
}


def check_hyper(name: str, value: Any) -> None:
    """:func:`check_schedulable` against ``name``'s :data:`HYPER_BOUNDS`."""
    check_schedulable(name, value, **HYPER_BOUNDS[name])


def hyper_at(name: str, value: Schedulable[float], step: int) -> float:
    """``value`` (a constant or a callable of the step) at ``step``, checked against
    ``name``'s :data:`HYPER_BOUNDS`: a schedule's value is held to the range a constant is.

    Raises:
        ConfigError: if the value is outside the range, naming the hyper-parameter.
    """
    resolved = value_at(value, step)
    check_hyper(name, resolved)
    return float(resolved)


def check_scheduled_value(
    name: str, value: float, *, low: float, high: float = math.inf, integer: bool = False
) -> None:
    """Check the value a callable hyper-parameter returned at some step."""
    check_schedulable(name, value, low=low, high=high, integer=integer)


C = TypeVar("C")


def config_from_options(config_type: type[C], config: C | None, options: dict[str, Any]) -> C:
    """The configuration a preconditioner was given: a ready config object, or its fields.

    Args:
        config_type: The dataclass of the configuration (e.g. :class:`KFACConfig`).
        config: A ready configuration, or None to build one from ``options``.
        options: Keyword arguments naming fields of ``config_type``.

    Raises:
        ConfigError: on an unknown option, or when both ``config`` and ``options`` are given.
    """
    names = [f.name for f in fields(config_type)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(unknown[0], options[unknown[0]],
                          f"a {config_type.__name__} field: " + ", ".join(names))
    if config is not None and options:
        raise ConfigError("config", config,
                          f"either a {config_type.__name__} or keyword options, not both")
    return config if config is not None else config_type(**options)


def skipped(name: str, module: nn.Module, rules: Iterable[str | type[nn.Module]]) -> bool:
    """Whether a ``skip_layers`` rule matches the module: a regex found in its qualified name,
    or a class it is an instance of."""
    for rule in rules:
        if isinstance(rule, str):
            if re.search(rule, name):
                return True
        elif isinstance(module, rule):
            return True
    return False


def check_skip_layers(value: Any) -> None:
    """``skip_layers`` is a sequence of name regexes (str) and module classes."""
    allowed = "a sequence of module-name regexes (str) and nn.Module subclasses"
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError("skip_layers", value, allowed)
    for item in value:
        if isinstance(item, str):
            try:
                re.compile(item)
            except re.error as err:
                raise ConfigError("skip_layers", item, f"a valid regex ({err})") from None
        elif not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise ConfigError("skip_layers", item, allowed)


@dataclass(kw_only=True)
class KFACConfig:
    """All options of :class:`core.KFACPreconditioner`; see KFAC_MATH.md for each formula.

    Attributes:
        damping: Tikhonov damping λ (number or callable of the step), > 0.
        factor_decay: weight of the old running average α in [0, 1); the first update sets F.
        factor_update_steps: update the factors every this many steps (int >= 1 or callable).
        inv_update_steps: recompute inverses every this many steps (int >= 1 or callable).
        inverse_method: "eigen", "inverse", "cholesky" or "cholesky_solve". "inverse" and
            "cholesky" form the damped inverses, which pays off only when each inverse update
            serves many steps; "cholesky_solve" keeps their Cholesky factors and applies them
            by triangular solves (same result, about a third of the inversion work, solves
            costing what the products do on wide factors): the cheaper choice for wide
            factors and short ``inv_update_steps`` (docs/benchmarks.md).
        prediv_eigenvalues: with "eigen", the rank that decomposes a layer's factors also
            forms ``1/(d_G d_Aᵀ + λ)`` with the damping of that inversion, and keeps and sends
            it instead of the eigenvalues (KAISA's ``prediv_eigenvalues``, which its
            ``compute_eigenvalue_outer_product=True`` default turns on). Each step's product
            skips forming that ``g × a`` matrix; the second-order state, and what comm-opt and
            hybrid-opt broadcast, grow by ``a·g − a − g`` values a layer, and a damping that
            changes between inversions takes effect at the next one. Its ratios reach ``1/λ``:
            beyond float16's range for λ < 2⁻¹⁶ on a ``comm_dtype="float16"`` wire (use
            bfloat16). Needs ``colocate_factors``.
        damping_split: "full" (λ on each factor) or "pi" (trace-norm π split); not for "eigen".
        factor_scaling: "kaisa", "kfc" or "dpkfac" (the code base whose damping values are used).
        factor_init: where each running factor starts: "batch" (the first update sets it to
            the batch factor) or "identity" (it starts at I, so the first update gives
            ``α·I + (1 − α)·F_batch``; KAISA's and the DP-KFAC code's start, which keeps an
            ``αᵏ·I`` term after ``k`` updates: 19% after 32 at α = 0.95).
        kl_clip: KL-clip κ > 0, or None to disable.
        lr: learning rate used only by the KL clip (number or callable).
        skip_layers: module-name regexes or module classes left first-order.
        strategy: distribution strategy (see KFAC_MATH.md "Distribution").
        grad_worker_fraction: fraction f of ranks that precondition each layer ("hybrid-opt").
        assignment: "greedy" (cost-balanced, KAISA), "round-robin" (DP-KFAC code) or
            "contiguous" (Osawa et al.'s code).
        assignment_cost: cost of a factor of dimension n: "inversion" (n³), "memory" (n²) or a
            callable of n.
        colocate_factors: keep a layer's A and G inversions on the same rank ("comm-opt" and
            "hybrid-opt" may split them; "osawa" and "dp-kfac" need them together).
        accumulation_steps: micro-batches per step; the loss is assumed divided by it.
        factor_dtype: dtype of stored factors ("float32" or "float64").
        inverse_dtype: dtype of decompositions and inverses ("float32" or "float64").
        precondition_dtype: dtype the second-order state is stored, sent and applied in (None =
            ``inverse_dtype``). "bfloat16" (KAISA's ``inv_dtype``) rounds each decomposition to
            bf16 after it is computed in ``inverse_dtype``: half the state's memory and
            broadcast volume, and preconditioning products several times faster where the
            hardware has bf16 matrix units (GPUs, CPUs with AMX), for a relative rounding of
            about 2⁻⁸ per state entry. Not for "cholesky_solve" (no bf16 triangular solve).
        precondition_dtype_tolerance: with a ``precondition_dtype`` narrower than
            ``inverse_dtype``, each factor's fresh state is tried on the step's gradient when
            it is computed; one whose rounding moves that product by more than this relative
            (Frobenius) error stays in ``inverse_dtype`` until its next inversion. Rounding
            loses all digits on factors that are rank-deficient next to the damping (a
            classifier's input, attention value projections; docs/benchmarks.md "Inverses in
            bf16"). None rounds every factor (KAISA's ``inv_dtype``).
        symmetry_aware: send packed upper triangles of symmetric factors (and inverses).
        comm_dtype: dtype on the wire for factors and inverses (None = storage dtype).
        bucket_cap_mb: largest flat buffer one collective moves, in MB (bucketing), > 0.
        factors_in_backward: build each layer's batch factors in the backward pass, as soon as
            the last micro-batch's output gradient of the layer arrives, and hand them to the
            factor reduction there (KAISA's ``update_factors_in_hook``): with a strategy that
            all-reduces factors, their buckets travel while the backward pass goes on. Costs
            memory: batch factors are held while the backward pass still holds activations.
            The backward passes per step must be ``accumulation_steps``.
    """

    damping: Schedulable[float] = 1e-3
    factor_decay: Schedulable[float] = 0.95
    factor_update_steps: Schedulable[int] = 1
    inv_update_steps: Schedulable[int] = 1
    inverse_method: str = "eigen"
    prediv_eigenvalues: bool = False
    damping_split: str = "full"
    factor_scaling: str = "kaisa"
    factor_init: str = "batch"
    kl_clip: Schedulable[float] | None = 1e-3
    lr: Schedulable[float] = 0.1
    skip_layers: Sequence[str | type[nn.Module]] = field(default_factory=tuple)
    strategy: str = "comm-opt"
    grad_worker_fraction: float | None = None
    assignment: str = "greedy"
    assignment_cost: str | Callable[[int], float] = "inversion"
    colocate_factors: bool = True
    accumulation_steps: int = 1
    factor_dtype: str = "float32"
    inverse_dtype: str = "float32"
    precondition_dtype: str | None = None
    precondition_dtype_tolerance: float | None = 0.05
    symmetry_aware: bool = False
    comm_dtype: str | None = None
    bucket_cap_mb: float = 25.0
    factors_in_backward: bool = False

    def __post_init__(self) -> None:
        check_hyper("damping", self.damping)
        check_hyper("factor_decay", self.factor_decay)
        check_schedulable("factor_update_steps", self.factor_update_steps, low=1, integer=True)
        check_schedulable("inv_update_steps", self.inv_update_steps, low=1, integer=True)
        check_choice("inverse_method", self.inverse_method, INVERSE_METHODS)
        if not isinstance(self.prediv_eigenvalues, bool):
            raise ConfigError("prediv_eigenvalues", self.prediv_eigenvalues, "True or False")
        if self.prediv_eigenvalues and self.inverse_method != "eigen":
            raise ConfigError("prediv_eigenvalues", True,
                              f"False with inverse_method={self.inverse_method!r} (only "
                              "'eigen' has eigenvalues to pre-divide)")
        check_choice("damping_split", self.damping_split, DAMPING_SPLITS)
        if self.inverse_method == "eigen" and self.damping_split != "full":
            raise ConfigError(
                "damping_split", self.damping_split,
                "'full' with inverse_method='eigen' (the eigen path damps the eigenvalue "
                "products; use inverse_method='inverse', 'cholesky' or 'cholesky_solve' for 'pi')",
            )
        check_choice("factor_scaling", self.factor_scaling, FACTOR_SCALINGS)
        check_choice("factor_init", self.factor_init, FACTOR_INITS)
        if self.kl_clip is not None:
            check_hyper("kl_clip", self.kl_clip)
        check_hyper("lr", self.lr)
        check_skip_layers(self.skip_layers)
        check_choice("strategy", self.strategy, STRATEGIES)
        if self.grad_worker_fraction is not None:
            check_schedulable("grad_worker_fraction", self.grad_worker_fraction, low=0.0,
                              high=1.0, low_inclusive=False)
            if callable(self.grad_worker_fraction):
                raise ConfigError("grad_worker_fraction", self.grad_worker_fraction,
                                  "a number in (0, 1]")
        if self.strategy == "hybrid-opt" and self.grad_worker_fraction is None:
            raise ConfigError("grad_worker_fraction", None,
                              "a number in (0, 1] when strategy='hybrid-opt'")
        if self.strategy != "hybrid-opt" and self.grad_worker_fraction is not None:
            raise ConfigError("grad_worker_fraction", self.grad_worker_fraction,
                              f"None with strategy={self.strategy!r} (only 'hybrid-opt' takes it)")
        check_choice("assignment", self.assignment, ASSIGNMENT_POLICIES)
        if not callable(self.assignment_cost):
            check_choice("assignment_cost", self.assignment_cost, ASSIGNMENT_COSTS)
        if not isinstance(self.colocate_factors, bool):
            raise ConfigError("colocate_factors", self.colocate_factors, "True or False")
        if not self.colocate_factors and self.strategy in OWNER_STRATEGIES:
            raise ConfigError("colocate_factors", False,
                              f"True with strategy={self.strategy!r} (its owner preconditions "
                              "with both factors)")
        if not self.colocate_factors and self.prediv_eigenvalues:
            raise ConfigError("colocate_factors", False,
                              "True with prediv_eigenvalues=True (the pre-divided ratios need "
                              "both factors' eigenvalues on one rank; or set "
                              "prediv_eigenvalues=False)")
        check_number("accumulation_steps", self.accumulation_steps, low=1, integer=True)
        check_choice("factor_dtype", self.factor_dtype, ("float32", "float64"))
        check_choice("inverse_dtype", self.inverse_dtype, ("float32", "float64"))
        if self.precondition_dtype is not None:
            check_choice("precondition_dtype", self.precondition_dtype, PRECONDITION_DTYPES)
            if self.precondition_dtype == "bfloat16" and self.inverse_method == "cholesky_solve":
                raise ConfigError("precondition_dtype", self.precondition_dtype,
                                  "None, 'float32' or 'float64' with inverse_method="
                                  "'cholesky_solve' (triangular solves have no bf16 kernel; use "
                                  "inverse_method='inverse' or 'eigen' for bf16 products)")
        if self.precondition_dtype_tolerance is not None:
            check_number("precondition_dtype_tolerance", self.precondition_dtype_tolerance,
                         low=0.0)
        if not isinstance(self.symmetry_aware, bool):
            raise ConfigError("symmetry_aware", self.symmetry_aware, "True or False")
        if self.comm_dtype is not None:
            check_choice("comm_dtype", self.comm_dtype,
                         ("float16", "bfloat16", "float32", "float64"))
        check_number("bucket_cap_mb", self.bucket_cap_mb, low=0.0, low_inclusive=False)
        if not isinstance(self.factors_in_backward, bool):
            raise ConfigError("factors_in_backward", self.factors_in_backward, "True or False")

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype second-order states are stored, sent and applied in."""
        return getattr(torch, self.precondition_dtype or self.inverse_dtype)

    @property
    def state_method(self) -> str:
        """The kind of second-order state a layer keeps (a key of
        :data:`core.inverse.STATE_TYPES`): ``inverse_method``, or ``"eigen_prediv"`` for
        ``eigen`` with ``prediv_eigenvalues``."""
        return "eigen_prediv" if self.prediv_eigenvalues else self.inverse_method

    @property
    def canonical_strategy(self) -> str:
        """The strategy name with aliases resolved (``mpd-kfac`` is ``mem-opt``)."""
        return STRATEGY_ALIASES.get(self.strategy, self.strategy)


def resolve_interval(name: str, value: Schedulable[int], step: int) -> int:
    """Evaluate an update interval at ``step`` and check the result is an integer >= 1."""
    result = value(step) if callable(value) else value
    check_scheduled_value(name, result, low=1, integer=True)
    return result


def update_due(name: str, value: Schedulable[int], step: int) -> bool:
    """Whether an update every ``value`` steps (``name`` for errors) falls on ``step``."""
    return step % resolve_interval(name, value, step) == 0

