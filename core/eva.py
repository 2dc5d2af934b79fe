"""Eva: Kronecker-vectorised second-order preconditioning (Zhang, Shi and Li, ICLR 2023).

Eva keeps, per layer, running averages of two vectors instead of two matrices: the mean input row
``ā`` and the mean output-gradient row ``ḡ`` (the rank-1 statistics MKOR also uses, see
:mod:`core.rank1`). Its curvature is the rank-1 Kronecker product of those vectors plus damping,
``F = (ā āᵀ) ⊗ (ḡ ḡᵀ) + λI = v vᵀ + λI`` with ``v = ā ⊗ ḡ``, and the Sherman–Morrison formula
gives the preconditioned gradient in closed form, without any matrix inverse:

``(v vᵀ + λI)⁻¹ x = (x − v (vᵀx) / (λ + vᵀv)) / λ``, i.e. for the gradient matrix ``∇W̄``
(``g_dim × a_dim``): ``P = (∇W̄ − (ḡᵀ ∇W̄ ā) / (λ + ‖ā‖² ‖ḡ‖²) · ḡ āᵀ) / λ``.

Then K-FAC's KL clip (KFAC_MATH.md "KL clipping") scales all layers' ``P`` together. This is the
formula of the authors' code (``lzhangbv/eva``, ``kfac/eva.py``; also vendored in the MKOR repo as
its Eva baseline): the damping is added once to the Kronecker-vector product, not to each factor
(``(ḡḡᵀ + λI)⁻¹ ∇W̄ (āāᵀ + λI)⁻¹`` would be a different operator).

Conventions kept from Eva's code, because its damping values are tuned against them:

* ``ḡ`` is the plain mean of the output gradient ``g`` over rows (not MKOR's ``R·g``), from the
  local batch; across ranks the local vectors are averaged. Its scale is therefore that of the
  local batch's mean loss: ``P`` ranks give ``P`` times the ``ḡ`` of one process on the global
  batch. Micro-batches under ``accumulation_steps = K`` count the same way (each one's ``g`` is
  taken for its own mean loss, then the ``K`` vectors averaged), so ``K`` micro-batches on one
  rank give the ``ḡ`` of ``K`` ranks with one micro-batch each, ``K`` times that of the same
  examples in one batch. Unlike MKOR's ``R·g``, whose mean does not depend on the batch size,
  this statistic (and so the damping it is tuned against) depends on the local batch.
* Eva's code calls the weight of the **new** vector ``factor_decay`` (0.95 in its scripts); here
  ``factor_decay`` is the weight of the **old** average, as everywhere in ``core``, so Eva's
  configurations translate as ``factor_decay = 1 − d`` (default 0.05).
* Eva's code computes its statistics on the first 16 examples of the batch (``kfac_batch_size``);
  we use the whole local batch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from core.config import check_hyper, check_schedulable
from core.hyper import Schedulable
from core.inverse import kl_clip_scale
from core.layer_base import (
    HALF_OVERFLOW_FIX,
    cloned,
    finite_gradients,
    half_overflows,
    nbytes,
    restored,
    sum_of_squares,
    unaliased,
)
from core.layers import LayerHelper
from core.rank1 import Rank1Config, Rank1Layer, Rank1Preconditioner
from core.timing import traced


def eva_precondition(grad: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
    """``(ā āᵀ ⊗ ḡ ḡᵀ + λI)⁻¹ vec ∇W̄`` as a ``(g_dim, a_dim)`` matrix, by Sherman–Morrison:
    ``P = (∇W̄ − c·ḡ āᵀ) / λ`` with ``c = ḡᵀ ∇W̄ ā / (‖ā‖² ‖ḡ‖² + λ)``. The formula on its own;
    the preconditioner computes the same in two passes over each gradient
    (:meth:`EvaLayer.closed_form_sums`, then one rank-1 update written into ``.grad``).

    Args:
        grad: ``∇W̄``, ``(g_dim, a_dim)``.
        a: ``ā``, ``(a_dim,)``.
        g: ``ḡ``, ``(g_dim,)``.
        damping: ``λ`` > 0.
    """
    coeff = torch.dot(g, torch.mv(grad, a)) / ((a @ a) * (g @ g) + damping)
    return torch.addr(grad, g * coeff, a, beta=1.0 / damping, alpha=-1.0 / damping)


@dataclass(kw_only=True)
class EvaConfig(Rank1Config):
    """All options of :class:`EvaPreconditioner` (and the shared ones of
    :class:`~core.rank1.Rank1Config`).

    Attributes:
        damping: ``λ`` > 0 (number or callable of the step); Eva's code defaults to 0.03.
        factor_decay: Weight of the old running average of ``ā`` and ``ḡ``, in [0, 1) (number
            or callable); the first update sets the averages. Eva's ``d`` is ``1 − factor_decay``.
        factor_update_steps: Capture and update the vectors every this many steps.
        kl_clip: KL-clip ``κ`` > 0 (number or callable), or None to disable.
        lr: Learning rate used only by the KL clip (number or callable of the step).
    """

    damping: Schedulable[float] = 0.03
    factor_decay: Schedulable[float] = 0.05
    factor_update_steps: Schedulable[int] = 1
    kl_clip: Schedulable[float] | None = 1e-3
    lr: Schedulable[float] = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_hyper("damping", self.damping)
        check_hyper("factor_decay", self.factor_decay)
        check_schedulable("factor_update_steps", self.factor_update_steps, low=1, integer=True)
        if self.kl_clip is not None:
            check_hyper("kl_clip", self.kl_clip)
        check_hyper("lr", self.lr)


class EvaLayer(Rank1Layer):
    """One layer's running averages of ``ā`` and ``ḡ`` (held in ``self.a.value``,
    ``self.g.value`` of the inherited :class:`~core.factors.RunningFactor` pair)."""

    per_example: ClassVar[bool] = False

    #: ``‖ā‖² ‖ḡ‖²`` of the running averages, refreshed whenever they change.
    norm_product: Tensor | None = None
    #: Steps on which this layer's ``P`` left its float16 weight's range and the raw gradient
    #: was kept.
    nonfinite_preconditioned: int = 0

    def update(self, a: Tensor, g: Tensor, decay: float) -> None:
        """Blend the rank-averaged vectors into the running averages."""
        self.a.update(a, decay)
        self.g.update(g, decay)
        self._refresh_norm_product()

    def _refresh_norm_product(self) -> None:
        a, g = self.a.value, self.g.value
        self.norm_product = None if a is None or g is None else (a @ a) * (g @ g)

    @traced("eva_sums")
    def closed_form_sums(self, parts: tuple[Tensor, Tensor | None],
                         squared_norm: Tensor | None = None
                         ) -> tuple[Tensor, Tensor, Tensor] | None:
        """``s = ḡᵀ ∇W̄ ā``, ``‖∇W̄‖²`` and ``‖ā‖² ‖ḡ‖²`` as 0-d tensors, from
        ``parts = (∇W, ∇b)`` without joining them (one matrix-vector product reads ``∇W``;
        ``‖∇W̄‖²`` too unless given: the step's finiteness check takes it); None before the
        first update.

        With them the step needs no further read of the gradient before writing it:
        ``P = (∇W̄ − c·ḡ āᵀ) / λ`` with ``c = s / (‖ā‖² ‖ḡ‖² + λ)``, and the KL clip's
        ``Σ P ⊙ ∇W̄ = (‖∇W̄‖² − c·s) / λ``.
        """
        a, g = self.a.value, self.g.value
        if a is None or g is None:
            return None
        if self.norm_product is None:  # vectors set other than by update() or a checkpoint
            self._refresh_norm_product()
        assert self.norm_product is not None  # a and g are set, so the refresh set it
        weight, bias = parts
        w_cols = weight.shape[1]
        # (∇Wᵀ ḡ)ᵀ ā, not ḡᵀ (∇W ā): MKL's one-thread product streams row-major gradients
        # out of cache 1.2-1.6x faster transposed (AMD EPYC host, ResNet-18's and BERT's)
        s = torch.dot(torch.mv(weight.t(), g), a[:w_cols])
        if bias is not None:
            s = torch.addcmul(s, torch.dot(g, bias), a[w_cols])
        if squared_norm is None:
            squared_norm = sum_of_squares([t for t in parts if t is not None])
        return s, squared_norm, self.norm_product

    def memory_usage(self) -> dict[str, int]:
        return {"vectors": nbytes(self.a.value, self.g.value)}

    def state_dict(self) -> dict[str, Any]:
        return {"a": cloned(self.a.value), "g": cloned(self.g.value),
                "nonfinite_preconditioned": self.nonfinite_preconditioned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, dim in (("a", self.a_dim), ("g", self.g_dim)):
            value = state[key]
            if value is not None and tuple(value.shape) != (dim,):
                raise ValueError(f"{self.name}: saved vector {key} has shape "
                                 f"{tuple(value.shape)}, this layer needs {(dim,)}")
        self.a.value, self.g.value = (restored(state[key], self.device, self.dtype)
                                      for key in ("a", "g"))
        self._refresh_norm_product()
        self.nonfinite_preconditioned = int(state.get("nonfinite_preconditioned", 0))


class EvaPreconditioner(Rank1Preconditioner):
    """Eva's Kronecker-vector preconditioning of every supported layer's gradient.

    Usage: ``loss.backward(); eva.step(); optimizer.step()``; ``step()`` rewrites ``.grad`` of
    the preconditioned layers in place. See the module docstring for the formula and the
    conventions of Eva's code that are kept.

    Args:
        model: The model (or its DDP wrapper).
        config: An :class:`EvaConfig`; or give its fields as keyword arguments, e.g.
            ``EvaPreconditioner(model, damping=0.03, factor_decay=0.05, kl_clip=1e-3, lr=0.1)``.
        grad_scaler: An AMP ``GradScaler`` whose scale is divided out of captured gradients.
        **options: :class:`EvaConfig` fields.

    Raises:
        ConfigError: on an invalid option, naming the field and the allowed values.
    """

    config_type: ClassVar[type[Rank1Config]] = EvaConfig
    interval_field: ClassVar[str] = "factor_update_steps"
    config: EvaConfig
    layers: list[EvaLayer]
    last_kl_scale: float = 1.0
    #: ``‖∇W̄‖²`` of each layer with a gradient this step, from :meth:`_gradients`.
    _squared_norms: dict[str, Tensor]

    def _make_layer(self, name: str, helper: LayerHelper) -> EvaLayer:
        return EvaLayer(name, helper, dtype=self.dtype, grad_multiplier=self._grad_multiplier)

    def _update_layer(self, layer: EvaLayer, a: Tensor, g: Tensor) -> None:
        layer.update(a, g, self._hyper("factor_decay"))

    def _gradients(self) -> dict[str, Any] | None:
        """Weight and bias gradients apart (views, no copy: Eva reads and writes them in
        place), their squared norms kept from the finiteness check for the KL clip."""
        self._squared_norms = {}
        return finite_gradients(self.layers, parts=True, squared_norms=self._squared_norms)

    def _precondition(self, grads: list[tuple[EvaLayer, Any]]) -> None:
        """Write each layer's ``P``, KL-clipped, into ``.grad`` in two passes over the
        gradients: first each layer's closed-form sums (:meth:`EvaLayer.closed_form_sums`: a
        matrix-vector product, with the squared norm from the finiteness check), brought to
        the host in one transfer for all layers, which gives every coefficient and the clip's
        scale (summed in model order, so every rank gets the same bits); then one rank-1
        update of each gradient in place, the scale folded in."""
        damping = self._hyper("damping")
        ready: list[tuple[EvaLayer, tuple[Tensor, Tensor | None]]] = []
        sums: list[Tensor] = []
        for layer, parts in grads:
            parts = tuple(None if t is None else t.to(self.dtype) for t in parts)
            squared_norm = self._squared_norms[layer.name]
            # a narrower gradient's is taken again in our dtype
            norm = squared_norm if squared_norm.dtype == self.dtype else None
            layer_sums = layer.closed_form_sums(parts, norm)
            if layer_sums is not None:
                ready.append((layer, parts))
                sums.extend(layer_sums)
        if not ready:
            self.last_kl_scale = 1.0
            return
        values = torch.stack(sums).tolist()
        kept, out_of_range, coefficients, kl_sum = [], [], [], 0.0
        for (layer, parts), s, squared, norm_product in zip(
                ready, values[0::3], values[1::3], values[2::3], strict=True):
            coefficient = s / (norm_product + damping)
            term = (squared - coefficient * s) / damping
            # an overflowed ‖ā‖²‖ḡ‖² would make c = 0 (P = ∇W̄/λ, silently), an overflowed s NaN
            if all(map(math.isfinite, (s, squared, norm_product, coefficient, term))):
                kept.append((layer, parts))
                coefficients.append(coefficient)
                kl_sum += term
            else:
                out_of_range.append(layer)
        self._leave_first_order(out_of_range)
        ready = unaliased(kept)
        if not ready:
            self.last_kl_scale = 1.0
            return
        scale = 1.0
        if self.config.kl_clip is not None:
            scale = kl_clip_scale(kl_sum, self._hyper("lr"), self._hyper("kl_clip"))
        self.last_kl_scale = scale
        for (layer, parts), coefficient in zip(ready, coefficients, strict=True):
            g, a = layer.g.value, layer.a.value
            assert g is not None and a is not None  # as closed_form_sums found them
            layer.helper.add_outer_to_grad(parts, g, a, beta=scale / damping,
                                           alpha=-scale * coefficient / damping)
        self._restore_half_overflows(dict(ready))

    def _leave_first_order(self, layers: list[EvaLayer]) -> None:
        """Count and report the layers whose closed form left the statistics' dtype's range
        this step (gradients or vectors near its end, as in a diverging step): their raw
        gradients stay, and the KL clip sums over the other layers."""
        if not layers:
            return
        for layer in layers:
            layer.nonfinite_preconditioned += 1
        total = sum(x.nonfinite_preconditioned for x in self.layers)
        warnings.warn(f"Eva's closed form for {', '.join(x.name for x in layers)} is not finite "
                      f"in {self.dtype} (gradients or statistics near the end of its range); "
                      f"left first-order this step ({total} layer-steps so far): lower the "
                      "learning rate, or check the loss scale", stacklevel=5)

    def _restore_half_overflows(self, raw: dict[EvaLayer, tuple[Tensor, Tensor | None]]
                                ) -> None:
        """Give back its raw gradient, counted and reported, to each float16 layer whose
        written ``P`` left float16's range (:func:`~core.layer_base.half_overflows`); the raw
        parts are this step's copies in the statistics' dtype, which a float16 weight's
        gradient always gets."""
        overflowed = half_overflows(list(raw))
        for layer in overflowed:
            layer.nonfinite_preconditioned += 1
            g, a = layer.g.value, layer.a.value
            assert g is not None and a is not None  # as closed_form_sums found them
            layer.helper.add_outer_to_grad(raw[layer], g, a, beta=1.0, alpha=0.0)
        if overflowed:
            total = sum(x.nonfinite_preconditioned for x in self.layers)
            warnings.warn(f"preconditioned gradient of {', '.join(x.name for x in overflowed)} "
                          "exceeds float16's range; left first-order this step "
                          f"({total} layer-steps so far): {HALF_OVERFLOW_FIX}", stacklevel=5)

    def metrics(self) -> dict[str, float]:
        """The last step's stage times, communication volume, KL-clip scale and damping."""
        out = super().metrics()
        out["kl_scale"] = self.last_kl_scale
        out["nonfinite_preconditioned"] = float(sum(x.nonfinite_preconditioned
                                                    for x in self.layers))
        out["damping"] = self._hyper("damping", max(self.steps - 1, 0))  # the last step's
        return out
