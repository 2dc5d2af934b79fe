"""Where each stage of a second-order update step spends its time, call by call.

``scripts/bench.py`` times each stage of the preconditioner's step as a whole and sets it
against a lower bound on the kernels it must run. This script runs the same workload and
method under ``torch.profiler`` and splits each stage's time into its parts: the ranges this
library names (``core.<name>``, :func:`core.timing.traced`: BLAS ``syrk``, LAPACK ``potrf`` and
``potri``, the mirror of a triangle, finiteness checks, damped copies, running averages, copies
into the state, bf16 rounding checks), the PyTorch ops called outside them (``aten::mm`` for
the preconditioning products, ``aten::linalg_eigh``, ...), and the Python between them::

    python -m scripts.stage_split --workload bert-small --method kfac-inverse

Every step is an update step, each from the same parameters (``bench.ParameterSnapshot``). A
part's time is the self time of the ops it contains (a range nested in another, such as the
mirror in ``potri``, is its own part). The profiler adds a few microseconds per op, so a stage
with many small ops reads somewhat slower than in the benchmark; the stage totals without the
profiler are printed beside them. It runs on the CPU: on a GPU the parts' host-side self times
would show kernel launches, not the kernels (``scripts/bench.py --device cuda`` times the
stages there by CUDA events).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent

from core.timing import STAGE_TRACE_PREFIX, STAGES, TRACE_PREFIX
from reproductions.common.cli import positive_int
from scripts.bench import METHODS, WORKLOADS, Trainer, markdown_table, write_json

#: Name of the part that is no op at all: the stage's own time outside every op in it.
BETWEEN_OPS = "(between ops)"


@dataclass
class Part:
    """One part of a stage: over the profiled steps, or per step.

    Attributes:
        calls: Ranges or top-level ops of this name.
        seconds: Self time of the ops it contains.
    """

    calls: float = 0.0
    seconds: float = 0.0


def _place(event: FunctionEvent) -> tuple[str, str, bool] | None:
    """Where an op's self time goes: its stage, its part (the innermost ``core.`` range around
    it, itself included, else the outermost op under its stage), and whether ``event`` opens
    that part; None outside every stage."""
    part, opens, node, outermost = None, False, event, event
    while node is not None:
        if node.name.startswith(STAGE_TRACE_PREFIX):
            if part is None:
                part, opens = outermost.name, outermost is event
            return node.name.removeprefix(STAGE_TRACE_PREFIX), part, opens
        if part is None and node.name.startswith(TRACE_PREFIX):
            part, opens = node.name.removeprefix(TRACE_PREFIX), node is event
        outermost, node = node, node.cpu_parent
    return None


def split(events: Iterable[FunctionEvent]) -> dict[str, dict[str, Part]]:
    """Per stage, its parts by name (see the module's docstring) and :data:`BETWEEN_OPS`."""
    stages: dict[str, dict[str, Part]] = defaultdict(lambda: defaultdict(Part))
    for event in events:
        if event.name.startswith(STAGE_TRACE_PREFIX):
            # A stage range nested in another (a stage entered inside one) counts in its own.
            between = stages[event.name.removeprefix(STAGE_TRACE_PREFIX)][BETWEEN_OPS]
            between.seconds += event.self_cpu_time_total / 1e6
            between.calls += 1
            continue
        place = _place(event)
        if place is None:
            continue
        stage, name, opens = place
        part = stages[stage][name]
        part.seconds += event.self_cpu_time_total / 1e6
        part.calls += int(opens)
    return stages


@dataclass
class StageSplit:
    """A profiled run's split, per step.

    Attributes:
        parts: Per stage, per part: calls and seconds per step.
        profiled: Seconds per step of each stage under the profiler (the sum of its parts).
        unprofiled: Median seconds per step of each stage in the same number of steps
            without the profiler (the preconditioner's own timer).
        layers: Layers the method preconditions.
    """

    parts: dict[str, dict[str, Part]]
    profiled: dict[str, float]
    unprofiled: dict[str, float]
    layers: int


def measure(workload: str, method: str, steps: int) -> StageSplit:
    """Profile ``steps`` update steps of ``method`` on ``workload`` (after ``steps`` of warm-up,
    then ``steps`` timed without the profiler) on the CPU."""
    spec = next(m for m in METHODS if m.name == method)
    trainer = Trainer(WORKLOADS[workload], spec, frozenset(range(3 * steps)),
                      torch.device("cpu"), nullcontext)
    preconditioner = trainer.optimizer.preconditioner
    timer = preconditioner.timer

    def step() -> None:
        trainer.start.restore()
        trainer.step()

    for _ in range(steps):
        step()
    unprofiled: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        step()
        for stage, seconds in timer.last.items():
            unprofiled[stage].append(seconds)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            step()
    stages = split(profile.events())
    parts = {stage: {name: Part(p.calls / steps, p.seconds / steps) for name, p in found.items()}
             for stage, found in stages.items()}
    return StageSplit(parts, {s: sum(p.seconds for p in found.values())
                              for s, found in parts.items()},
                      {s: statistics.median(v) for s, v in unprofiled.items()},
                      len(preconditioner.layers))


def table(result: StageSplit, shown: int) -> str:
    """Markdown: per stage (in :data:`~core.timing.STAGES` order), its ``shown`` largest
    parts and the rest summed, each in ms per step and as a share of the stage."""
    lines = []
    for stage in [s for s in STAGES if s in result.parts]:
        total = result.profiled[stage]
        lines.append([f"**{stage}**", "", f"**{total * 1e3:.1f}**", "100%",
                      f"{result.unprofiled.get(stage, 0.0) * 1e3:.1f}"])
        ranked = sorted(result.parts[stage].items(), key=lambda kv: -kv[1].seconds)
        rest = ranked[shown:]
        for name, part in ranked[:shown]:
            lines.append([f"`{name}`", f"{part.calls:g}", f"{part.seconds * 1e3:.2f}",
                          f"{part.seconds / total:.0%}" if total else "-", ""])
        if rest:
            seconds = sum(p.seconds for _, p in rest)
            lines.append([f"{len(rest)} other parts", "", f"{seconds * 1e3:.2f}",
                          f"{seconds / total:.0%}" if total else "-", ""])
    return markdown_table(["stage / part", "calls per step", "ms per step", "share",
                           "stage ms unprofiled"], lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="bert-small")
    parser.add_argument("--method", choices=[m.name for m in METHODS], default="kfac-inverse")
    parser.add_argument("--steps", type=positive_int, default=3,
                        help="update steps each to warm up, to time, and to profile")
    parser.add_argument("--shown", type=positive_int, default=8,
                        help="largest parts listed per stage")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, help="also write the split here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print the split of one workload and method as a markdown table, and return it."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.workload, args.method, args.steps)
    print(f"{args.workload}, {args.method} ({result.layers} layers), {args.steps} update steps "
          "profiled, per step:\n")
    print(table(result, args.shown))
    out = {"workload": args.workload, "method": args.method, "steps": args.steps,
           "threads": args.threads, "layers": result.layers, "profiled": result.profiled,
           "unprofiled": result.unprofiled,
           "parts": {s: {n: vars(p) for n, p in found.items()}
                     for s, found in result.parts.items()}}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
