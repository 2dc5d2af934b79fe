"""The stage timer: host-clock stages, and device-event stages that never wait for the device
while a step runs (fake events stand in for CUDA's)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from core.timing import MAX_UNREAD_STEPS, STAGES, StageTimer, trace_range, traced


class FakeClock:
    """A device clock the test advances by hand, in milliseconds."""

    def __init__(self) -> None:
        self.ms = 0.0


class FakeEvent:
    """Records the fake device time; completes when the test says the device got there."""

    def __init__(self, clock: FakeClock, log: list[str]) -> None:
        self.clock, self.log = clock, log
        self.at: float | None = None
        self.done = False

    def record(self) -> None:
        self.at = self.clock.ms

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log.append("wait")
        self.done = True

    def elapsed_time(self, end: Any) -> float:
        assert self.at is not None and end.at is not None and end.done
        return end.at - self.at


def _event_timer() -> tuple[StageTimer, FakeClock, list[FakeEvent], list[str]]:
    clock, events, log = FakeClock(), [], []

    def make() -> FakeEvent:
        events.append(FakeEvent(clock, log))
        return events[-1]

    return StageTimer(device_events=True, event_factory=make), clock, events, log


def _step(timer: StageTimer, clock: FakeClock, ms: dict[str, float]) -> None:
    for name, duration in ms.items():
        with timer.stage(name):
            clock.ms += duration
    timer.end_step()


def test_host_clock_stages_per_step_and_in_total() -> None:
    now = [0.0]
    timer = StageTimer(clock=lambda: now[0])
    for seconds in (1.0, 3.0):
        with timer.stage("factors"):
            now[0] += seconds
        with timer.stage("precondition"):
            now[0] += 0.5
        timer.end_step()
    assert timer.last["factors"] == 3.0 and timer.last["precondition"] == 0.5
    assert set(timer.last) == set(STAGES) and timer.last["inversion"] == 0.0
    assert timer.totals["factors"] == 4.0 and timer.totals["precondition"] == 1.0


def test_device_events_do_not_wait_while_steps_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_device_sync() -> None:
        raise AssertionError("the timer synchronised the device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    timer, clock, events, log = _event_timer()
    _step(timer, clock, {"factors": 4.0, "precondition": 2.0})
    _step(timer, clock, {"factors": 1.0, "precondition": 3.0, "factors_again": 0.0})
    assert log == [], "no step's events were waited for while steps ran"
    assert len(events) == 2 * 5
    # reading the times waits for each unread step, oldest first
    assert timer.last["factors"] == pytest.approx(1e-3) and timer.last["precondition"] == 3e-3
    assert timer.totals["factors"] == pytest.approx(5e-3)
    assert timer.totals["precondition"] == pytest.approx(5e-3)
    assert log.count("wait") == 5


def test_device_events_completed_by_the_next_step_are_read_without_waiting() -> None:
    timer, clock, events, log = _event_timer()
    _step(timer, clock, {"inversion": 7.0})
    for event in events:  # the device finished the first step
        event.done = True
    _step(timer, clock, {"inversion": 1.0})
    assert log == [], "the first step was read at the end of the second, without waiting"
    assert timer.totals["inversion"] == pytest.approx(8e-3)
    assert log == ["wait"]  # for the second step, when its times were asked for


def test_unread_device_steps_are_bounded() -> None:
    """A run that never reads its times keeps at most MAX_UNREAD_STEPS steps of events: the
    oldest is read (waiting for it) when one more closes."""
    timer, clock, _, log = _event_timer()
    for _ in range(MAX_UNREAD_STEPS + 3):
        _step(timer, clock, {"scale": 1.0})
    assert log == ["wait"] * 3  # one stage in each of the three oldest steps
    assert timer.totals["scale"] == pytest.approx((MAX_UNREAD_STEPS + 3) * 1e-3)


@traced("double")
def _double(x: torch.Tensor, *, times: int = 2) -> torch.Tensor:
    """Doubles."""
    return x * times


def test_traced_calls_and_stages_are_named_in_a_profile_and_cost_nothing_outside_one() -> None:
    x = torch.ones(3)
    assert isinstance(trace_range("core.double"), type(contextlib.nullcontext()))
    assert torch.equal(_double(x, times=3), 3 * x) and _double.__doc__ == "Doubles."
    timer = StageTimer()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with timer.stage("factors"):
            _double(x)
    names = [e.name for e in profile.events()]
    assert "core.stage.factors" in names and "core.double" in names
    (double,) = [e for e in profile.events() if e.name == "core.double"]
    assert double.cpu_parent is not None and double.cpu_parent.name == "core.stage.factors"
    assert timer.current["factors"] > 0


def test_a_timer_asked_where_to_time_decides_at_each_steps_first_stage() -> None:
    """A model moved to a GPU after its preconditioner was built was timed by the host clock
    (launch times of asynchronous work), decided once when the timer was made. A callable rule
    is asked at each step's first stage: the step after the move is timed by device events."""
    clock, events, log = FakeClock(), [], []
    on_gpu = [False]
    now = [0.0]

    def make() -> FakeEvent:
        events.append(FakeEvent(clock, log))
        return events[-1]

    timer = StageTimer(device_events=lambda: on_gpu[0], clock=lambda: now[0],
                       event_factory=make)
    with timer.stage("factors"):
        now[0] += 2.0
        on_gpu[0] = True  # moved within the step: the step keeps its decision
    with timer.stage("precondition"):
        now[0] += 1.0
    timer.end_step()
    assert events == [] and timer.last["factors"] == 2.0 and timer.last["precondition"] == 1.0
    _step(timer, clock, {"factors": 4.0})
    assert len(events) == 2  # timed on the device, not read yet
    on_gpu[0] = False  # and back: the device step still in flight is read first, not last
    with timer.stage("precondition"):
        now[0] += 5.0
    timer.end_step()
    assert timer.last["precondition"] == 5.0 and timer.last["factors"] == 0.0
    assert timer.totals["factors"] == pytest.approx(2.0 + 4e-3)
