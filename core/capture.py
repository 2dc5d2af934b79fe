"""Curvature capture: a forward hook on the module and a hook on its output tensor.

The output-tensor hook (rather than ``register_full_backward_hook``) keeps working when an
in-place op (``ReLU(inplace=True)``) rewrites the output: a tensor hook registered before the
in-place op receives the gradient with respect to the layer's own output. A module called several
times in one forward pass gets one input and one gradient callback per call; the callbacks
accumulate, so such a module is supported (its factors average over the calls). A second
gradient for the same call (a second backward pass over one forward pass, or
``torch.autograd.grad`` before ``backward``) is passed on too, with a warning: the statistics
take it as another call's, not as part of the one gradient the optimizer applies. A call's
input is delivered when its output's gradient arrives, so a forward pass whose output never
reaches a backward pass adds nothing to the statistics; nor does one run while its hooks are
paused (:meth:`HookSet.paused`), whose gradients (an adversarial example's, an input-gradient
penalty's on a forward pass of its own) the optimizer never applies.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


class CaptureHooks:
    """Hooks that forward a module's inputs and output gradients to callbacks.

    Capture happens only when ``enabled()`` is true, the hooks are not :attr:`paused`, the
    module is in training mode and autograd is recording, so evaluation passes never touch the
    curvature statistics.

    Args:
        module: The layer to watch.
        on_input: Called for each forward call whose output receives a gradient, when that
            gradient arrives, just before ``on_grad_output``, with what ``on_forward`` kept of
            the call's input (the detached input itself without ``on_forward``): a call whose
            output never reaches a backward pass (a loss computed and not backpropagated) adds
            nothing to the statistics. The hook on the call's output holds it until then.
        on_grad_output: Called with the (detached) gradient of each call's output.
        enabled: Whether to capture the current forward/backward pass.
        on_pair: Instead of ``on_input`` and ``on_grad_output``: called with each call's input
            and its output's gradient together, for statistics that need the two of one call
            (BatchNorm's normalised input times its gradient).
        name: The layer's name in the model, for warnings (default: its type's).
        on_forward: Called at the forward call itself with the (detached) input (its first
            positional argument, or its ``input`` keyword argument) of each call whose output
            requires a gradient; returns what ``on_input`` is given once the gradient arrives.
            It refuses an input where the user's code made it, counts the calls whose
            gradients a backward pass will bring, and may keep less than the input (a mean
            row, where holding the input until the backward pass would defeat activation
            checkpointing).
    """

    #: While true, forward calls are not captured (nor, later, their outputs' gradients).
    paused: bool = False

    def __init__(
        self,
        module: nn.Module,
        on_input: Callable[[Tensor], None] | None = None,
        on_grad_output: Callable[[Tensor], None] | None = None,
        enabled: Callable[[], bool] = lambda: True,
        on_pair: Callable[[Tensor, Tensor], None] | None = None,
        name: str = "",
        on_forward: Callable[[Tensor], Any] | None = None,
    ) -> None:
        separate = on_input is not None and on_grad_output is not None
        paired = on_pair is not None and on_input is None and on_grad_output is None
        if separate == paired:
            raise ValueError("give on_input and on_grad_output, or on_pair alone")
        self._on_input = on_input
        self._on_grad_output = on_grad_output
        self._on_pair = on_pair
        self._on_forward = on_forward
        self._enabled = enabled
        self._name = name or type(module).__name__
        self._handle: RemovableHandle = module.register_forward_hook(self._forward_hook,
                                                                     with_kwargs=True)

    def _forward_hook(self, module: nn.Module, inputs: tuple[Tensor, ...],
                      kwargs: dict[str, Any], output: Tensor) -> None:
        if self.paused or not (module.training and torch.is_grad_enabled() and self._enabled()):
            return
        if not isinstance(output, Tensor):
            raise TypeError(
                f"{type(module).__name__} returned {type(output).__name__}; curvature capture "
                "needs a single output tensor (skip this layer with skip_layers)"
            )
        x = inputs[0] if inputs else kwargs.get("input")
        if not isinstance(x, Tensor):
            raise TypeError(f"{type(module).__name__} was called without its input as the first "
                            "positional or the `input` keyword argument; call it with the input "
                            "first, or skip this layer with skip_layers")
        if not output.requires_grad or x.numel() == 0:  # an empty batch holds no curvature
            return
        x = x.detach()
        kept = x if self._on_forward is None else self._on_forward(x)
        received = False

        def grad_hook(grad: Tensor) -> None:
            nonlocal received
            first, received = not received, True
            if not first:
                self._warn_second_gradient()
            if self._on_pair is not None:
                self._on_pair(x, grad.detach())
                return
            assert self._on_input is not None and self._on_grad_output is not None
            if first:
                self._on_input(kept)
            self._on_grad_output(grad.detach())

        output.register_hook(grad_hook)

    def _warn_second_gradient(self) -> None:
        warnings.warn(
            f"{self._name}: a second gradient reached the output of one forward call "
            "(backward(retain_graph=True) called again, or torch.autograd.grad through it "
            "before backward); the curvature takes each gradient as a call of its own, not "
            "their sum, so it does not describe the gradient the optimizer applies: sum the "
            "losses and call backward once per forward pass, and take other gradients on a "
            "forward pass of their own inside the preconditioner's no_capture()", stacklevel=2)

    def remove(self) -> None:
        """Detach the hooks from the module."""
        self._handle.remove()


class HookSet:
    """The capture hooks of a preconditioner's layers, which can be detached and attached
    again: MKOR-H detaches its second-order preconditioner while it runs first order, and a
    user may detach one to run the model untouched.

    Args:
        attach: Registers the hooks on every layer and returns them; called now, and again by
            :meth:`add` after :meth:`remove`.
    """

    def __init__(self, attach: Callable[[], list[CaptureHooks]]) -> None:
        self._attach = attach
        self._paused = False
        self._compiled_when_removed = 0
        if _frames_compiled():  # perhaps this model, without the hooks
            _let_compiled_graphs_see_new_hooks()
        self._hooks = attach()

    def remove(self) -> None:
        """Detach every hook from its module."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._compiled_when_removed = _frames_compiled()

    def add(self) -> None:
        """Attach the hooks again (nothing if they are attached)."""
        if not self._hooks:
            compiled = _frames_compiled()
            if compiled and compiled != self._compiled_when_removed:  # compiled without them
                _let_compiled_graphs_see_new_hooks()
            self._hooks = self._attach()
            self._pause(self._paused)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Capture nothing from the forward passes run inside: their outputs' gradients,
        whenever they are taken, stay out of the statistics. Forward passes run before keep
        theirs, even if their backward pass runs inside. A segment under reentrant activation
        checkpointing runs its forward again in the backward pass, which is captured unless
        that backward pass runs inside too."""
        before = self._paused
        self._pause(True)
        try:
            yield
        finally:
            self._pause(before)

    def _pause(self, paused: bool) -> None:
        self._paused = paused
        for hook in self._hooks:
            hook.paused = paused


def _frames_compiled() -> int:
    """Frames ``torch.compile`` has compiled since its caches were last cleared (dynamo's
    ``reset`` sets its counter to zero); 0 where dynamo was never imported."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    return int(getattr(convert_frame, "FRAME_COUNTER", 0)) if convert_frame else 0


def _let_compiled_graphs_see_new_hooks() -> None:
    """Clear ``torch.compile``'s caches, so that hooks about to be attached are traced into
    the next compiled call; the caller has found that code may have been compiled without
    them.

    Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``,
    on by default): a graph compiled before a hook was attached runs on without it, so a model
    compiled and called once before its preconditioner was built (a first-order warm-up step)
    would capture nothing and train first order for good. Which model a compiled frame belongs
    to is not known here, so anything compiled counts; clearing the caches costs a
    recompilation of every compiled function of the process, hence the warning.
    """
    if not torch._dynamo.config.skip_nnmodule_hook_guards:
        return
    torch.compiler.reset()
    warnings.warn("capture hooks attached after torch.compile had compiled code, which does "
                  "not see hooks added later: its caches were cleared (torch.compiler.reset()) "
                  "and the next compiled call compiles again with the hooks in; build the "
                  "preconditioner (or call add_hooks) before the first compiled call to avoid "
                  "the recompilation", stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the innermost frame outside this package, so that a warning
    points at the user's line however many of the package's frames lie between."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
