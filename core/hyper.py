"""Hyper-parameters that papers schedule: a constant or a callable of the step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias, TypeVar

T = TypeVar("T", int, float)

#: A hyper-parameter given as a constant or as a function of the preconditioner step.
Schedulable: TypeAlias = T | Callable[[int], T]


def value_at(value: Schedulable[T], step: int) -> T:
    """Resolve a constant-or-callable hyper-parameter at ``step``.

    Args:
        value: A number, or a callable mapping the step (0-based count of ``step()`` calls) to one.
        step: The current step.

    Returns:
        The hyper-parameter's value at ``step``.
    """
    return value(step) if callable(value) else value
