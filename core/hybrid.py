"""MKOR-H: switch from second-order to first-order updates when second order stops paying.

The MKOR paper's hybrid "mid-training falls back to a first order optimizer if the second order
updates no longer accelerate convergence". **Neither the paper nor the released code gives the
rule; the rule below is ours.** It is deterministic (a function of the observed losses only) and
configurable, and it is logged with its evidence when it fires.

The rule. Feed the training loss of every step to :meth:`HybridSwitch.observe`. With ``w =
window``, once at least ``min_steps`` losses have been observed and the last ``2w`` are at hand,
compare the mean loss of the last ``w`` steps, ``m_now``, with the mean of the ``w`` steps before
them, ``m_before``. The two windows' centres are ``w`` steps apart, so

    ``rate = (m_before − m_now) / (w · |m_before|)``

is the relative loss decrease per step. If ``rate < threshold`` the switch fires: from then on
:meth:`HybridSwitch.step` no longer calls the preconditioner (its capture hooks are removed, so it
costs nothing) and the first-order optimizer consumes raw gradients. Once switched it stays
switched. Window means (rather than two single losses) make the rate robust to mini-batch noise.
Non-finite losses (e.g. AMP overflow steps) count as steps but are not put into the windows.
``threshold = -inf`` never switches; ``threshold = inf`` switches as soon as the evidence exists.
In a distributed run each step's loss is averaged over the ranks first (one all-reduce of one
number), so the rule reads the global loss and every rank switches on the same step: a rank that
stopped calling the preconditioner alone would leave the others' collectives unmatched.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from core.config import check_number, config_from_options
from core.distributed.communicator import Communicator
from core.distributed.transport import SimulatedTransport

logger = logging.getLogger(__name__)


class Preconditioner(Protocol):
    """What :class:`HybridSwitch` needs of the wrapped preconditioner."""

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class HybridConfig:
    """Options of :class:`HybridSwitch`.

    Attributes:
        window: ``w`` >= 1, steps per window (the rate compares two consecutive windows).
        threshold: Switch when the relative loss decrease per step falls below this (any
            number; ``-inf`` never switches).
        min_steps: Never switch before this many observed steps (>= 0).
    """

    window: int = 50
    threshold: float = 1e-3
    min_steps: int = 100

    def __post_init__(self) -> None:
        check_number("window", self.window, low=1, integer=True)
        check_number("threshold", self.threshold, low=-math.inf, infinite=True)
        check_number("min_steps", self.min_steps, low=0, integer=True)


@dataclass(frozen=True)
class SwitchEvent:
    """The evidence the switch fired on.

    Attributes:
        step: Number of losses observed when it fired (the step whose loss completed the
            evidence; that step and every later one are first-order).
        rate: The relative loss decrease per step that fell below ``threshold``.
        threshold: The threshold in force.
        window: ``w``.
        mean_before: Mean loss of the earlier window.
        mean_now: Mean loss of the latest window.
    """

    step: int
    rate: float
    threshold: float
    window: int
    mean_before: float
    mean_now: float


def loss_decrease_rate(losses: list[float], window: int) -> float:
    """``(m_before − m_now) / (window · |m_before|)`` over the last ``2·window`` losses.

    Returns 0 when ``m_before`` is 0 (a zero loss cannot decrease further).
    """
    if len(losses) < 2 * window:
        raise ValueError(f"need {2 * window} losses, got {len(losses)}")
    before = sum(losses[-2 * window:-window]) / window
    now = sum(losses[-window:]) / window
    if before == 0:
        return 0.0
    return (before - now) / (window * abs(before))


def mean_over_ranks(value: float, communicator: Communicator) -> float:
    """``value`` averaged over the communicator's ranks (itself in one process), recorded in
    its ledger (stage ``hybrid_loss``); a non-finite value on any rank makes the mean
    non-finite."""
    if communicator.world_size == 1 or isinstance(communicator.transport, SimulatedTransport):
        return value  # (a simulated world moves nothing: every rank saw this value)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    total = torch.tensor([value], dtype=torch.float64, device=device)
    communicator.all_reduce(total, stage="hybrid_loss")
    return float(total) / communicator.world_size


class HybridSwitch:
    """Runs a preconditioner until the loss-rate rule (module docstring) says to stop.

    Wraps anything with ``step()``, ``state_dict()`` and ``load_state_dict()``
    (:class:`~core.MKORPreconditioner`, :class:`~core.KFACPreconditioner`, ...). Per step::

        loss.backward()
        switch.observe(loss.item())
        switch.step()        # the preconditioner's step while second order pays, else nothing
        optimizer.step()

    Args:
        preconditioner: The second-order preconditioner to run and, later, switch off.
        config: A :class:`HybridConfig`; or give its fields as keyword arguments.
        **options: :class:`HybridConfig` fields (``window``, ``threshold``, ``min_steps``).

    Attributes:
        event: The :class:`SwitchEvent` once switched, else None.
        last_rate: The latest measured rate (None before there is enough evidence).
    """

    def __init__(self, preconditioner: Preconditioner, config: HybridConfig | None = None,
                 **options: Any) -> None:
        self.config = config_from_options(HybridConfig, config, options)
        self.preconditioner = preconditioner
        self.steps = 0
        self.losses: deque[float] = deque(maxlen=2 * self.config.window)
        self.event: SwitchEvent | None = None
        self.last_rate: float | None = None
        # The wrapped preconditioner's communicator (MKOR's, or K-FAC's strategy's), so the
        # loss average is in its ledger; else one over the process group (collective).
        self.communicator: Communicator = (
            getattr(preconditioner, "communicator", None)
            or getattr(getattr(preconditioner, "strategy", None), "communicator", None)
            or Communicator.from_torch())

    @property
    def switched(self) -> bool:
        """Whether updates are first-order now."""
        return self.event is not None

    def observe(self, loss: float) -> None:
        """Record this step's training loss (this rank's: it is averaged over the ranks) and
        apply the rule."""
        self.steps += 1
        loss = mean_over_ranks(float(loss), self.communicator)
        if not math.isfinite(loss):
            return
        self.losses.append(loss)
        cfg = self.config
        if self.switched or len(self.losses) < 2 * cfg.window:
            return
        self.last_rate = loss_decrease_rate(list(self.losses), cfg.window)
        if self.steps >= cfg.min_steps and self.last_rate < cfg.threshold:
            # This step's captures will never be stepped: dropped now, so that a rollback
            # (load_state_dict of an earlier state) starts clean and they hold no memory.
            discard = getattr(self.preconditioner, "discard_pending", None)
            if discard is not None:
                discard()
            values = list(self.losses)
            self._switch(SwitchEvent(
                step=self.steps, rate=self.last_rate, threshold=cfg.threshold,
                window=cfg.window, mean_before=sum(values[:cfg.window]) / cfg.window,
                mean_now=sum(values[cfg.window:]) / cfg.window))

    def _switch(self, event: SwitchEvent) -> None:
        self.event = event
        remove_hooks = getattr(self.preconditioner, "remove_hooks", None)
        if remove_hooks is not None:
            remove_hooks()
        logger.info(
            "MKOR-H: switching to first-order after step %d: relative loss decrease per step "
            "%.3g < threshold %.3g (window %d: mean loss %.6g -> %.6g)",
            event.step, event.rate, event.threshold, event.window, event.mean_before,
            event.mean_now)

    def step(self) -> None:
        """Run the preconditioner's step, unless switched: then only the ledger's step tag
        moves on (the preconditioner, which moved it, no longer steps), so each later step's
        collectives (the loss average, a gradient all-reduce) are tagged with that step."""
        if self.switched:
            self.communicator.ledger.step += 1
        else:
            self.preconditioner.step()

    def skip_step(self) -> None:
        """The preconditioner's ``skip_step`` (a step the optimizer skipped); once switched,
        the ledger's step tag moves on instead, as in :meth:`step`."""
        skip = getattr(self.preconditioner, "skip_step", None)
        if self.switched:
            self.communicator.ledger.step += 1
        elif skip is not None:
            skip()

    def no_capture(self) -> AbstractContextManager[None]:
        """The wrapped preconditioner's ``no_capture()`` (forward passes run inside add
        nothing to its statistics); nothing to pause once switched, or without one."""
        inner = getattr(self.preconditioner, "no_capture", None)
        return nullcontext() if inner is None else inner()

    def metrics(self) -> dict[str, float]:
        """The wrapped preconditioner's metrics (while it runs), the mode and the rate."""
        out: dict[str, float] = {}
        inner = getattr(self.preconditioner, "metrics", None)
        if inner is not None and not self.switched:
            out.update(inner())
        out["hybrid/second_order"] = float(not self.switched)
        if self.last_rate is not None:
            out["hybrid/loss_decrease_rate"] = self.last_rate
        return out

    def state_dict(self) -> dict[str, Any]:
        """The rule's state (steps, loss window, event), the ledger's step tag and the
        preconditioner's state."""
        return {
            "steps": self.steps,
            "ledger_step": self.communicator.ledger.step,
            "losses": list(self.losses),
            "last_rate": self.last_rate,
            "event": None if self.event is None else asdict(self.event),
            "preconditioner": self.preconditioner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: a switched state stays switched, and one saved
        before the switch (a rollback) runs the preconditioner again, its hooks attached."""
        self.preconditioner.load_state_dict(state["preconditioner"])
        # after the switch the tag runs ahead of the preconditioner's steps (see step())
        self.communicator.ledger.step = int(state.get("ledger_step",
                                                      self.communicator.ledger.step))
        self.steps = int(state["steps"])
        self.losses = deque(state["losses"], maxlen=2 * self.config.window)
        self.last_rate = state["last_rate"]
        if state["event"] is not None:
            self._switch(SwitchEvent(**state["event"]))
        elif self.switched:
            self.event = None
            add_hooks = getattr(self.preconditioner, "add_hooks", None)
            if add_hooks is not None:
                add_hooks()
