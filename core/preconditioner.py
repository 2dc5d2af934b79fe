"""``KFACPreconditioner``: the K-FAC step as an explicit pipeline of timed stages.

capture (hooks) → factors → factor comm → inversion → inverse comm → precondition → gradient comm
→ KL clip and write-back. The mathematics is in ``core.factors``/``core.inverse``; who does what
on which rank is the :class:`~core.strategy.Strategy`'s business.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from core.capture import CaptureHooks, HookSet
from core.config import (
    ConfigError,
    KFACConfig,
    config_from_options,
    hyper_at,
    skipped,
    update_due,
)
from core.factors import gram_diagonal_checks
from core.inverse import SIDES, STATE_TYPES, all_finite, kl_clip_scale, kl_product
from core.kfac_layer import KFACLayer
from core.layer_base import (
    HALF_OVERFLOW_FIX,
    StepLossScale,
    autocast_off,
    check_saved_layers,
    finite_gradients,
    half_overflows,
    refuse_several_devices,
)
from core.layers import helper_for, refuse_flat_sharding
from core.strategy import FactorReduction, Strategy
from core.timing import STAGES, StageTimer


def discover_layers(model: nn.Module, skip: Iterable[str | type[nn.Module]], *,
                    quiet: Iterable[str] = (), stacklevel: int = 3
                    ) -> list[tuple[str, nn.Module]]:
    """Supported, trainable, not-skipped modules in ``model`` (in ``named_modules`` order).

    A name regex in ``skip`` that matches no module's name is reported (KAISA also matched
    class names: a rule such as ``"Linear"`` skips nothing here; give the class instead),
    except those in ``quiet`` (a method's default rules, for models they do not concern).
    A layer whose weight is tied to a module not among them stays first-order, with a warning
    (:func:`_untied_elsewhere`). Warnings point ``stacklevel`` frames up (the user's call).

    Raises:
        UnsupportedLayerError: for a model sharded by FSDP
            (:func:`~core.layers.refuse_flat_sharding`, :func:`~core.layers.refuse_sharded`).
    """
    refuse_flat_sharding(model)
    found = []
    rules = list(skip)
    unmatched = {rule for rule in rules if isinstance(rule, str)} - set(quiet)
    for name, module in model.named_modules():
        unmatched -= {rule for rule in unmatched if re.search(rule, name)}
        if skipped(name, module, rules):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or not weight.requires_grad:
            continue
        if helper_for(module, name) is not None:
            found.append((name, module))
    found = _untied_elsewhere(model, found, stacklevel + 1)
    if unmatched:
        warnings.warn(f"skip_layers rules {sorted(unmatched)} match no module name (they are "
                      "regexes searched in qualified names such as 'encoder.layer.0.output."
                      "dense'); to skip layers by type give the class, e.g. nn.Linear",
                      stacklevel=stacklevel)
    return found


def _untied_elsewhere(model: nn.Module, found: list[tuple[str, nn.Module]], stacklevel: int
                      ) -> list[tuple[str, nn.Module]]:
    """``found`` without the layers whose weight is also another module's that is not among
    them (a language model's output layer tied to its input embedding: GPT-2's ``lm_head``,
    BERT's decoder), each with a warning. Its gradient then carries that module's too, which
    the layer's curvature does not describe; and a vocabulary-wide output side would build a
    ``vocab × vocab`` factor or inverse (9.4 GiB in fp32 for GPT-2's 50,257 tokens)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append((module_name, module))
    kept = {id(module) for _, module in found}
    out = []
    for name, module in found:
        others = sorted({other_name or "the model itself"
                         for other_name, other in owners.get(id(module.weight), [])
                         if id(other) not in kept})
        if not others:
            out.append((name, module))
            continue
        warnings.warn(f"{name}: its weight is also that of {', '.join(others)} (tied), so its "
                      "gradient carries theirs, which this layer's curvature does not "
                      "describe; it stays first-order (skip_layers it to silence this)",
                      stacklevel=stacklevel)
    return out


def build_layers(model: nn.Module, config: KFACConfig,
                 grad_multiplier: Callable[[], float]) -> list[KFACLayer]:
    """One :class:`KFACLayer` per supported, trainable, not-skipped module, in model order."""
    return [
        KFACLayer(name, helper, scaling=config.factor_scaling,
                  factor_dtype=getattr(torch, config.factor_dtype),
                  grad_multiplier=grad_multiplier,
                  identity_start=config.factor_init == "identity")
        for name, module in discover_layers(model, config.skip_layers, stacklevel=4)
        if (helper := helper_for(module)) is not None
    ]


def memory_report(layers: Iterable[KFACLayer], strategy: Strategy) -> dict[str, int]:
    """Bytes held for K-FAC: ``factors``, ``inverses``, ``buffers`` and ``total``."""
    usage = {"factors": 0, "inverses": 0, "buffers": 0}
    for layer in layers:
        for key, value in layer.memory_usage().items():
            usage[key] += value
    usage["buffers"] += strategy.buffer_bytes()
    usage["total"] = sum(usage.values())
    return usage


class KFACPreconditioner:
    """Kronecker-factored preconditioning of every supported layer's gradient.

    Usage: ``loss.backward(); precond.step(); optimizer.step()``. ``step()`` rewrites ``.grad``
    of the preconditioned layers in place; other parameters keep their raw gradients.

    Args:
        model: The model (or its DDP wrapper).
        config: A :class:`~core.config.KFACConfig`; or give its fields as keyword arguments.
        grad_scaler: An AMP ``GradScaler`` whose scale is divided out of captured gradients.
            Unscale the gradients (``scaler.unscale_(optimizer)``) before ``step()``.
        strategy_impl: A ready strategy object; by default one is built from ``config.strategy``
            (the single-process strategy when ``torch.distributed`` is not initialised).
        disabled_stages: Stage names (see ``core.timing.STAGES``) to skip, for time-breakdown
            experiments; the results are then not K-FAC any more.
        **options: :class:`~core.config.KFACConfig` fields.

    Raises:
        ConfigError: on an invalid option, naming the field and the allowed values.
    """

    def __init__(
        self,
        model: nn.Module,
        config: KFACConfig | None = None,
        *,
        grad_scaler: Any = None,
        strategy_impl: Strategy | None = None,
        disabled_stages: Iterable[str] = (),
        **options: Any,
    ) -> None:
        self.config = config_from_options(KFACConfig, config, options)
        disabled = frozenset(disabled_stages)
        for stage in disabled:
            if stage not in STAGES:
                raise ConfigError("disabled_stages", stage, "names among " + ", ".join(STAGES))
        self.disabled_stages = disabled
        self.steps = 0
        self.skipped_overflow_steps = 0
        self.nonfinite_preconditioned = 0
        # Whether an inversion step has run: until one has, any step with factors inverts
        # (a skipped step 0, an AMP overflow, would otherwise leave every layer first-order
        # until the next multiple of inv_update_steps). A function of the step sequence, so
        # the same on every rank.
        self._inverted = False
        # The layers that had factors at an inversion. Where every rank holds every layer's
        # factors, one that first has them later (a branch first taken then, a layer first
        # run in training mode) is inverted at the next step, not at the next multiple of
        # inv_update_steps; its factors are the same on every rank, so the choice is too.
        self._inverted_layers: set[str] = set()
        self.last_kl_scale = 1.0
        self.inverse_dtype = getattr(torch, self.config.inverse_dtype)
        self.state_dtype = self.config.state_dtype

        if strategy_impl is None:
            from core.distributed import make_strategy

            strategy_impl = make_strategy(self.config)
        self.strategy = strategy_impl
        self.loss_scale = StepLossScale(grad_scaler)

        self.layers = build_layers(model, self.config, self._grad_multiplier)
        refuse_several_devices(type(self).__name__, self.layers)
        # Decompositions run widest factor first. Each needs scratch of a few times its
        # factor's bytes, and the C heap keeps narrower factors' freed scratch resident (glibc
        # serves blocks under 32 MB from the heap once one was freed), so a wide factor
        # decomposed after them peaked that much higher: kfac-eigen on ResNet-18 held 80 MB
        # more (docs/benchmarks.md). The layers are independent: the order changes no result.
        self._widest_first = sorted(self.layers, reverse=True,
                                    key=lambda layer: max(layer.a_dim, layer.g_dim))
        if not self.layers:
            warnings.warn("KFACPreconditioner found no supported layers (Linear, Conv1D, "
                          "Conv2d) in the model; step() leaves every gradient first-order",
                          stacklevel=2)
        self.strategy.setup(self.layers, method=self.config.state_method,
                            dtype=self.inverse_dtype)
        self.strategy.set_step(0)
        self._capturing = self._factor_update_due(0)
        self.timer = StageTimer(device_events=lambda: any(
            layer.device.type == "cuda" for layer in self.layers[:1]))
        # factors_in_backward: the reduction its hooks started, the backward passes each layer
        # has folded, the layers whose factors are staged and those already handed over, this
        # step. Layers are handed over in one order on every rank, reverse model order (the
        # usual order of the backward pass), each once all before it have been: which layer's
        # backward pass completes first may depend on the data and differ between ranks, and
        # the buckets of the reduction must hold the same layers everywhere.
        self._backward_reduction: FactorReduction | None = None
        self._folded: dict[str, int] = {}
        self._staged: set[str] = set()
        self._handed_over: set[str] = set()
        self._reported_uncaptured: set[str] = set()
        self._handover_order = self.layers[::-1]
        self._hooks = HookSet(lambda: [self._register(layer) for layer in self.layers])

    # Hooks -----------------------------------------------------------------------------------
    def _register(self, layer: KFACLayer) -> CaptureHooks:
        captures = self.strategy.captures(layer)
        return CaptureHooks(
            layer.helper.module,
            on_input=layer.capture_input,
            on_grad_output=(partial(self._factors_in_backward, layer)
                            if self.config.factors_in_backward else layer.capture_grad_output),
            enabled=lambda: (self._capturing and captures
                             and not self.disabled_stages & {"capture", "factors"}),
            name=layer.name,
            on_forward=layer.note_call,
        )

    def _factors_in_backward(self, layer: KFACLayer, gy: Tensor) -> None:
        """Capture ``gy``; once ``layer``'s backward pass is complete, build its batch factors,
        and after the step's last micro-batch hand them to the factor reduction, so the first
        buckets travel while the backward pass goes on (``factors_in_backward``).

        Raises:
            RuntimeError: on more backward passes in one step than ``accumulation_steps``
                (their factors would be left out of the reduction already under way).
        """
        layer.capture_grad_output(gy)
        if not layer.backward_complete:
            return
        layer.fold_captures(self.timer)
        passes = self._folded[layer.name] = self._folded.get(layer.name, 0) + 1
        expected = self.config.accumulation_steps
        if passes > expected:
            raise RuntimeError(
                f"{layer.name}: backward pass {passes} of one step with accumulation_steps="
                f"{expected}; with factors_in_backward=True, set accumulation_steps to the "
                "number of backward passes per preconditioner step, and run forward passes "
                "whose gradients the optimizer does not apply (an adversarial example's) "
                "inside no_capture()")
        if passes < expected or not self._reduces_factors():
            return
        if self._backward_reduction is None:
            self._backward_reduction = self.strategy.factor_reduction()
        layer.stage_batch_factors(self.timer)
        self._staged.add(layer.name)
        self._hand_over(self._backward_reduction, everything=False)

    def _hand_over(self, reduction: FactorReduction, *, everything: bool) -> None:
        """Hand layers to ``reduction`` in ``_handover_order``, from the first not yet handed
        over: each staged one, stopping at the first not staged yet, unless ``everything``
        (then it is staged now: its factors, or zeros where this rank captured none). A layer
        not staged yet may still capture in this backward pass (a checkpointed segment's
        recomputation), so it holds back the layers after it."""
        for layer in self._handover_order[len(self._handed_over):]:
            if layer.name not in self._staged:
                if not everything:
                    break
                layer.stage_batch_factors(self.timer)
                self._staged.add(layer.name)
            with self.timer.stage("factor_comm"):
                reduction.add(layer)
            self._handed_over.add(layer.name)

    def _reduces_factors(self) -> bool:
        """Whether this step's batch factors go through a reduction across ranks."""
        return (self._capturing and self.strategy.communicates_factors
                and self._enabled("factor_comm")
                and not self.disabled_stages & {"capture", "factors"})

    def _settle_backward_reduction(self) -> None:
        """Complete the collectives the backward pass started, as every rank does on the same
        step, before the step's factors are discarded (an overflow, a skipped step): each
        rank hands over every layer it had not (what it had started depends on which layers
        it ran), so the collectives match."""
        if not (self.config.factors_in_backward and self._reduces_factors()):
            return
        reduction = self._backward_reduction or self.strategy.factor_reduction()
        with warnings.catch_warnings():  # these factors are discarded: zeros are no news
            warnings.filterwarnings("ignore", message=".*no factors captured on this rank")
            self._hand_over(reduction, everything=True)
        with self.timer.stage("factor_comm"):
            reduction.finish()()

    def _grad_multiplier(self) -> float:
        """What captured output gradients are multiplied by before they enter ``G``.

        The loss scale is always divided out. The ``δ``-based conventions (``kfc``, ``dpkfac``)
        recover ``δ = B·g`` per micro-batch, so they multiply by the accumulation steps (the
        loss is divided by them). KAISA's ``G`` uses the raw gradient of the loss averaged over
        the whole batch the factor describes: autograd already hands that under accumulation,
        and over ``P`` ranks' pooled batches it is the local gradient divided by ``P``. This
        keeps accumulation and every strategy equal to one process on the same global batch.
        """
        if self.config.factor_scaling == "kaisa":
            return 1.0 / (self.loss_scale.get() * self.strategy.factor_ranks)
        return self.config.accumulation_steps / self.loss_scale.get()

    def _factor_update_due(self, step: int) -> bool:
        return update_due("factor_update_steps", self.config.factor_update_steps, step)

    # The step --------------------------------------------------------------------------------
    def _hyper(self, name: str, step: int | None = None) -> float:
        """A constant-or-scheduled config value at ``step`` (this step by default), checked
        against its bounds."""
        return hyper_at(name, getattr(self.config, name), self.steps if step is None else step)

    def _enabled(self, stage: str) -> bool:
        return stage not in self.disabled_stages

    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of this step (call after ``backward``, before the optimizer).
        """
        with autocast_off():
            step, cfg, timer, strategy = self.steps, self.config, self.timer, self.strategy
            for layer in self.layers:  # before anything changes: an input changed in place raises
                layer.check_captured_inputs()
            grads = finite_gradients(self.layers, settle=self._settle_backward_reduction)
            if grads is None:  # an AMP overflow (or a diverged step): factors clean, grads raw
                self.skipped_overflow_steps += 1
                self._end_step()
                return

            inverting = (update_due("inv_update_steps", cfg.inv_update_steps, step)
                         or (not self._inverted and self._capturing))
            self._inverted = self._inverted or inverting
            # Each layer's factors are handed to the reduction as soon as they are built, so the
            # first buckets travel while later layers' factors are computed. On a step that keeps
            # its inverses, the rest runs while this step's gradients are preconditioned (which
            # does not read the new factors), and the running averages are updated after it.
            finish_factors: Callable[[], None] | None = None
            if self._capturing:
                decay = self._hyper("factor_decay")
                if strategy.communicates_factors:
                    reduction = (self._backward_reduction or strategy.factor_reduction()
                                 if self._reduces_factors() else None)
                    if reduction is not None and cfg.factors_in_backward:
                        self._hand_over(reduction, everything=True)
                    for layer in self.layers:
                        if layer.name in self._staged:  # handed over in the backward pass
                            continue
                        layer.stage_batch_factors(timer)
                        if reduction is not None:
                            with timer.stage("factor_comm"):
                                reduction.add(layer)
                    if reduction is not None:
                        with timer.stage("factor_comm"):
                            finish_factors = reduction.finish()
                            if inverting:
                                finish_factors()
                                finish_factors = None
                    if finish_factors is None:
                        self._update_running_factors(decay)
                else:  # one layer at a time, so one batch factor is alive at once
                    uncaptured = []
                    for layer in self.layers:
                        layer.stage_batch_factors(timer)
                        if (layer.batch_a is None and grads[layer.name] is not None
                                and strategy.captures(layer)):  # DP-KFAC: owners capture alone
                            uncaptured.append(layer.name)
                        with timer.stage("factors"):
                            layer.update_running_factors(decay)
                    self._report_uncaptured(uncaptured)

            damping = self._hyper("damping")
            inverted = self.layers if inverting else self._first_inversions()
            if inverted:
                if self._enabled("inversion"):
                    with timer.stage("inversion"):
                        for layer in self._widest_first if inverting else inverted:
                            layer.compute_inverse(method=cfg.state_method, damping=damping,
                                                  split=cfg.damping_split, dtype=self.inverse_dtype,
                                                  state_dtype=self.state_dtype,
                                                  sides=strategy.inverse_sides(layer),
                                                  grad=grads[layer.name],
                                                  tolerance=cfg.precondition_dtype_tolerance)
                if self._enabled("inverse_comm"):
                    with timer.stage("inverse_comm"):
                        strategy.communicate_inverses(inverted)
                self._inverted_layers.update(layer.name for layer in inverted if layer.has_factors)

            preconditioned: dict[str, Tensor] = {}
            # The KL clip's products, taken while each P is still in cache, unless communication
            # may replace or round P afterwards.
            products: dict[str, Tensor] | None = (
                {} if cfg.kl_clip is not None and not strategy.moves_gradients else None)
            if self._enabled("precondition"):
                with timer.stage("precondition"):
                    for layer in self.layers:
                        grad = grads[layer.name]
                        if grad is None or not strategy.preconditions(layer):
                            continue
                        p = layer.precondition(grad, damping)
                        if p is None:
                            continue
                        # a bf16 state's product returns to the inverse dtype
                        p = preconditioned[layer.name] = p.to(self.inverse_dtype)
                        if products is not None:
                            products[layer.name] = kl_product(p, grad)
            if self._enabled("grad_comm") and self._enabled("precondition"):
                with timer.stage("grad_comm"):
                    with_grad = [layer for layer in self.layers if grads[layer.name] is not None]
                    strategy.communicate_gradients(with_grad, preconditioned)

            if self._enabled("scale"):
                with timer.stage("scale"):
                    self._clip_and_write(grads, preconditioned, products)
            if finish_factors is not None:
                with timer.stage("factor_comm"):
                    finish_factors()
                self._update_running_factors(decay)
            self._end_step()

    def _first_inversions(self) -> list[KFACLayer]:
        """The layers with factors but no inversion yet, where every rank holds every layer's
        factors (under ``osawa`` and ``dp-kfac`` only their owners know, so such a layer waits
        for the next inversion step)."""
        if not self.strategy.factors_everywhere:
            return []
        return [layer for layer in self.layers
                if layer.has_factors and layer.name not in self._inverted_layers]

    def _report_uncaptured(self, names: list[str]) -> None:
        """Warn, once per layer, about layers that have a gradient but captured nothing on a
        factor-update step, so their factors stay as they were (never built, if they never
        capture)."""
        if self.disabled_stages & {"capture", "factors"}:  # nothing is captured on purpose
            return
        new = [name for name in names if name not in self._reported_uncaptured]
        if not new:
            return
        self._reported_uncaptured.update(new)
        shown = ", ".join(new[:5]) + (f" and {len(new) - 5} more" if len(new) > 5 else "")
        warnings.warn(f"{shown}: a gradient but nothing captured on a factor-update step (step "
                      f"{self.steps}), so their factors were not updated: capture runs only in "
                      "training mode with gradients enabled (model.train(), not under "
                      "torch.no_grad()) and when the module itself is called on a non-empty "
                      "batch; a layer stays first-order until it has factors (and, under "
                      "the osawa and dp-kfac strategies, until the next inversion step)",
                      stacklevel=3)

    def skip_step(self) -> None:
        """Account for a step whose optimizer update was skipped without :meth:`step` running
        (a ``GradScaler`` that found an overflow skips ``optimizer.step()`` altogether): the
        factors its hooks captured are dropped and the step is counted, as :meth:`step` does
        with an overflow it sees."""
        self.discard_pending()
        self.skipped_overflow_steps += 1
        self._end_step()

    def discard_pending(self) -> None:
        """Forget what the hooks captured since the last step, counting nothing (a step that
        will not be taken, such as the one on which :class:`~core.hybrid.HybridSwitch`
        switches to first order). Collectives the backward pass started are completed first,
        so call it on every rank alike."""
        self._settle_backward_reduction()
        self._forget_captures()

    def _forget_captures(self) -> None:
        """Drop every layer's captures and staged factors, the step's record of them and
        the loss scale read for them (the next capture reads the scaler's scale afresh)."""
        for layer in self.layers:
            layer.discard_pending()
        self._clear_step_record()
        self.loss_scale.reset()

    def _clear_step_record(self) -> None:
        """Forget the step's factor reduction and which layers were folded, staged and
        handed over."""
        self._backward_reduction = None
        self._folded.clear()
        self._staged.clear()
        self._handed_over.clear()

    def _update_running_factors(self, decay: float) -> None:
        """Blend every layer's staged (and reduced) batch factors into its running averages,
        their checks read for all layers at once."""
        with self.timer.stage("factors"):
            staged = [(layer.name, (layer.batch_a, layer.batch_g)) for layer in self.layers
                      if layer.batch_a is not None and layer.batch_g is not None]
            checks = dict(zip((name for name, _ in staged), gram_diagonal_checks(
                [pair for _, pair in staged]), strict=True))
            for layer in self.layers:
                layer.update_running_factors(decay, checks.get(layer.name))

    def _clip_and_write(self, grads: dict[str, Tensor | None],
                        preconditioned: dict[str, Tensor],
                        products: dict[str, Tensor] | None) -> None:
        """Apply the KL clip over all preconditioned layers and write ``P`` into ``.grad``
        (scaled on the way: one pass over each ``P``), except where ``P`` is not finite."""
        if self.config.kl_clip is not None:
            given = products or {}
            products = {name: given[name] if name in given
                        else kl_product(preconditioned[name], grad)  # type: ignore[arg-type]
                        for name, grad in grads.items() if name in preconditioned}
        total = self._leave_nonfinite_first_order(preconditioned, products)
        if not preconditioned:
            self.last_kl_scale = 1.0
            return
        scale = 1.0
        if self.config.kl_clip is not None:
            scale = kl_clip_scale(total, self._hyper("lr"), self._hyper("kl_clip"))
        self.last_kl_scale = scale
        written = []
        for layer in self.layers:
            p = preconditioned.get(layer.name)
            if p is not None:
                layer.helper.set_grad(p, scale if scale != 1.0 else None)
                written.append(layer)
        self._restore_half_overflows(written, grads)

    def _restore_half_overflows(self, layers: list[KFACLayer],
                                grads: dict[str, Tensor | None]) -> None:
        """Give back its raw gradient, counted and reported, to each float16 layer whose
        written ``P`` left float16's range (:func:`~core.layer_base.half_overflows`)."""
        bad = half_overflows(layers)
        for layer in bad:
            layer.helper.set_grad(grads[layer.name])  # type: ignore[arg-type]
        if bad:
            self.nonfinite_preconditioned += len(bad)
            warnings.warn(f"preconditioned gradient of {', '.join(x.name for x in bad)} "
                          "exceeds float16's range; left first-order this step "
                          f"({self.nonfinite_preconditioned} layer-steps so far): "
                          f"{HALF_OVERFLOW_FIX}", stacklevel=4)

    def _leave_nonfinite_first_order(self, preconditioned: dict[str, Tensor],
                                     products: dict[str, Tensor] | None) -> float:
        """Drop from ``preconditioned`` (and ``products``) every layer whose ``P`` is not
        finite, so its raw gradient stays, with a warning and a count
        (``nonfinite_preconditioned``); return the sum of the kept layers' KL products (0
        without them).

        ``P`` comes from finite gradients (checked at the start of the step) and a state that
        was finite when it was computed, yet can overflow: an inverse of order ``1/λ`` from a
        tiny damping, or a state kept in ``inverse_dtype`` when it was too large for the
        narrower one. With the KL clip its products are the test (a non-finite ``P`` makes
        ``Σ P ⊙ ∇W̄`` non-finite; an overflowing product, which the clip could not scale,
        counts too), read in the one host transfer that also brings the clip its sum; without
        it, one summation per ``P`` and a transfer of their finiteness. Every rank holds the
        same ``P`` and decides alike, and the sum follows model order (``products``' order),
        so ranks that received ``P`` from others add alike too.
        """
        if not preconditioned:
            return 0.0
        names = list(preconditioned if products is None else products)  # products: model order
        if products is not None:
            stacked = torch.stack([products[name] for name in names])
            read = torch.cat([stacked.isfinite().to(stacked.dtype), stacked.sum().reshape(1)])
            *flags, total = read.tolist()
            finite = [bool(flag) for flag in flags]
        else:
            total = 0.0
            finite = torch.stack([p.sum() for p in preconditioned.values()]).isfinite().tolist()
            finite = [ok or all_finite([preconditioned[name]])  # a finite P's sum may overflow
                      for name, ok in zip(names, finite, strict=True)]
        bad = [name for name, ok in zip(names, finite, strict=True) if not ok]
        if not bad:
            return total
        for name in bad:
            del preconditioned[name]
            if products is not None:
                del products[name]
        self.nonfinite_preconditioned += len(bad)
        warnings.warn(f"non-finite preconditioned gradient in {', '.join(bad)}; left "
                      f"first-order this step ({self.nonfinite_preconditioned} layer-steps so "
                      "far): raise the damping, or check the factors", stacklevel=3)
        if not products:
            return 0.0
        return float(torch.stack(list(products.values())).sum())

    def _end_step(self) -> None:
        self._clear_step_record()
        self.steps += 1
        self.loss_scale.reset()
        self._capturing = self._factor_update_due(self.steps)
        self.strategy.set_step(self.steps)
        self.timer.end_step()

    # Reporting and state ---------------------------------------------------------------------
    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds for K-FAC: ``factors``, ``inverses``, ``buffers`` and ``total``.
        """
        return memory_report(self.layers, self.strategy)

    def metrics(self) -> dict[str, float]:
        """Scalars worth logging after each step: that step's stage times, KL scale and
        damping, failure and skip counters,
        and with a narrower ``precondition_dtype`` the factors this rank keeps wider
        (``wide_state_sides``, see ``precondition_dtype_tolerance``)."""
        out: dict[str, float] = {f"time/{k}": v for k, v in self.timer.last.items()}
        out["kl_scale"] = self.last_kl_scale
        out["damping"] = self._hyper("damping", max(self.steps - 1, 0))  # the last step's
        out["decomposition_failures"] = sum(x.decomposition_failures for x in self.layers)
        if self.state_dtype != self.inverse_dtype:
            out["wide_state_sides"] = sum(
                x.state is not None and x.state.side_dtype(side) != self.state_dtype
                for x in self.layers for side in SIDES)
        out["nonfinite_factor_skips"] = sum(x.nonfinite_factor_skips for x in self.layers)
        out["skipped_overflow_steps"] = self.skipped_overflow_steps
        out["nonfinite_preconditioned"] = self.nonfinite_preconditioned
        return out

    def state_dict(self) -> dict[str, Any]:
        """Step count, per-layer factors and second-order state, and the strategy signature."""
        return {
            "steps": self.steps,
            "skipped_overflow_steps": self.skipped_overflow_steps,
            "nonfinite_preconditioned": self.nonfinite_preconditioned,
            "inverted": self._inverted,
            "inverted_layers": sorted(self._inverted_layers),
            "signature": self.strategy.state_signature(),
            "strategy": self.strategy.state_dict(),
            "layers": {layer.name: layer.state_dict() for layer in self.layers},
            "state_dtype": str(self.state_dtype).removeprefix("torch."),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the model's layers and strategy must match.

        What the hooks captured since the last step is dropped (it belongs to a step the saved
        state has not seen); a factor reduction the backward pass started is abandoned
        unfinished, so load on every rank alike."""
        signature = self.strategy.state_signature()
        if state["signature"] != signature:
            saved = state["signature"]
            differ = ", ".join(
                f"{key}: {_brief(saved.get(key))} saved, {_brief(signature.get(key))} now"
                for key in sorted(set(saved) | set(signature), key=str)
                if saved.get(key) != signature.get(key))
            raise ValueError(f"preconditioner state does not fit this run ({differ}): resume "
                             "with the same strategy and world size, each rank loading the "
                             "state it saved, on the model wrapped as it was (DDP or not)")
        check_saved_layers(self.layers, state["layers"])
        # Same-shaped states of another method (inverses vs Cholesky factors) would be
        # silently misread, so the saved kind must be this method's.
        kind = STATE_TYPES[self.config.state_method].kind
        saved_kinds = {s["state_kind"] for s in state["layers"].values()} - {None, kind}
        if saved_kinds:
            raise ValueError(f"preconditioner state holds {sorted(saved_kinds)} states, "
                             f"inverse_method={self.config.inverse_method!r} with "
                             f"prediv_eigenvalues={self.config.prediv_eigenvalues} needs "
                             f"{kind!r}: resume with the settings it was saved under")
        # Saved under this run's state dtype, every side stays as it was kept (wider where
        # precondition_dtype_tolerance chose so); saved under another one, every side is
        # converted to this run's, and the next inversion chooses again.
        same_dtype = state.get("state_dtype") == str(self.state_dtype).removeprefix("torch.")
        for layer in self.layers:
            layer.load_state_dict(state["layers"][layer.name])
            if layer.state is not None and not same_dtype:
                for side in SIDES:
                    layer.state.convert_side(side, self.state_dtype)
        self.strategy.load_state_dict(state["strategy"])
        self._forget_captures()
        self.steps = int(state["steps"])
        self.skipped_overflow_steps = int(state["skipped_overflow_steps"])
        self.nonfinite_preconditioned = int(state.get("nonfinite_preconditioned", 0))
        self._inverted = bool(state.get("inverted", True))
        # a state saved before "inverted_layers" was kept: every layer with factors had been
        inverted = state.get("inverted_layers")
        self._inverted_layers = (set(inverted) if inverted is not None
                                 else {layer.name for layer in self.layers if layer.has_factors})
        self._capturing = self._factor_update_due(self.steps)
        self.strategy.set_step(self.steps)

    def remove_hooks(self) -> None:
        """Detach from the model: later forward passes are not captured (the gradients of
        those already run still are, when they arrive; :meth:`discard_pending` drops them)."""
        self._hooks.remove()

    def no_capture(self) -> AbstractContextManager[None]:
        """A context in which forward passes add nothing to the statistics, whenever their
        gradients are taken: an adversarial example's, an input-gradient penalty's or any
        gradient the optimizer will not apply, on a forward pass of its own."""
        return self._hooks.paused()

    def add_hooks(self) -> None:
        """Attach to the model again after :meth:`remove_hooks` (nothing if attached)."""
        self._hooks.add()

    def __repr__(self) -> str:
        return (f"KFACPreconditioner({len(self.layers)} layers, {self.config}, "
                f"{self.strategy.describe()})")


def _brief(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a layer placement table is long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."

