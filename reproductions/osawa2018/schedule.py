"""Schedules of the recipe: polynomial learning-rate decay and relaxed factor-update intervals.

* :class:`PolynomialDecay` is the chainerkfac ``LrPolynomialDecay`` (PAPERS.md §2.2 item 10),
  evaluated at the fractional epoch ``step · batch / dataset`` before each update, as the Chainer
  trainer does (its extension runs after every ``acc_iters`` iterations, i.e. once per update).
* :class:`IntervalSchedule` is the factor-update relaxation: Kronecker factors (and their
  inverses) are refreshed every step at first and less often once they settle. The paper describes
  the idea; neither its text that we have nor the released code gives the intervals, so they are a
  configurable step function (PAPERS.md §2.1, §2.2 item 6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from core.config import ConfigError


def epoch_at(step: int, batch_size: int, dataset_size: int) -> float:
    """The fractional epoch after ``step`` updates of ``batch_size`` examples each."""
    return step * batch_size / dataset_size


@dataclass(frozen=True)
class PolynomialDecay:
    """``lr(e) = lr₀`` for ``e < e_start``; ``lr₀·(1 − (e − e_start)/(e_end − e_start))^p`` for
    ``e_start ≤ e < e_end``; 0 afterwards.

    Attributes:
        base_lr: ``lr₀``.
        start_epoch: ``e_start``; the rate is constant before it (chainerkfac's comment calls this
            a warm-up, its code keeps the rate).
        end_epoch: ``e_end``; chainerkfac uses ``max(epochs, polynomial_epoch)``, so the rate need
            not reach 0 within the run.
        power: ``p``; 0 keeps the rate constant until ``e_end``.
    """

    base_lr: float
    start_epoch: float
    end_epoch: float
    power: float

    def __post_init__(self) -> None:
        if not self.base_lr >= 0:
            raise ConfigError("lr", self.base_lr, "a number >= 0")
        if not self.start_epoch >= 0:
            raise ConfigError("lr_decay_start_epoch", self.start_epoch, "a number >= 0")
        if not self.end_epoch > self.start_epoch:
            raise ConfigError("lr_decay_end_epoch", self.end_epoch,
                              f"a number > lr_decay_start_epoch={self.start_epoch}")
        if not self.power >= 0:
            raise ConfigError("lr_power", self.power, "a number >= 0")

    def __call__(self, epoch: float) -> float:
        """The learning rate at the fractional ``epoch``."""
        if epoch < self.start_epoch:
            return self.base_lr
        if epoch >= self.end_epoch:
            return 0.0
        remaining = 1.0 - (epoch - self.start_epoch) / (self.end_epoch - self.start_epoch)
        return self.base_lr * remaining**self.power


@dataclass(frozen=True)
class IntervalSchedule:
    """An update interval that is a step function of the step (factor-update relaxation).

    Attributes:
        milestones: ``(first step, interval)`` pairs in increasing step order, the first at step 0;
            from each first step on, updates happen at steps divisible by its interval.
    """

    milestones: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        allowed = "(step, interval) pairs, the first at step 0, steps increasing, intervals >= 1"
        steps = [s for s, _ in self.milestones]
        if (not self.milestones or steps[0] != 0 or steps != sorted(set(steps))
                or any(not isinstance(i, int) or i < 1 for _, i in self.milestones)):
            raise ConfigError("factor_update_intervals", self.milestones, allowed)

    @classmethod
    def from_epochs(cls, pairs: Sequence[Sequence[float]], steps_per_epoch: float
                    ) -> IntervalSchedule:
        """Milestones given as ``(epoch, interval)``, converted with ``steps_per_epoch``.

        An epoch milestone starts at the first step at or after it; milestones that land on the
        same step keep the later one.
        """
        by_step: dict[int, int] = {}
        for epoch, interval in pairs:
            by_step[math.ceil(epoch * steps_per_epoch - 1e-9)] = int(interval)
        return cls(tuple(sorted(by_step.items())))

    def __call__(self, step: int) -> int:
        """The interval in force at ``step``."""
        current = self.milestones[0][1]
        for first, interval in self.milestones:
            if step < first:
                break
            current = interval
        return current
