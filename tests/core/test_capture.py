"""The capture hooks on their own: what reaches the callbacks, and when."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.capture import CaptureHooks, HookSet


def test_what_on_forward_keeps_reaches_on_input_with_the_gradient_and_only_then() -> None:
    """``on_forward`` runs at the call and what it returns is held, in place of the input,
    until the call's output gradient arrives; then ``on_input`` gets it, just before
    ``on_grad_output``. A call whose output reaches no backward pass delivers nothing."""
    layer = nn.Linear(3, 2)
    events: list[tuple[str, object]] = []
    CaptureHooks(layer, on_input=lambda kept: events.append(("input", kept)),
                 on_grad_output=lambda gy: events.append(("grad", tuple(gy.shape))),
                 on_forward=lambda x: events.append(("forward", tuple(x.shape))) or "mean row")
    layer(torch.randn(5, 3))  # never backpropagated
    assert events == [("forward", (5, 3))]
    layer(torch.randn(4, 3)).sum().backward()
    assert events[1:] == [("forward", (4, 3)), ("input", "mean row"), ("grad", (4, 2))]


def test_a_recomputed_checkpoint_segment_is_captured_once() -> None:
    """Non-reentrant activation checkpointing runs a segment's forward again in the backward
    pass, hooks included; only the first run's outputs receive gradients, so each call is
    captured once, with the input of the run that was trained on."""
    layer = nn.Linear(3, 2)
    inputs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    CaptureHooks(layer, on_input=inputs.append, on_grad_output=grads.append)
    x = torch.randn(4, 3, requires_grad=True)
    F.mse_loss(checkpoint(layer, x, use_reentrant=False), torch.zeros(4, 2)).backward()
    assert len(inputs) == len(grads) == 1
    torch.testing.assert_close(inputs[0], x.detach())


def test_a_hook_set_detaches_and_attaches_once() -> None:
    layer = nn.Linear(3, 2)
    calls: list[int] = []
    hooks = HookSet(lambda: [CaptureHooks(layer, on_input=lambda _: calls.append(1),
                                          on_grad_output=lambda _: None)])
    hooks.remove()
    layer(torch.randn(2, 3)).sum().backward()
    hooks.add()
    hooks.add()
    layer(torch.randn(2, 3)).sum().backward()
    assert calls == [1]
