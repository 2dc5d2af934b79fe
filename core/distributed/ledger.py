"""The communication ledger: every collective a rank takes part in, as data.

Per-worker volumes in the papers' tables are read from here, so they are measured by the code
path that runs (really, or against a recording transport in :mod:`core.distributed.simulate`),
not by a separate formula.

Each entry records the *payload* of one collective as this rank sees it (``elements`` and
``bytes`` on the wire, after packing and dtype conversion) and its ``traffic_bytes``: this
rank's share of the bytes on the wire under the bandwidth-optimal algorithm for the operation,
which is what per-worker volume tables report (a ring moves whole elements, so the
all-reduce's share is rounded down to whole elements before it is counted in bytes):

==================  ==========================================================================
op                  ``traffic_bytes`` (``n`` = payload bytes, ``p`` = group size)
==================  ==========================================================================
``all_reduce``      ``2(p − 1)/p · n`` received (ring: reduce-scatter, then all-gather)
``broadcast``       ``n`` received by each non-root, ``0`` for the root
``all_gather``      ``n − own segment`` received (``n`` is the whole output; may be uneven)
``reduce_scatter``  ``n − own segment`` sent (``n`` is the whole input; the time-reverse of
                    an all-gather)
==================  ==========================================================================

Averaged over the ranks, broadcast, all-gather and reduce-scatter each come to
``(p − 1)/p · n`` per worker, the convention of KFAC_MATH.md and PAPERS.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

OPS = ("all_reduce", "broadcast", "reduce_scatter", "all_gather")

DEFAULT_KEPT_STEPS = 100
"""Steps whose entries a :class:`Ledger` keeps by default; older ones are kept as totals."""


@dataclass(frozen=True)
class LedgerEntry:
    """One collective as seen by one rank.

    Attributes:
        step: Preconditioner step the collective belongs to.
        stage: Pipeline stage (``factor_comm``, ``inverse_comm``, ``grad_comm``,
            ``grad_allreduce``, or a caller's own name).
        op: One of :data:`OPS`.
        dtype: Wire dtype name, e.g. ``"float32"``.
        elements: Payload elements on the wire.
        bytes: Payload bytes on the wire.
        group_size: Ranks taking part.
        traffic_bytes: This rank's per-worker volume (see the module docstring).
    """

    step: int
    stage: str
    op: str
    dtype: str
    elements: int
    bytes: int
    group_size: int
    traffic_bytes: int

    def as_tuple(self) -> tuple[int | str, ...]:
        """The entry as a plain tuple (for comparing ledgers across processes)."""
        return astuple(self)


@dataclass
class StageTotals:
    """Sums over the collectives of one stage."""

    collectives: int = 0
    elements: int = 0
    bytes: int = 0
    traffic_bytes: int = 0

    def add(self, entry: LedgerEntry) -> None:
        """Count one collective."""
        self.merge(StageTotals(1, entry.elements, entry.bytes, entry.traffic_bytes))

    def merge(self, other: StageTotals) -> None:
        """Add another stage's totals."""
        self.collectives += other.collectives
        self.elements += other.elements
        self.bytes += other.bytes
        self.traffic_bytes += other.traffic_bytes


@dataclass
class Ledger:
    """Collectives recorded by one rank, tagged with the current preconditioner step.

    Attributes:
        rank: The rank this ledger belongs to.
        step: Step tag given to new entries (set by the strategy from the preconditioner).
        entries: The recorded entries, in issue order: those of steps within the last
            ``keep_steps`` (an entry tagged with an older step after those were folded, by
            :meth:`at_step`, stays until the next folding).
        carried: Per-stage totals of the collectives no longer in :attr:`entries`: those of
            a run before it was resumed (:meth:`load_state_dict`; a checkpoint keeps totals,
            not every entry of a long run) and those of steps older than ``keep_steps``.
            :meth:`summary` over everything includes them.
        keep_steps: Steps whose entries are kept (by step tag, counting back from the
            newest): a long run records collectives every step, and keeping them all grew
            without bound (some 18 kB per step and rank for ResNet-50 under ``comm-opt``).
            ``None`` keeps every entry (what a simulation of a few steps reads).
    """

    rank: int = 0
    step: int = 0
    entries: list[LedgerEntry] = field(default_factory=list)
    carried: dict[str, StageTotals] = field(default_factory=dict)
    keep_steps: int | None = DEFAULT_KEPT_STEPS

    def record(self, *, stage: str, op: str, dtype: str, elements: int, itemsize: int,
               group_size: int, traffic_bytes: int) -> LedgerEntry:
        """Append one collective and return its entry."""
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
        entry = LedgerEntry(self.step, stage, op, dtype, elements, elements * itemsize,
                            group_size, traffic_bytes)
        if (self.keep_steps is not None and self.entries
                and self.entries[0].step <= self.step - self.keep_steps):
            self._carry_steps_before(self.step - self.keep_steps + 1)
        self.entries.append(entry)
        return entry

    def _carry_steps_before(self, step: int) -> None:
        """Move the entries of steps before ``step`` into :attr:`carried`."""
        kept = [e for e in self.entries if e.step >= step]
        for entry in self.entries:
            if entry.step < step:
                self.carried.setdefault(entry.stage, StageTotals()).add(entry)
        self.entries[:] = kept

    @contextmanager
    def at_step(self, step: int) -> Iterator[None]:
        """Tag what is recorded inside with ``step``, then restore the tag: for a
        preconditioner that shares another's ledger and steps after it (BatchNorm's, after
        K-FAC has moved the tag to its next step)."""
        saved, self.step = self.step, step
        try:
            yield
        finally:
            self.step = saved

    def steps(self) -> list[int]:
        """Steps that have entries (within the last ``keep_steps``), ascending."""
        return sorted({e.step for e in self.entries})

    def select(self, *, step: int | None = None, stage: str | None = None,
               op: str | None = None) -> list[LedgerEntry]:
        """Entries matching every given filter (within the last ``keep_steps`` steps)."""
        return [e for e in self.entries
                if (step is None or e.step == step) and (stage is None or e.stage == stage)
                and (op is None or e.op == op)]

    def summary(self, step: int | None = None) -> dict[str, StageTotals]:
        """Totals per stage, for one step or (``step=None``) over everything recorded,
        :attr:`carried` included. A step's totals come from its entries, so they are those
        of a step within the last ``keep_steps``; an older step's are in the run's totals."""
        totals: dict[str, StageTotals] = defaultdict(StageTotals)
        if step is None:
            for stage, carried in self.carried.items():
                totals[stage].merge(carried)
        for entry in self.select(step=step):
            totals[entry.stage].add(entry)
        return dict(totals)

    def state_dict(self) -> dict[str, Any]:
        """The per-stage totals so far (:meth:`summary`), for a checkpoint."""
        return {"totals": {stage: asdict(t) for stage, t in self.summary().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a resumed run's totals: :meth:`summary` over everything adds the saved
        totals to the collectives recorded from now on (the entries recorded so far are
        dropped: they belong to the run being resumed, which the totals already count)."""
        self.entries.clear()
        self.carried = {stage: StageTotals(**t) for stage, t in state["totals"].items()}

    def format_summary(self, step: int | None = None) -> str:
        """A printable per-stage table of :meth:`summary`."""
        rows = self.summary(step)
        when = "all steps" if step is None else f"step {step}"
        lines = [f"rank {self.rank}, {when}:",
                 f"  {'stage':<16}{'collectives':>12}{'elements':>16}{'MB':>12}{'traffic MB':>12}"]
        grand = StageTotals()
        for stage, t in sorted(rows.items()):
            lines.append(f"  {stage:<16}{t.collectives:>12}{t.elements:>16,}"
                         f"{t.bytes / 1e6:>12.3f}{t.traffic_bytes / 1e6:>12.3f}")
            grand.merge(t)
        lines.append(f"  {'total':<16}{grand.collectives:>12}{grand.elements:>16,}"
                     f"{grand.bytes / 1e6:>12.3f}{grand.traffic_bytes / 1e6:>12.3f}")
        return "\n".join(lines)

    def clear(self) -> None:
        """Forget all entries (the step tag is kept)."""
        self.entries.clear()
