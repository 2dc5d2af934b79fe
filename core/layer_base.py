"""What every preconditioned layer shares (K-FAC's :class:`~core.kfac_layer.KFACLayer`, the rank-1
methods' :class:`~core.rank1.Rank1Layer`), and the gradient prologue of every preconditioner step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from core.factors import RunningFactor
from core.inverse import all_finite
from core.layers import LayerHelper


@contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast off within: a preconditioner's step called inside the training loop's autocast
    region ran its products in float16 or bfloat16 (K-FAC, whatever its dtypes said) or failed
    on the mixed dtypes (MKOR's ``dot`` of a float32 vector and an autocast product). A
    context, not a decorator: a wrapper's frame would shift where the step's warnings point."""
    with ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def squared_norm(t: Tensor) -> Tensor:
    """``‖t‖²`` as a 0-d tensor, by one dot product of ``t`` with itself: on the CPU a BLAS
    ``dot``, about twice as fast as ``torch.linalg.vector_norm`` on gradient-sized matrices."""
    flat = t.reshape(-1)
    return torch.dot(flat, flat)


def sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    """``Σ ‖t‖²`` over one or more tensors, as a 0-d tensor (:func:`squared_norm` of each)."""
    total = squared_norm(tensors[0])
    for t in tensors[1:]:
        total = total + squared_norm(t)
    return total


def restored(value: Tensor | None, device: torch.device, dtype: torch.dtype | None = None
             ) -> Tensor | None:
    """A copy of a saved tensor on ``device`` (in ``dtype`` if given), or None for None.

    Always a copy: the running statistics and states it becomes are updated in place, which
    must leave a checkpoint the caller still holds (an in-memory rollback) as it was.
    """
    return None if value is None else value.to(device, dtype, copy=True)


def cloned(value: Tensor | None) -> Tensor | None:
    """A copy of ``value`` for a checkpoint (None for None), which the in-place updates of the
    steps after it must not change."""
    return None if value is None else value.clone()


class StepLossScale:
    """The AMP loss scale of the current step (1 without a scaler), for dividing it out of
    captured gradients.

    Read at the step's first capture and kept until :meth:`reset` at the step's end: the
    scaler moves its scale after the optimizer step, so a later read would give the next
    step's.

    Args:
        grad_scaler: An AMP ``GradScaler`` (anything with ``get_scale()``), or None.
    """

    def __init__(self, grad_scaler: Any = None) -> None:
        self.grad_scaler = grad_scaler
        self._value: float | None = None

    def get(self) -> float:
        if self._value is None:
            self._value = (1.0 if self.grad_scaler is None
                           else float(self.grad_scaler.get_scale()))
        return self._value

    def reset(self) -> None:
        self._value = None


def nbytes(*tensors: Tensor | None) -> int:
    """Bytes held by the given tensors (None entries count zero)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PreconditionedLayer:
    """One module's name, helper and running ``A``-side and ``G``-side statistics.

    Args:
        name: The module's qualified name in the model.
        helper: The layer-type helper that reads rows and gradients.
        grad_multiplier: Returns the factor by which captured output gradients are multiplied
            (accumulation steps over the AMP loss scale), read at capture time.

    Attributes:
        a: Running input-side statistic (a factor ``A`` or a vector ``ā``).
        g: Running output-gradient-side statistic (``G`` or ``ḡ``).
    """

    def __init__(self, name: str, helper: LayerHelper, *,
                 grad_multiplier: Callable[[], float]) -> None:
        self.name = name
        self.helper = helper
        self.grad_multiplier = grad_multiplier
        self.a = RunningFactor()
        self.g = RunningFactor()

    @property
    def a_dim(self) -> int:
        return self.helper.a_dim

    @property
    def g_dim(self) -> int:
        return self.helper.g_dim

    @property
    def device(self) -> torch.device:
        """Where the layer's weight, and so its second-order state, lives."""
        return self.helper.weight.device

    def check_input(self, x: Tensor) -> None:
        """Refuse a captured input this layer cannot build rows from (an unbatched one).

        Raises:
            ValueError: naming the layer, the shape and the fix.
        """
        problem = self.helper.input_problem(x)
        if problem is not None:
            raise ValueError(f"{self.name}: {problem}")

    def discard_pending(self) -> None:
        """Forget everything captured for this step (an AMP overflow step)."""
        raise NotImplementedError


# A layer type that the helpers below hand back as they were given it, and a tuple of gradient
# tensors (None entries allowed) that unaliased() gives back alike.
_LayerT = TypeVar("_LayerT", bound=PreconditionedLayer)
_SourcesT = TypeVar("_SourcesT", bound=tuple[Tensor | None, ...])


def unaliased(items: Sequence[tuple[_LayerT, _SourcesT]]) -> list[tuple[_LayerT, _SourcesT]]:
    """``items`` (each a layer and the gradient tensors its ``P`` is computed from) with every
    tensor that shares memory with an earlier layer's ``.grad`` replaced by a copy, before any
    layer writes its ``.grad``: with a weight tied between layers, each layer's ``P`` then
    comes from the raw gradient (the last layer written sets the shared ``.grad``), not from
    what an earlier layer wrote there in place."""
    written: set[int] = set()
    out: list[tuple[_LayerT, _SourcesT]] = []
    for layer, sources in items:
        copied = tuple(t.clone() if t is not None and t.data_ptr() in written else t
                       for t in sources)
        out.append((layer, cast(_SourcesT, copied)))  # entry by entry a tensor's copy or itself
        written.update(t.data_ptr() for t in layer.helper.grad_tensors())
    return out


def half_overflows(layers: Sequence[_LayerT]) -> list[_LayerT]:
    """Those of ``layers`` with float16 weights whose written ``.grad`` left float16's range.

    A ``P`` finite in the preconditioner's wider dtype rounds to infinities above 65,504 when
    it is written into a float16 gradient, which the optimizer would then apply. One fp32
    summation per such layer decides (a sum is finite exactly when its terms are) and one
    transfer reads them all; models without float16 parameters cost nothing.
    """
    half = [layer for layer in layers if layer.helper.weight.dtype == torch.float16]
    if not half:
        return []
    # every layer here has a written gradient, so each sum is of at least one tensor
    sums = torch.stack([cast(Tensor, sum(t.sum(dtype=torch.float32)
                                         for t in layer.helper.grad_tensors()))
                        for layer in half])
    return [layer for layer, ok in zip(half, sums.isfinite().tolist(), strict=True) if not ok]


HALF_OVERFLOW_FIX = ("raise the damping, or keep the parameters in fp32 (AMP autocast with "
                     "fp32 weights)")
"""What a warning about :func:`half_overflows` tells the user to do."""


def finite_gradients(layers: Sequence[PreconditionedLayer],
                     settle: Callable[[], None] | None = None, *, parts: bool = False,
                     squared_norms: dict[str, Tensor] | None = None
                     ) -> dict[str, Any] | None:
    """The step's gradients by layer name (None where a layer has no gradient): the matrices
    ``∇W̄`` (:meth:`~core.layers.LayerHelper.grad_matrix`), or with ``parts`` the pairs
    ``(∇W, ∇b)`` (:meth:`~core.layers.LayerHelper.grad_parts`: views of ``.grad``, no copy).

    None instead when any entry is not finite (an AMP overflow, or a diverged step); every
    layer's captures of the step are then discarded, so the statistics stay clean and the
    caller leaves the gradients raw. ``settle`` runs first: it completes what was already
    started with them (collectives begun in the backward pass). Given a ``squared_norms``
    dict, each layer's ``‖∇W̄‖²`` is put in it and serves as the finiteness check's reduction
    (the pass over the gradients that the check takes anyway).
    """
    helpers = {layer.name: layer.helper for layer in layers}
    grads: dict[str, Any] = {name: helper.grad_parts() if parts else helper.grad_matrix()
                             for name, helper in helpers.items()}
    tensors = {name: [t for t in (entry if parts else (entry,)) if t is not None]
               for name, entry in grads.items() if entry is not None}
    reductions = None
    if squared_norms is not None:
        for name, present in tensors.items():
            squared_norms[name] = sum_of_squares(present)
        reductions = list(squared_norms.values())
    if all_finite([t for present in tensors.values() for t in present], reductions):
        return grads
    if settle is not None:
        settle()
    for layer in layers:
        layer.discard_pending()
    return None


def refuse_several_devices(method: str, layers: Sequence[PreconditionedLayer]) -> None:
    """Refuse layers on more than one device: every method reduces over all layers' tensors
    at once (the step's finiteness check; MKOR's and Eva's statistics are one vector), which
    PyTorch does on one device only.

    Raises:
        ValueError: naming each device with its first layer, and the fixes.
    """
    first: dict[str, str] = {}
    for layer in layers:
        first.setdefault(str(layer.device), layer.name)
    if len(first) > 1:
        found = ", ".join(f"{device} ({name}, ...)" for device, name in first.items())
        raise ValueError(f"{method} reduces over every layer's tensors at once, so its layers "
                         f"must be on one device; found {found}: keep the model on one device "
                         "per process (DistributedDataParallel for several), or skip_layers "
                         "the layers on the others")


def check_saved_layers(layers: Sequence[PreconditionedLayer], saved: dict[str, Any]) -> None:
    """Refuse a saved per-layer state that does not name exactly these layers.

    Raises:
        ValueError: naming the layers missing from ``saved`` and the unexpected ones.
    """
    names = {layer.name for layer in layers}
    if set(saved) != names:
        missing = sorted(names - set(saved))
        extra = sorted(set(saved) - names)
        raise ValueError(f"preconditioner state does not match the model's layers "
                         f"(missing {missing}, unexpected {extra})")
