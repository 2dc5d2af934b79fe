"""One preconditioned layer: its running factors, its inverse state and its failure counters.

A :class:`KFACLayer` knows nothing about ranks; the distribution strategy decides which of its
methods run on which rank and moves its tensors between ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import cast

import torch
from torch import Tensor

from core.conv_gram import Plan, ShiftedPatches
from core.factors import SymmetricGram, a_scale, add_a_rows, add_g_rows, gram_diagonal_checks
from core.inverse import (
    SIDES,
    STATE_TYPES,
    DecompositionError,
    SecondOrderState,
    all_finite,
    compute_sides,
    factor_shifts,
    kept_dtype,
    make_state,
    precondition,
    predivided,
)
from core.layer_base import PreconditionedLayer, cloned, nbytes, restored
from core.layers import LayerHelper, Rows
from core.timing import StageTimer


class KFACLayer(PreconditionedLayer):
    """Factors and second-order state of one module.

    Args:
        name: The module's qualified name in the model.
        helper: The layer-type helper that reads rows and gradients.
        scaling: Factor scaling convention.
        factor_dtype: Storage dtype of the factors.
        grad_multiplier: Returns the factor by which captured output gradients are multiplied
            (accumulation steps over the AMP loss scale), read at capture time.
        identity_start: Whether the running factors start at the identity (``factor_init``).
    """

    def __init__(
        self,
        name: str,
        helper: LayerHelper,
        *,
        scaling: str,
        factor_dtype: torch.dtype,
        grad_multiplier: Callable[[], float],
        identity_start: bool = False,
    ) -> None:
        super().__init__(name, helper, grad_multiplier=grad_multiplier)
        self.scaling = scaling
        self.identity_start = identity_start
        self.factor_dtype = factor_dtype
        #: Kept inputs, each with its version counter when kept (:meth:`check_captured_inputs`).
        self.captured_inputs: list[tuple[Tensor, int]] = []
        self.captured_grads: list[tuple[Tensor, float]] = []
        #: Forward calls counted (:meth:`note_call`) since the captures were last folded.
        self.calls = 0
        self.batch_a: Tensor | None = None
        self.batch_g: Tensor | None = None
        #: Whether the staged batch factors went into an average across ranks this step.
        self.reduced = False
        self.state: SecondOrderState | None = None
        self.valid_sides: set[str] = set()
        self.decomposition_failures = 0
        self.nonfinite_factor_skips = 0

    # Capture: the hooks keep the tensors; factors are built from them at the step -----------
    def note_call(self, x: Tensor) -> Tensor:
        """Check one forward call's input and count the call (:attr:`backward_complete`);
        returns the input, which :meth:`capture_input` keeps once the call's gradient arrives.

        A new micro-step (gradient accumulation) folds the previous one's tensors into the
        pending batch factors first, so at most one micro-step's tensors are held.
        """
        self.check_input(x)
        if self.captured_grads:
            self.fold_captures()
        self.calls += 1
        return x

    def capture_input(self, x: Tensor) -> None:
        """Keep the input of a forward call whose output gradient has arrived (a reference:
        autograd keeps it alive anyway), with its version counter, which any in-place change
        to it advances (:meth:`check_captured_inputs`)."""
        self.captured_inputs.append((x, x._version))

    def check_captured_inputs(self) -> None:
        """Refuse to build ``A`` from a kept input that was changed in place since it was kept.

        The factors are built after the backward pass (at the next micro-batch's forward call
        or at the step), when autograd no longer guards the input: a buffer refilled in place
        with the next micro-batch (``copy_``) would silently stand in for the data the
        gradient came from.

        Raises:
            RuntimeError: naming the layer and the two ways to keep the data intact.
        """
        for x, version in self.captured_inputs:
            if x._version != version:
                raise RuntimeError(
                    f"{self.name}: the input K-FAC kept from its forward pass was modified in "
                    f"place (version {version}, now {x._version}) before its factor A was built "
                    "from it (at the next micro-batch's forward call or at step()); give each "
                    "micro-batch a fresh input tensor rather than refilling "
                    "one buffer in place, or build the factors in the backward pass with "
                    "factors_in_backward=True")

    def capture_grad_output(self, gy: Tensor) -> None:
        """Keep one backward call's output gradient, with the multiplier in force now."""
        self.captured_grads.append((gy, self.grad_multiplier()))

    @property
    def backward_complete(self) -> bool:
        """Whether every forward call counted in this micro-step has its output gradient
        (never, for a micro-step with a call whose output reached no backward pass: its
        factors are then built at the step)."""
        return self.calls > 0 and len(self.captured_grads) == self.calls

    def fold_captures(self, timer: StageTimer | None = None) -> None:
        """Turn the kept tensors into batch factors (added to the pending ones) and drop them.

        Building factors after the backward pass, when autograd has freed the activations,
        keeps them out of the memory peak. A stride-1 convolution's ``A`` comes from shifted
        views of its input where that is cheaper (:mod:`core.conv_gram`), with no rows at all.
        DP-KFAC's ``A`` of a sequence layer averages each example's rows, so they come from
        the averaged input (:meth:`~core.layers.LayerHelper.example_mean_a_rows`). Otherwise
        rows that are a copy are built and multiplied one
        batch slice at a time (see :data:`core.layers.ROW_PART_BYTES`). With ``timer``, row
        building is timed as ``capture`` and the factor GEMMs as ``factors``.
        """
        self.check_captured_inputs()
        stage = timer.stage if timer is not None else lambda _: nullcontext()
        helper, dtype = self.helper, self.factor_dtype
        for x, _ in self.captured_inputs:
            plan = helper.shifted_plan(x.shape)
            if plan is not None:
                self.a.accumulate(self._shifted_factor(x, plan, stage))
                continue
            slices, rows_of = helper.input_slices(x, dtype), partial(helper.a_rows, dtype=dtype)
            if self.scaling == "dpkfac" and helper.sequence_positions:  # B rows in all
                slices, rows_of = (x,), partial(helper.example_mean_a_rows, dtype=dtype)
            self.a.accumulate(self._batch_factor(
                SymmetricGram(self.a_dim, dtype, x.device), slices, rows_of,
                partial(add_a_rows, batch=x.shape[0], scaling=self.scaling), stage))
        for gy, multiplier in self.captured_grads:
            self.g.accumulate(self._batch_factor(
                SymmetricGram(self.g_dim, dtype, gy.device), helper.grad_slices(gy),
                helper.g_rows, partial(add_g_rows, batch=gy.shape[0], scaling=self.scaling,
                                       multiplier=multiplier), stage))
        self.captured_inputs, self.captured_grads, self.calls = [], [], 0

    def _shifted_factor(self, x: Tensor, plan: Plan,
                        stage: Callable[[str], AbstractContextManager[None]]) -> Tensor:
        """The batch ``A`` of a captured convolution input from its shifted layout (laid out as
        ``capture``, multiplied as ``factors``); the factor is allocated first, since it
        outlives the layout."""
        out = torch.empty(self.a_dim, self.a_dim, dtype=self.factor_dtype, device=x.device)
        with stage("capture"):
            shifted = ShiftedPatches(x, plan, self.factor_dtype)
        with stage("factors"):
            scale = a_scale(x.shape[0], plan.positions, True, self.scaling)
            return shifted.gram(out, scale, self.helper.has_bias)

    @staticmethod
    def _batch_factor(gram: SymmetricGram, slices: Iterable[Tensor],
                      rows_of: Callable[[Tensor], Rows],
                      add: Callable[[SymmetricGram, Rows], None],
                      stage: Callable[[str], AbstractContextManager[None]]) -> Tensor:
        """One batch factor of a captured tensor, built slice by slice (rows timed as
        ``capture``, their GEMMs as ``factors``), so one slice's rows are alive at a time."""
        for part in slices:
            with stage("capture"):
                rows = rows_of(part)
            with stage("factors"):
                add(gram, rows)
            del rows
        with stage("factors"):
            return gram.result()

    # Factor stage ----------------------------------------------------------------------------
    def stage_batch_factors(self, timer: StageTimer | None = None) -> None:
        """Fold the kept tensors, then move the pending batch factors into ``batch_a`` and
        ``batch_g`` (for communication)."""
        self.fold_captures(timer)
        self.batch_a = self.a.take_batch()
        self.batch_g = self.g.take_batch()

    def batch_factors_for_reduction(self) -> tuple[Tensor, Tensor]:
        """This step's staged batch factors, about to be averaged across ranks; zeros, with a
        warning, where this rank captured none (the layer did not run here, or its output did
        not reach the loss), so that every rank's collective has the same layout. The average
        then counts this rank as having seen nothing; if no rank captured the layer, the
        average is zeros, and :meth:`update_running_factors` skips it on every rank alike."""
        self.reduced = True
        if self.batch_a is None or self.batch_g is None:
            warnings.warn(f"{self.name}: no factors captured on this rank in a factor-update "
                          "step; zeros stand in for them in the average across ranks, which "
                          "then undercounts this layer's factors (every rank should run every "
                          "preconditioned layer, in training mode with gradients enabled: "
                          "model.train(), not under torch.no_grad(); skip_layers it "
                          "otherwise)", stacklevel=2)
            self.batch_a, self.batch_g = (
                torch.zeros(dim, dim, dtype=self.factor_dtype, device=self.device)
                for dim in (self.a_dim, self.g_dim))
        return self.batch_a, self.batch_g

    def discard_batch_factors(self) -> None:
        """Forget everything captured for this step (e.g. an AMP overflow step)."""
        self.captured_inputs, self.captured_grads, self.calls = [], [], 0
        self.a.discard_pending()
        self.g.discard_pending()
        self.batch_a = self.batch_g = None
        self.reduced = False

    def discard_pending(self) -> None:
        """:meth:`discard_batch_factors` (the step prologue's name for it)."""
        self.discard_batch_factors()

    def update_running_factors(self, decay: float,
                               checked: tuple[bool, bool] | None = None) -> None:
        """Blend the staged batch factors into the running averages; skip non-finite ones,
        and averages across ranks whose ``A`` is zeros (no rank captured the layer: ``A``, a
        mean of input rows, is zero only then, or for all-zero inputs, where ``G`` may be
        zeros legitimately, its gradients rounded away on a narrow wire).

        Args:
            decay: Weight of the running averages.
            checked: The staged factors' :func:`~core.factors.gram_diagonal_checks`, where
                the caller read them for many layers at once (else they are read here).
        """
        batch_a, batch_g = self.batch_a, self.batch_g
        reduced, self.reduced = self.reduced, False
        self.batch_a = self.batch_g = None
        if batch_a is None or batch_g is None:
            return
        finite, zero = checked or gram_diagonal_checks([(batch_a, batch_g)])[0]
        if not finite:
            self.nonfinite_factor_skips += 1
            warnings.warn(f"{self.name}: non-finite factor batch skipped "
                          f"({self.nonfinite_factor_skips} so far)", stacklevel=2)
            return
        if reduced and zero:
            return
        self.a.update(batch_a, decay, identity_start=self.identity_start)
        self.g.update(batch_g, decay, identity_start=self.identity_start)

    @property
    def has_factors(self) -> bool:
        return self.a.value is not None and self.g.value is not None

    # Inversion -------------------------------------------------------------------------------
    def compute_inverse(self, *, method: str, damping: float, split: str,
                        dtype: torch.dtype, state_dtype: torch.dtype | None = None,
                        sides: tuple[str, ...] = SIDES, grad: Tensor | None = None,
                        tolerance: float | None = None) -> None:
        """Recompute the second-order state of ``sides``; on failure keep the last good one.

        ``method`` is a key of :data:`~core.inverse.STATE_TYPES` (``eigen_prediv``: both
        sides' eigendecompositions, kept as :func:`~core.inverse.predivided` ratios, which
        needs both ``sides``). The decomposition runs in ``dtype`` and is kept in
        ``state_dtype`` (default ``dtype``; a narrower one rounds it once, here), except a side
        whose rounding would move its product with this step's gradient ``grad`` by more than
        ``tolerance`` (:func:`~core.inverse.kept_dtype`; for ``eigen_prediv``, tried as
        ``eigen`` applies the side: the ratios round by 2⁻⁸ relative each, which no product
        amplifies), which stays in ``dtype`` until its next inversion; so does one whose
        rounding leaves the narrower dtype's range (entries beyond it would round to
        infinities), with or without a tolerance. A distributed strategy may ask for one side
        only (the factors of a layer inverted on different ranks); the other side's tensors
        then stay as they are until they arrive.
        """
        if not sides or not self.has_factors:
            return
        assert self.a.value is not None and self.g.value is not None
        prediv = method == "eigen_prediv"
        decomposition = "eigen" if prediv else method
        assert not prediv or set(sides) == set(SIDES), "pre-divided ratios need both sides"
        try:
            decomposed = compute_sides(self.a.value, self.g.value, method=decomposition,
                                       damping=damping, split=split, dtype=dtype, sides=sides)
        except DecompositionError as err:
            self.decomposition_failures += 1
            fallback = "keeping the last good inverse" if self.has_state else "left first-order"
            warnings.warn(f"{self.name}: {err}; {fallback} "
                          f"({self.decomposition_failures} failures so far)", stacklevel=2)
            return
        parts = predivided(decomposed, damping) if prediv else decomposed
        narrow = state_dtype or dtype
        if self.state is None:
            self.state = self.empty_state(method, narrow, self.a.value.device)
        checked = tolerance is not None and grad is not None
        shifts = (self._effective_shifts(decomposed, decomposition, damping, split)
                  if checked and narrow != dtype else {})
        for side, values in parts.items():
            if narrow == dtype:
                self.state.set_side(side, values, narrow)
                continue
            if prediv:  # tried as eigen, on the eigenvalues the ratios came from
                rounded = [t.to(narrow) for t in values]
                probe, probe_kind, probe_rounded = decomposed[side], decomposition, None
            else:
                rounded = self.state.rounded_side(side, values, narrow)
                probe, probe_kind, probe_rounded = values, self.state.kind, rounded
            if checked:
                assert grad is not None and tolerance is not None
                kept = kept_dtype(probe, probe_kind, shifts[side], grad, side, narrow,
                                  tolerance, probe_rounded)
                if kept == narrow and prediv and not all_finite(rounded):
                    kept = dtype
            else:  # without the tolerance, a rounding out of range is still caught
                kept = narrow if all_finite(rounded) else dtype
            self.state.set_side(side, rounded if kept == narrow else values, kept)
        self.valid_sides.update(parts)

    def _effective_shifts(self, parts: dict[str, tuple[Tensor, ...]], method: str,
                          damping: float, split: str) -> dict[str, float]:
        """The damping each side's own product gets, which the rounding check
        (:func:`~core.inverse.kept_dtype`) tries a side's state with: the split's shifts,
        except for ``eigen``, whose product divides by ``d_G d_Aᵀ + λ`` as a whole, so that in
        the direction of the other side's eigenvalue ``d`` a side is damped by ``λ / d``: the
        check takes the smallest, ``λ`` over the other side's largest eigenvalue (from its
        fresh decomposition, or bounded by its factor's trace where that side is decomposed
        on another rank). With ``λ`` itself, a large other side let a side's rounding pass
        that moved the product by 15-120%."""
        assert self.a.value is not None and self.g.value is not None
        factors = {"a": self.a.value, "g": self.g.value}
        if method != "eigen":
            return dict(zip(SIDES, factor_shifts(factors["a"], factors["g"], damping, split),
                            strict=True))
        shifts = {}
        for side, other in zip(SIDES, reversed(SIDES), strict=True):
            largest = (float(parts[other][1].max()) if other in parts
                       else float(torch.trace(factors[other])))
            shifts[side] = damping / largest if largest > 0 else damping
        return shifts

    @property
    def has_state(self) -> bool:
        """Whether both factors' decompositions are present and good on this rank."""
        return self.state is not None and self.valid_sides.issuperset(SIDES)

    def empty_state(self, method: str, dtype: torch.dtype, device: torch.device
                    ) -> SecondOrderState:
        """A zero state of the right shapes, for receiving a broadcast from the owner."""
        return make_state(method, [torch.zeros(shape, dtype=dtype, device=device)
                                   for shape in STATE_TYPES[method].shapes(self.a_dim,
                                                                           self.g_dim)])

    def precondition(self, grad: Tensor, damping: float) -> Tensor | None:
        """``P`` for the current gradient matrix, or None without a second-order state."""
        if not self.has_state:
            return None
        assert self.state is not None
        return precondition(grad, self.state, damping)

    # Reporting -------------------------------------------------------------------------------
    def memory_usage(self) -> dict[str, int]:
        """Bytes held: running factors, second-order state, and pending capture buffers (with
        the kept layer inputs and output gradients)."""

        return {
            "factors": nbytes(self.a.value, self.g.value),
            "inverses": nbytes(*self.state.tensors()) if self.state else 0,
            "buffers": nbytes(self.a.pending, self.g.pending, self.batch_a, self.batch_g,
                              *(x for x, _ in self.captured_inputs),
                              *(g for g, _ in self.captured_grads)),
        }

    def state_dict(self) -> dict[str, object]:
        """Factors, second-order state and counters (tensors are cloned)."""
        state: dict[str, object] = {
            "A": cloned(self.a.value), "G": cloned(self.g.value),
            "decomposition_failures": self.decomposition_failures,
            "nonfinite_factor_skips": self.nonfinite_factor_skips,
            "state_kind": None, "state": None, "valid_sides": sorted(self.valid_sides),
        }
        if self.state is not None:
            state["state_kind"] = self.state.kind
            state["state"] = [t.clone() for t in self.state.tensors()]
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved, checking shapes against this layer.

        The tensors are copied onto this layer's device, the factors in its ``factor_dtype``
        (the state keeps its saved dtypes, which the preconditioner converts): later steps
        update them in place, and must leave the caller's dictionary as it was.

        Raises:
            ValueError: if a saved factor or state tensor does not have this layer's shape.
        """
        for key, dim in (("A", self.a_dim), ("G", self.g_dim)):
            value = cast("Tensor | None", state[key])
            if value is not None and tuple(value.shape) != (dim, dim):
                raise ValueError(f"{self.name}: saved factor {key} has shape "
                                 f"{tuple(value.shape)}, this layer needs {(dim, dim)}")
        kind = state["state_kind"]
        saved: list[Tensor] = state["state"] or []  # type: ignore[assignment]
        if kind is not None:
            needed = [tuple(t.shape) for t in
                      self.empty_state(str(kind), torch.float32, torch.device("meta")).tensors()]
            shapes = [tuple(t.shape) for t in saved]
            if shapes != needed:
                raise ValueError(f"{self.name}: saved {kind} state has shapes {shapes}, this "
                                 f"layer needs {needed}")
        self.a.value = restored(state["A"], self.device, self.factor_dtype)  # type: ignore[arg-type]
        self.g.value = restored(state["G"], self.device, self.factor_dtype)  # type: ignore[arg-type]
        self.decomposition_failures = int(cast(int, state["decomposition_failures"]))
        self.nonfinite_factor_skips = int(cast(int, state["nonfinite_factor_skips"]))
        self.state = None if kind is None else make_state(
            str(kind), [t.to(self.device, copy=True) for t in saved])
        self.valid_sides = set(state["valid_sides"])  # type: ignore[call-overload]
