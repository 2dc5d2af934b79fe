"""Per-stage wall-clock timing of the preconditioner step."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

STAGES = (
    "capture",          # factor rows from captured tensors (MKOR, Eva: statistics, in the hooks)
    "factors",          # batch factors from the rows, and running averages
    "factor_comm",      # reduce / reduce-scatter of factors
    "inversion",        # decompositions
    "inverse_comm",     # broadcast of inverses or eigenbases
    "precondition",     # the preconditioning products
    "grad_comm",        # broadcast / all-gather of preconditioned gradients
    "scale",            # KL clip (or rescale) and write-back into .grad
)


class StageTimer:
    """Accumulates seconds per stage; synchronises CUDA so GPU work is attributed correctly.

    Args:
        synchronize_cuda: Synchronise CUDA at each stage boundary.
        clock: Seconds now; wall clock by default. A benchmark on a shared CPU may pass
            ``time.process_time``, which does not count time slices other processes take.

    Attributes:
        totals: Seconds per stage since construction (or :meth:`reset`).
        last: Seconds per stage of the last completed step.
    """

    def __init__(self, synchronize_cuda: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.synchronize_cuda = synchronize_cuda
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self.current: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block as part of ``name``."""
        if self.synchronize_cuda:
            torch.cuda.synchronize()
        start = self.clock()
        try:
            yield
        finally:
            if self.synchronize_cuda:
                torch.cuda.synchronize()
            elapsed = self.clock() - start
            self.current[name] += elapsed
            self.totals[name] += elapsed

    def end_step(self) -> None:
        """Close the current step: its per-stage times become :attr:`last`."""
        self.last = {name: self.current.get(name, 0.0) for name in STAGES}
        self.current = defaultdict(float)

    def reset(self) -> None:
        self.totals = defaultdict(float)
        self.current = defaultdict(float)
        self.last = {}
