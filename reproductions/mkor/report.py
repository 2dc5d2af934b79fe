"""Convergence numbers from results files: final loss, and steps and time to a target loss.

The MKOR paper's speed-up (Tables 2-3) is the time for each optimizer to reach the accuracy the
first-order baseline (LAMB) reaches at the end of phase 2. Our small-scale form, used by the
entry point's closing table and by ``reproductions.mkor.tables``:

* the training loss is smoothed by a trailing mean over ``window`` steps (mini-batch noise);
* the **target** is LAMB's smoothed loss at its last step;
* an optimizer **reaches** it at the first step whose smoothed loss is at or below the target;
  its iterations are that step + 1 and its time is the summed ``time_s`` of the steps so far
  (training steps only: evaluation and checkpointing are excluded);
* **speed-up** = LAMB's time to the target / the optimizer's time to the target, and the same
  ratio of steps (which, unlike seconds, does not depend on how busy the machine was).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BASELINE = "lamb"
"""The first-order optimizer the others are compared with (the paper's)."""


@dataclass(frozen=True)
class Convergence:
    """One run's convergence numbers.

    Attributes:
        optimizer: The optimizer's name.
        steps: Steps run.
        final_loss: Smoothed training loss at the last step.
        final_eval_loss: Held-out loss of the last evaluation (None without one).
        time_s: Summed step time of the run.
        optimizer_time_s: Summed time inside the optimizer step (None if not recorded).
        steps_to_target: Iterations to reach the target (None if never reached).
        time_to_target_s: Seconds to reach the target (None if never reached).
    """

    optimizer: str
    steps: int
    final_loss: float
    final_eval_loss: float | None
    time_s: float
    optimizer_time_s: float | None
    steps_to_target: int | None
    time_to_target_s: float | None


def smoothed_losses(steps: Sequence[dict[str, Any]], window: int) -> list[float]:
    """Trailing mean of the finite losses over the last ``window`` steps, per step (NaN while
    a window holds no finite loss)."""
    values = [s["loss"] if s["loss"] is not None and math.isfinite(s["loss"]) else None
              for s in steps]
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def convergence(results: dict[str, Any], target: float, window: int) -> Convergence:
    """Convergence numbers of one results file against ``target`` (see the module docstring).
    """
    steps = results["steps"]
    smooth = smoothed_losses(steps, window)
    reached = next((i for i, v in enumerate(smooth) if i >= min(window, len(smooth)) - 1
                    and v <= target), None)
    elapsed = 0.0
    cumulative = []
    for s in steps:
        elapsed += s["time_s"]
        cumulative.append(elapsed)
    evals = [e["loss"] for e in results["evals"] if e.get("loss") is not None]
    optimizer_times = [s["optimizer_s"] for s in steps if s.get("optimizer_s") is not None]
    return Convergence(
        optimizer=results["optimizer"], steps=len(steps), final_loss=smooth[-1],
        final_eval_loss=evals[-1] if evals else None, time_s=elapsed,
        optimizer_time_s=sum(optimizer_times) if optimizer_times else None,
        steps_to_target=None if reached is None else reached + 1,
        time_to_target_s=None if reached is None else cumulative[reached])


def compare(runs: Sequence[dict[str, Any]], window: int) -> tuple[float | None, list[Convergence]]:
    """Convergence of every run against the LAMB run's final smoothed loss.

    Args:
        runs: Results of one experiment (one per optimizer).
        window: Smoothing window in steps.

    Returns:
        ``(target, rows)``; without a LAMB run the target is None and nothing is "reached".
    """
    baseline = next((r for r in runs if r["optimizer"] == BASELINE), None)
    target = smoothed_losses(baseline["steps"], window)[-1] if baseline else None
    return target, [convergence(r, math.nan if target is None else target, window)
                    for r in runs]


def _fmt(value: float | int | None, spec: str) -> str:
    return "not reached" if value is None else format(value, spec)


def comparison_table(runs: Sequence[dict[str, Any]], window: int) -> str:
    """A markdown table of one experiment's runs, with steps, time and speed-up to LAMB's loss.
    """
    target, rows = compare(runs, window)
    base = next((r for r in rows if r.optimizer == BASELINE), None)
    lines = [
        f"Target: LAMB's final training loss (mean of the last {window} steps) = "
        + ("n/a (no LAMB run)" if target is None else f"{target:.4f}"),
        "",
        "| optimizer | steps | final loss | held-out loss | time (s) | optimizer time (s) "
        "| steps to target | time to target (s) | speed-up in steps | speed-up in time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        by_steps, by_time = speedups(base, row)
        lines.append(
            f"| {row.optimizer} | {row.steps} | {row.final_loss:.4f} | "
            f"{_fmt(row.final_eval_loss, '.4f')} | {row.time_s:.1f} | "
            f"{_fmt(row.optimizer_time_s, '.1f')} | {_fmt(row.steps_to_target, 'd')} | "
            f"{_fmt(row.time_to_target_s, '.1f')} | {_fmt(by_steps, '.2f')} | "
            f"{_fmt(by_time, '.2f')} |")
    return "\n".join(lines)


def speedups(base: Convergence | None, row: Convergence) -> tuple[float | None, float | None]:
    """``row``'s speed-up over the baseline in steps and in time to the target (None when
    either never reaches it)."""
    if base is None or base.steps_to_target is None or row.steps_to_target is None:
        return None, None
    return (base.steps_to_target / row.steps_to_target,
            base.time_to_target_s / row.time_to_target_s)  # type: ignore[operator]
