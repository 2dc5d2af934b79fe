"""Per-stage timing of the preconditioner step: host clock, or device events on a GPU."""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ParamSpec, Protocol, TypeVar

import torch

STAGES = (
    "capture",          # factor rows from captured tensors (MKOR, Eva: statistics, in the hooks)
    "factors",          # batch factors from the rows, and running averages
    "factor_comm",      # reduce / reduce-scatter of factors
    "inversion",        # decompositions
    "inverse_comm",     # broadcast of inverses or eigenbases
    "precondition",     # the preconditioning products
    "grad_comm",        # broadcast / all-gather of preconditioned gradients
    "scale",            # K-FAC's KL clip and write-back into .grad
)


#: Prefix of the names this library gives its ranges in ``torch.profiler`` traces: a stage is
#: ``core.stage.<name>``, a traced call ``core.<name>`` (:func:`traced`).
TRACE_PREFIX = "core."
STAGE_TRACE_PREFIX = TRACE_PREFIX + "stage."

_P = ParamSpec("_P")
_R = TypeVar("_R")


def trace_range(name: str) -> AbstractContextManager[Any]:
    """A ``torch.profiler`` range named ``name`` while a profiler runs, else nothing.

    Outside a profile the check costs tens of nanoseconds, where an unconditional
    ``record_function`` costs microseconds: the small BERT's update makes hundreds of these
    calls.
    """
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


def traced(name: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Name the decorated function's calls ``core.<name>`` in ``torch.profiler`` traces.

    Kernels called outside PyTorch (BLAS and LAPACK through ``ctypes`` or SciPy, NumPy copies)
    are otherwise invisible in a trace, and a pass such as a finiteness check is a handful of
    anonymous ATen ops; ``scripts/stage_split.py`` splits each stage's time by these names.
    """

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with trace_range(TRACE_PREFIX + name):
                return fn(*args, **kwargs)

        return call

    return decorate


class DeviceEvent(Protocol):
    """What :class:`StageTimer` needs of a timing event (``torch.cuda.Event`` has it)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


def cuda_timing_event() -> DeviceEvent:
    return torch.cuda.Event(enable_timing=True)


#: Closed steps whose device events may stay unread; older ones are read, waiting if need be,
#: so a run that never reads its times holds a bounded number of events.
MAX_UNREAD_STEPS = 2


class StageTimer:
    """Accumulates seconds per stage, on the host clock or, on a GPU, by device events.

    With ``device_events`` each stage is bracketed by two events recorded on the current
    stream, and nothing waits for the device while a step runs: a step's times are read once
    its events have completed (at the end of a later step, without waiting, or when
    :attr:`last` or :attr:`totals` is read, waiting for that step's last event). Synchronising
    the device at every stage boundary instead would stall the host's kernel launches for the
    next stage and wait for collectives left running in the background.

    Args:
        device_events: Time stages by device events (on a GPU) instead of the host clock; or
            a callable saying so, asked at each step's first stage (a preconditioner asks
            where its layers are, so a model moved to a GPU after it was built is timed
            there).
        clock: Host seconds now; wall clock by default. A benchmark on a shared CPU may pass
            ``time.process_time``, which does not count time slices other processes take.
        event_factory: Makes one timing event (a CUDA event by default; tests pass fakes).

    Attributes:
        totals: Seconds per stage since construction (or :meth:`reset`).
        last: Seconds per stage of the last completed step.
    """

    def __init__(self, device_events: bool | Callable[[], bool] = False,
                 clock: Callable[[], float] = time.perf_counter,
                 event_factory: Callable[[], DeviceEvent] = cuda_timing_event) -> None:
        self._events_rule = device_events
        self._step_events: bool | None = None
        self.clock = clock
        self.event_factory = event_factory
        self._totals: dict[str, float] = defaultdict(float)
        self._last: dict[str, float] = {}
        self.current: dict[str, float] = defaultdict(float)
        self._open: list[tuple[str, DeviceEvent, DeviceEvent]] = []
        self._unread: list[list[tuple[str, DeviceEvent, DeviceEvent]]] = []

    @property
    def device_events(self) -> bool:
        """Whether the current step's stages are timed by device events."""
        if self._step_events is None:
            rule = self._events_rule
            self._step_events = rule() if callable(rule) else rule
        return self._step_events

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block as part of ``name`` (a ``core.stage.<name>`` range in a
        ``torch.profiler`` trace)."""
        with trace_range(STAGE_TRACE_PREFIX + name):
            if self.device_events:
                start = self.event_factory()
                start.record()
                try:
                    yield
                finally:
                    end = self.event_factory()
                    end.record()
                    self._open.append((name, start, end))
                return
            begin = self.clock()
            try:
                yield
            finally:
                elapsed = self.clock() - begin
                self.current[name] += elapsed
                self._totals[name] += elapsed

    def end_step(self) -> None:
        """Close the current step: its per-stage times become :attr:`last` (with device
        events, once they are read)."""
        events, self._step_events = self.device_events, None  # the next step decides anew
        if not events:
            while self._unread:  # device-timed steps before it (the model since moved)
                self._read_oldest()
            self._last = {name: self.current.get(name, 0.0) for name in STAGES}
            self.current = defaultdict(float)
            return
        self._unread.append(self._open)
        self._open = []
        while self._unread and (len(self._unread) > MAX_UNREAD_STEPS
                                or all(end.query() for _, _, end in self._unread[0])):
            self._read_oldest()

    def _read_oldest(self) -> None:
        """Fold the oldest unread step's event times into :attr:`last` and :attr:`totals`."""
        seconds: dict[str, float] = defaultdict(float)
        for name, start, end in self._unread.pop(0):
            end.synchronize()
            seconds[name] += start.elapsed_time(end) / 1e3
        for name, value in seconds.items():
            self._totals[name] += value
        self._last = {name: seconds.get(name, 0.0) for name in STAGES}

    @property
    def last(self) -> dict[str, float]:
        while self._unread:
            self._read_oldest()
        return self._last

    @property
    def totals(self) -> dict[str, float]:
        while self._unread:
            self._read_oldest()
        return self._totals

    def reset(self) -> None:
        self._totals = defaultdict(float)
        self.current = defaultdict(float)
        self._last = {}
        self._open, self._unread = [], []
