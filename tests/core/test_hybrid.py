"""MKOR-H: the loss-rate switch fires on a constructed loss curve, and not before."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core import ConfigError, HybridSwitch, KFACPreconditioner, MKORPreconditioner
from core.hybrid import HybridConfig, loss_decrease_rate

torch.set_num_threads(1)


class CountingPreconditioner:
    """A stand-in that counts its steps and records whether its hooks were removed."""

    def __init__(self) -> None:
        self.calls = 0
        self.hooks_removed = False

    def step(self) -> None:
        self.calls += 1

    def remove_hooks(self) -> None:
        self.hooks_removed = True

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]


def _curve(steps: int) -> list[float]:
    """Fast exponential decay for 60 steps, then a plateau with tiny noise."""
    fast = [2.0 * math.exp(-0.05 * t) for t in range(60)]
    return fast + [fast[-1] * (1 + 1e-4 * (-1) ** t) for t in range(steps - 60)]


def test_switches_when_the_rate_falls_below_the_threshold_and_not_before() -> None:
    window, threshold = 10, 1e-3
    losses = _curve(150)
    # The step where the rule's rate first drops below the threshold, computed independently.
    rates = {t: (sum(losses[t - 2 * window:t - window]) - sum(losses[t - window:t]))
             / (window * sum(losses[t - 2 * window:t - window]))
             for t in range(2 * window, 151)}
    expected = min(t for t, r in rates.items() if r < threshold)
    assert 60 < expected < 80

    inner = CountingPreconditioner()
    switch = HybridSwitch(inner, window=window, threshold=threshold, min_steps=0)
    for t, loss in enumerate(losses, start=1):
        switch.observe(loss)
        switch.step()
        assert switch.switched == (t >= expected)
    assert inner.calls == expected - 1  # the step that completed the evidence is first-order
    assert inner.hooks_removed
    event = switch.event
    assert event is not None and event.step == expected
    assert event.rate == pytest.approx(rates[expected]) and event.rate < threshold
    assert event.mean_before == pytest.approx(sum(losses[expected - 20:expected - 10]) / 10)


def test_min_steps_and_the_evidence_window_delay_the_switch() -> None:
    flat = [1.0] * 100
    for min_steps, expected in ((0, 20), (35, 35)):
        switch = HybridSwitch(CountingPreconditioner(), window=10, threshold=1e-3,
                              min_steps=min_steps)
        for loss in flat:
            switch.observe(loss)
        assert switch.event is not None and switch.event.step == expected
    never = HybridSwitch(CountingPreconditioner(), window=5, threshold=-math.inf)
    for loss in flat:
        never.observe(loss)
    assert not never.switched


def test_switch_is_logged_with_its_evidence(caplog: pytest.LogCaptureFixture) -> None:
    switch = HybridSwitch(CountingPreconditioner(), window=2, threshold=0.01, min_steps=0)
    with caplog.at_level(logging.INFO, logger="core.hybrid"):
        for loss in (1.0, 1.0, 1.0, 0.98):
            switch.observe(loss)
    assert "switching to first-order after step 4" in caplog.text
    assert "0.005 < threshold 0.01" in caplog.text
    assert "mean loss 1 -> 0.99" in caplog.text


def test_non_finite_losses_are_not_evidence() -> None:
    switch = HybridSwitch(CountingPreconditioner(), window=2, threshold=0.5, min_steps=0)
    for loss in (1.0, float("nan"), 0.5, float("inf"), 0.25):
        switch.observe(loss)
    assert not switch.switched and switch.steps == 5
    assert loss_decrease_rate([1.0, 0.5, 0.25, 0.125], 2) == pytest.approx(0.375)


def test_a_negative_loss_that_falls_has_a_positive_rate() -> None:
    """The rate divides by ``|m_before|``: a loss going from −1 to −2 is decreasing."""
    assert loss_decrease_rate([-1.0, -1.0, -2.0, -2.0], 2) == pytest.approx(0.5)


def test_a_rate_equal_to_the_threshold_does_not_switch() -> None:
    """The rule is ``rate < threshold``: a flat loss (rate 0) with threshold 0 never switches."""
    switch = HybridSwitch(CountingPreconditioner(), window=2, threshold=0.0, min_steps=0)
    for _ in range(6):
        switch.observe(1.0)
        switch.step()
    assert not switch.switched


def test_state_dict_resumes_switched_and_unswitched() -> None:
    losses = _curve(120)
    first = HybridSwitch(CountingPreconditioner(), window=10, threshold=1e-3, min_steps=0)
    for loss in losses[:50]:
        first.observe(loss)
    resumed = HybridSwitch(CountingPreconditioner(), window=10, threshold=1e-3, min_steps=0)
    resumed.load_state_dict(first.state_dict())
    for loss in losses[50:]:
        first.observe(loss)
        resumed.observe(loss)
    assert first.event == resumed.event and first.event is not None
    again = HybridSwitch(CountingPreconditioner(), window=10, threshold=1e-3)
    again.load_state_dict(first.state_dict())
    assert again.switched and again.preconditioner.hooks_removed


REAL = [lambda m: MKORPreconditioner(m, inv_update_steps=1), lambda m: KFACPreconditioner(m)]


def wrapped_step(model: nn.Module, switch: HybridSwitch) -> bool:
    """One training step of ``model`` through ``switch``; whether it preconditioned."""
    model.zero_grad()
    loss = F.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 2))
    loss.backward()
    raw = model.weight.grad.clone()
    switch.observe(loss.item())
    switch.step()
    return not torch.equal(model.weight.grad, raw)


@pytest.mark.parametrize("make", REAL)
def test_wraps_real_preconditioners(make: Any) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    switch = HybridSwitch(make(model), window=1, threshold=math.inf, min_steps=2)
    # switched at the second observed loss
    assert [wrapped_step(model, switch) for _ in range(3)] == [True, False, False]


@pytest.mark.parametrize("make", REAL)
def test_rolling_back_to_before_the_switch_runs_second_order_again(make: Any) -> None:
    """Loading a state saved before the switch into a switched instance (an in-memory
    rollback) un-switches it and attaches the preconditioner's hooks again."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    switch = HybridSwitch(make(model), window=1, threshold=math.inf, min_steps=2)

    def step() -> bool:
        return wrapped_step(model, switch)

    assert step()
    saved = switch.state_dict()
    assert not step() and switch.switched
    switch.load_state_dict(saved)
    assert not switch.switched
    assert not step() and switch.switched  # the rule fires again on the next loss
    switch.load_state_dict(saved)
    switch.config = type(switch.config)(window=1, threshold=-math.inf)  # never switch now
    assert step() and step()


@pytest.mark.parametrize("make", REAL)
def test_the_switching_steps_captures_are_dropped_and_a_rollback_starts_clean(make: Any) -> None:
    """The step whose loss fires the switch captured statistics its ``step()`` never
    consumes: they were kept, and after a rollback summed into the next update. Now they are
    dropped at the switch, and a rollback continues exactly as the saved state loaded into a
    fresh instance does."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    switch = HybridSwitch(make(model), window=1, threshold=math.inf, min_steps=2)
    assert wrapped_step(model, switch)
    saved = switch.state_dict()
    assert not wrapped_step(model, switch) and switch.switched
    assert switch.preconditioner.memory_usage()["buffers"] == 0
    switch.load_state_dict(saved)
    switch.config = HybridConfig(window=1, threshold=-math.inf)

    fresh_model = nn.Linear(3, 2)
    fresh_model.load_state_dict(model.state_dict())
    fresh = HybridSwitch(make(fresh_model), window=1, threshold=-math.inf)
    fresh.load_state_dict(saved)
    for net, wrapper in ((model, switch), (fresh_model, fresh)):
        torch.manual_seed(1)
        assert wrapped_step(net, wrapper)
    torch.testing.assert_close(model.weight.grad, fresh_model.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize(("options", "field"), [
    ({"window": 0}, "window"),
    ({"threshold": float("nan")}, "threshold"),
    ({"min_steps": -1}, "min_steps"),
    ({"patience": 3}, "patience"),
])
def test_config_errors_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        HybridSwitch(CountingPreconditioner(), **options)
    assert err.value.field_name == field


def test_the_loss_average_over_a_simulated_world_is_the_value() -> None:
    """A simulated communicator (the measurement code's) moves nothing; the average asked the
    default process group for its backend, which does not exist there, and raised."""
    from core.distributed import Communicator
    from core.hybrid import mean_over_ranks

    assert mean_over_ranks(2.5, Communicator.simulated(0, 4)) == 2.5
