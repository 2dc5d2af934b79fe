"""Rank-1 (Kronecker-vector) statistics and the preconditioner skeleton MKOR and Eva share.

Both methods summarise a layer's curvature by two vectors per update instead of two matrices:
the mean input row ``ā`` and a mean output-gradient row ``ḡ`` (KFAC_MATH.md "MKOR"). This module
computes those vectors from captured tensors (through the per-layer-type helpers of
``core.layers``), averages them across ranks with one all-reduce of all layers' concatenated
vectors, and runs the step as timed stages:

capture (hooks) → statistics → all-reduce (``factor_comm``) → per-layer update (``inversion``)
→ precondition and write back into ``.grad``, scaled (per layer for MKOR, across layers by
Eva's KL clip).

Subclasses (:class:`core.mkor.MKORPreconditioner`, :class:`core.eva.EvaPreconditioner`) supply the
per-layer state, what an update does with the averaged vectors, how a gradient is preconditioned
and how the results are scaled.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from core.capture import CaptureHooks, HookSet
from core.config import (
    check_choice,
    check_number,
    check_skip_layers,
    config_from_options,
    hyper_at,
    update_due,
)
from core.distributed.communicator import Communicator
from core.layer_base import (
    PreconditionedLayer,
    StepLossScale,
    autocast_off,
    check_saved_layers,
    finite_gradients,
    nbytes,
    refuse_several_devices,
)
from core.layers import LayerHelper, helper_for
from core.preconditioner import discover_layers
from core.timing import StageTimer, traced

#: Module-name regex of the BERT pre-training decoder over the vocabulary (HuggingFace's and
#: NVIDIA's ``BertForPreTraining``): MKOR leaves it first-order, as the paper and its code do.
BERT_DECODER_PATTERN = r"(^|\.)cls\.predictions\.decoder$"

COMPUTE_DTYPES = ("float32", "float64")
WIRE_DTYPES = ("float16", "bfloat16", "float32", "float64")


@traced("activation_vector")
def activation_vector(helper: LayerHelper, x: Tensor, dtype: torch.dtype) -> Tensor:
    """``ā`` without its bias entry: the mean over all rows of a captured layer input, in
    ``dtype``; see :meth:`~core.layers.LayerHelper.mean_input_row`. The bias entry, 1, is
    placed when the layers' vectors are concatenated (:meth:`Rank1Layer.vector_parts`)."""
    return helper.mean_input_row(x, dtype)


@traced("gradient_vector")
def gradient_vector(helper: LayerHelper, gy: Tensor, dtype: torch.dtype, *,
                    per_example: bool, scale: float = 1.0) -> Tensor:
    """A mean output-gradient row of a captured output gradient ``g`` (as autograd hands it),
    times ``scale``, in one reduction and at most one multiplication.

    Args:
        helper: The layer's helper.
        gy: Gradient of the layer output for a loss that is a mean over the ``B`` examples.
        dtype: Arithmetic and result dtype.
        per_example: True for MKOR's statistic, the mean over rows of ``R·g`` (Linear, 2-D or
            3-D with ``R = B·T`` rows; that is ``Σ g``) and, for Conv2d, the batch mean of each
            example's ``B Σ_t g_t / L`` (that is ``Σ g / L``); this is the official code's
            scaling. False for Eva's statistic, the plain mean of ``g`` over rows, which is what
            Eva's code uses and what its damping values are tuned against.
        scale: A further factor (the accumulation steps over the loss scale).
    """
    rows = helper.g_rows(gy)
    # reductions in dtype: CUDA fp16/bf16 -> fp32 without a copy
    if per_example and not rows.spatial:  # R · mean = Σ g
        vector = rows.rows.sum(dim=(0, 1), dtype=dtype)
    else:
        vector = rows.rows.mean(dim=(0, 1), dtype=dtype)
        if per_example:
            scale *= rows.batch
    return vector if scale == 1.0 else vector.mul_(scale)


@dataclass(kw_only=True)
class Rank1Config:
    """Options shared by the rank-1 preconditioners (MKOR, Eva).

    Attributes:
        skip_layers: Module-name regexes or module classes left first-order. The default skips
            BERT's decoder over the vocabulary (its weight is tied to the word embeddings, and
            MKOR's paper and code leave it to the first-order optimizer).
        vocab_size_threshold: Also skip every ``nn.Linear`` with ``out_features`` at least this
            (a vocabulary projection under another name); None disables the rule.
        accumulation_steps: Micro-batches per step; the loss is assumed divided by it.
        dtype: Precision of the statistics and of the update arithmetic ("float32"/"float64").
        comm_dtype: Dtype of the concatenated vectors on the wire (e.g. "float16" halves the
            traffic, as in the MKOR paper); None sends them in ``dtype``.
    """

    skip_layers: Sequence[str | type[nn.Module]] = field(
        default_factory=lambda: (BERT_DECODER_PATTERN,))
    vocab_size_threshold: int | None = None
    accumulation_steps: int = 1
    dtype: str = "float32"
    comm_dtype: str | None = None

    def __post_init__(self) -> None:
        check_skip_layers(self.skip_layers)
        if self.vocab_size_threshold is not None:
            check_number("vocab_size_threshold", self.vocab_size_threshold, low=1, integer=True)
        check_number("accumulation_steps", self.accumulation_steps, low=1, integer=True)
        check_choice("dtype", self.dtype, COMPUTE_DTYPES)
        if self.comm_dtype is not None:
            check_choice("comm_dtype", self.comm_dtype, WIRE_DTYPES)


class Rank1Layer(PreconditionedLayer):
    """Captured statistics of one module; subclasses add the method's per-layer state.

    Micro-step vectors (gradient accumulation, or a module called several times per forward)
    are summed and averaged when the step takes them, like K-FAC's pending batch factors.

    Args:
        name: The module's qualified name.
        helper: The layer-type helper.
        dtype: Arithmetic dtype of the statistics.
        grad_multiplier: Returns the factor by which captured output gradients are multiplied
            (accumulation steps over the AMP loss scale), read at capture time.

    Attributes:
        per_example: Which gradient statistic the method uses (see :func:`gradient_vector`).
    """

    per_example: ClassVar[bool] = True

    def __init__(self, name: str, helper: LayerHelper, *, dtype: torch.dtype,
                 grad_multiplier: Callable[[], float]) -> None:
        super().__init__(name, helper, grad_multiplier=grad_multiplier)
        self.dtype = dtype

    def input_statistic(self, x: Tensor) -> Tensor:
        """``ā`` (without its bias entry) of one forward call's input, checked: all that is
        kept of the input until the call's output gradient arrives."""
        self.check_input(x)
        return activation_vector(self.helper, x, self.dtype)

    def capture_input(self, a: Tensor) -> None:
        """Accumulate one call's :meth:`input_statistic`, once its output gradient arrived."""
        self.a.accumulate(a)

    def capture_grad_output(self, gy: Tensor) -> None:
        """Accumulate the gradient statistic of one backward call."""
        self.g.accumulate(gradient_vector(self.helper, gy, self.dtype,
                                          per_example=self.per_example,
                                          scale=self.grad_multiplier()))

    def vector_parts(self, one: Tensor) -> list[Tensor]:
        """The parts of ``[ā; ḡ]`` of this step, pending cleared: ``ā``, ``one`` (the bias
        entry, a 1-element tensor of ones) with a bias, and ``ḡ``; one part of zeros for a
        layer that was not captured. The caller concatenates every layer's parts at once."""
        a, g = self.a.take_batch(), self.g.take_batch()
        if a is None or g is None:
            warnings.warn(f"{self.name}: no statistics were captured on an update step (was the "
                          "module called in the forward pass, on a non-empty batch, in training "
                          "mode with gradients enabled: model.train(), not under "
                          "torch.no_grad()?); sending zeros",
                          stacklevel=3)
            return [torch.zeros(self.a_dim + self.g_dim, dtype=self.dtype, device=self.device)]
        return [a, one, g] if self.helper.has_bias else [a, g]

    def discard_pending(self) -> None:
        """Forget this step's captured vectors (an overflowed AMP step)."""
        self.a.discard_pending()
        self.g.discard_pending()

    def pending_bytes(self) -> int:
        """Bytes of the not yet consumed micro-step vectors."""
        return nbytes(self.a.pending, self.g.pending)

    # Per-method state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def memory_usage(self) -> dict[str, int]:
        raise NotImplementedError


class Rank1Preconditioner:
    """The step shared by MKOR and Eva; see the module docstring.

    Subclasses set :attr:`config_type`, :attr:`interval_field` (the config field giving the
    update interval) and implement :meth:`_make_layer`, :meth:`_update_layer`,
    :meth:`_precondition` (and :meth:`_gradients` for another form of the gradients).

    Args:
        model: The model (or its DDP wrapper). Gradients must already be averaged across ranks
            (DDP does this) when :meth:`step` runs.
        config: A ready configuration; or give its fields as keyword arguments.
        grad_scaler: An AMP ``GradScaler`` whose scale is divided out of captured gradients.
            Unscale the gradients (``scaler.unscale_(optimizer)``) before ``step()``.
        communicator: Carries the one all-reduce per update and records it in its ledger;
            by default one on the initialised process group (a world of one otherwise).
        **options: Fields of :attr:`config_type`.

    Raises:
        ConfigError: on an invalid option, naming the field and the allowed values.
    """

    config_type: ClassVar[type[Rank1Config]] = Rank1Config
    interval_field: ClassVar[str] = ""

    def __init__(self, model: nn.Module, config: Rank1Config | None = None, *,
                 grad_scaler: Any = None, communicator: Communicator | None = None,
                 **options: Any) -> None:
        self.config = config_from_options(self.config_type, config, options)
        self.dtype: torch.dtype = getattr(torch, self.config.dtype)
        self.comm_dtype: torch.dtype = getattr(torch, self.config.comm_dtype or self.config.dtype)
        self.steps = 0
        self.skipped_overflow_steps = 0
        self.nonfinite_statistics_skips = 0
        self.loss_scale = StepLossScale(grad_scaler)
        self._slice_owner: Tensor | None = None  # layer index of each entry of the vectors
        self.communicator = communicator or Communicator.from_torch()

        threshold = self.config.vocab_size_threshold
        # a Sequence, so that subclasses narrow it to their own layer type
        self.layers: Sequence[Rank1Layer] = [
            self._make_layer(name, helper)
            for name, module in discover_layers(model, self.config.skip_layers,
                                                quiet=(BERT_DECODER_PATTERN,))
            if (helper := helper_for(module)) is not None
            and not (threshold is not None and isinstance(module, nn.Linear)
                     and module.out_features >= threshold)
        ]
        refuse_several_devices(type(self).__name__, self.layers)
        if not self.layers:
            warnings.warn(f"{type(self).__name__} found no supported layers (Linear, Conv1D, "
                          "Conv2d); step() leaves every gradient first-order", stacklevel=2)
        self.timer = StageTimer(device_events=lambda: any(
            layer.device.type == "cuda" for layer in self.layers[:1]))
        self._capturing = self._update_due(0)
        self._hooks = HookSet(lambda: [self._register(layer) for layer in self.layers])

    # Hooks -----------------------------------------------------------------------------------
    def _register(self, layer: Rank1Layer) -> CaptureHooks:
        def on_forward(x: Tensor) -> Tensor:
            with self.timer.stage("capture"):
                return layer.input_statistic(x)

        def on_grad_output(gy: Tensor) -> None:
            with self.timer.stage("capture"):
                layer.capture_grad_output(gy)

        return CaptureHooks(layer.helper.module, on_input=layer.capture_input,
                            on_grad_output=on_grad_output, enabled=lambda: self._capturing,
                            name=layer.name, on_forward=on_forward)

    def _grad_multiplier(self) -> float:
        """``accumulation_steps / loss_scale``: undo the loss division and the AMP scale.

        The scale is read at the first capture of a step (the scaler updates it after the
        optimizer step, so reading it later would use the next step's scale).
        """
        return self.config.accumulation_steps / self.loss_scale.get()

    def _update_due(self, step: int) -> bool:
        interval = getattr(self.config, self.interval_field)
        return update_due(self.interval_field, interval, step)

    # The step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Precondition this step's gradients (after ``backward``, before the optimizer).

        Rewrites ``.grad`` of the preconditioned layers in place; other parameters keep their
        raw gradients. A step with non-finite gradients (an AMP overflow) is left first-order
        and its captured statistics are dropped.
        """
        with autocast_off():
            self.communicator.ledger.step = self.steps
            grads = self._gradients()
            if grads is None:  # an AMP overflow: statistics dropped, gradients left raw
                self.skipped_overflow_steps += 1
                self._end_step()
                return
            if self._capturing and self.layers:
                with self.timer.stage("factors"):
                    one = torch.ones(1, dtype=self.dtype, device=self.layers[0].device)
                    vector = torch.cat([part for layer in self.layers
                                        for part in layer.vector_parts(one)])
                with self.timer.stage("factor_comm"):
                    vector = self._communicate(vector)
                with self.timer.stage("inversion"):
                    self._update_captured(vector)
            with self.timer.stage("precondition"):
                self._precondition([(layer, grad) for layer in self.layers
                                    if (grad := grads[layer.name]) is not None])
            self._end_step()

    def skip_step(self) -> None:
        """Account for a step whose optimizer update was skipped without :meth:`step` running
        (a ``GradScaler`` that found an overflow skips ``optimizer.step()`` altogether): the
        statistics its hooks captured are dropped and the step is counted, as :meth:`step`
        does with an overflow it sees."""
        self.discard_pending()
        self.skipped_overflow_steps += 1
        self._end_step()

    def discard_pending(self) -> None:
        """Forget the statistics the hooks captured since the last step, counting nothing
        (a step that will not be taken, such as the one on which
        :class:`~core.hybrid.HybridSwitch` switches to first order), and the loss scale read
        for them (the next capture reads the scaler's scale afresh)."""
        for layer in self.layers:
            layer.discard_pending()
        self.loss_scale.reset()

    def _update_captured(self, vector: Tensor) -> None:
        """Update every layer from its slices ``ā``, ``ḡ`` of the rank-averaged ``vector``.

        Layers whose two slices are all zeros (not captured on any rank) are left as they are,
        and so, counted and reported, are layers whose slices are not finite (statistics
        captured in a step whose gradients overflowed and whose ``step()`` never ran, as when a
        ``GradScaler`` skips the optimizer: see :meth:`skip_step`); which those are is read with
        one reduction and one sync for all layers.
        """
        sizes = [dim for layer in self.layers for dim in (layer.a_dim, layer.g_dim)]
        owner = self._slice_owner
        if owner is None or owner.device != vector.device:
            owner = torch.arange(len(sizes), device=vector.device).repeat_interleave(
                torch.tensor(sizes, device=vector.device)) // 2
            self._slice_owner = owner
        magnitude = torch.zeros(len(self.layers), dtype=vector.dtype, device=vector.device)
        magnitudes = magnitude.index_add_(0, owner, vector.abs()).tolist()
        slices = vector.split(sizes)
        skipped = []
        for i, layer in enumerate(self.layers):
            if not math.isfinite(magnitudes[i]):  # an overflowed capture the step never saw
                skipped.append(layer.name)
            elif magnitudes[i] != 0:
                self._update_layer(layer, slices[2 * i], slices[2 * i + 1])
        if skipped:
            self.nonfinite_statistics_skips += len(skipped)
            warnings.warn(f"non-finite statistics of {', '.join(skipped)} skipped "
                          f"({self.nonfinite_statistics_skips} layer updates so far)",
                          stacklevel=3)

    def _communicate(self, vector: Tensor) -> Tensor:
        """Average the concatenated vectors of all layers across ranks, in the wire dtype.

        The single call site of second-order communication: one all-reduce that divides by the
        world size exactly once (the official MKOR code divides twice, so its vectors come out
        divided by ``P²``), recorded in the communicator's ledger as stage ``factor_comm``.
        Nothing travels, and nothing is recorded, on one process.
        """
        return self.communicator.all_reduce(vector, stage="factor_comm", average=True,
                                            dtype=self.comm_dtype)

    def _hyper(self, name: str, step: int | None = None) -> float:
        """A constant-or-scheduled config value at ``step`` (this step by default), checked
        against its bounds."""
        return hyper_at(name, getattr(self.config, name), self.steps if step is None else step)

    def _update_layer(self, layer: Any, a: Tensor, g: Tensor) -> None:
        """Consume the rank-averaged vectors ``ā``, ``ḡ`` of ``layer`` on an update step."""
        raise NotImplementedError

    def _gradients(self) -> dict[str, Any] | None:
        """This step's gradients by layer name in the form :meth:`_precondition` takes
        (by default the matrices ``∇W̄``; None where a layer has none), or None if any entry
        is not finite (the captured statistics are then dropped)."""
        return finite_gradients(self.layers)

    def _precondition(self, grads: list[tuple[Any, Any]]) -> None:
        """Precondition each ``(layer, gradient)`` and write the result into the layer's
        ``.grad`` (with the method's scale: per layer, or across layers as Eva's KL clip),
        each layer while its matrices are still in cache where the method allows; layers the
        method cannot precondition yet keep their raw gradients."""
        raise NotImplementedError

    def _make_layer(self, name: str, helper: LayerHelper) -> Rank1Layer:
        raise NotImplementedError

    def _end_step(self) -> None:
        self.steps += 1
        # what moves before the next step() (the gradient all-reduce) belongs to it
        self.communicator.ledger.step = self.steps
        self._capturing = self._update_due(self.steps)
        self.loss_scale.reset()
        self.timer.end_step()

    # Reporting and state ---------------------------------------------------------------------
    def memory_usage(self) -> dict[str, int]:
        """Bytes held per kind (the subclass's per-layer kinds, ``buffers``) and ``total``."""
        usage: dict[str, int] = {"buffers": 0}
        for layer in self.layers:
            for key, value in layer.memory_usage().items():
                usage[key] = usage.get(key, 0) + value
            usage["buffers"] += layer.pending_bytes()
        usage["total"] = sum(usage.values())
        return usage

    def metrics(self) -> dict[str, float]:
        """Scalars worth logging each step: stage times, communication volume, skip counter."""
        out: dict[str, float] = {f"time/{k}": v for k, v in self.timer.last.items()}
        sent = self.communicator.ledger.select(step=self.steps - 1, stage="factor_comm")
        out["comm/elements"] = float(sum(entry.elements for entry in sent))
        out["comm/bytes"] = float(sum(entry.bytes for entry in sent))
        out["skipped_overflow_steps"] = float(self.skipped_overflow_steps)
        out["nonfinite_statistics_skips"] = float(self.nonfinite_statistics_skips)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Step count, counters and per-layer state (tensors cloned)."""
        return {
            "steps": self.steps,
            "skipped_overflow_steps": self.skipped_overflow_steps,
            "nonfinite_statistics_skips": self.nonfinite_statistics_skips,
            "layers": {layer.name: layer.state_dict() for layer in self.layers},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the model's preconditioned layers must match.
        Statistics captured since the last step are dropped (they belong to a step the saved
        state has not seen)."""
        check_saved_layers(self.layers, state["layers"])
        for layer in self.layers:
            layer.load_state_dict(state["layers"][layer.name])
        self.discard_pending()
        self.steps = int(state["steps"])
        self.skipped_overflow_steps = int(state["skipped_overflow_steps"])
        self.nonfinite_statistics_skips = int(state.get("nonfinite_statistics_skips", 0))
        self.communicator.ledger.step = self.steps
        self._capturing = self._update_due(self.steps)

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
        return f"{type(self).__name__}({len(self.layers)} layers, {self.config})"
