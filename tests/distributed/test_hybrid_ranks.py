"""MKOR-H in a distributed run: the rule reads the loss averaged over the ranks, so every rank
switches on the same step (a rank switching alone would stop joining the preconditioner's
collectives and leave the others' unmatched)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from core import HybridSwitch
from tests.core.test_hybrid import CountingPreconditioner
from tests.distributed.helpers import run_workers

#: Rank 0's loss stops falling at once; rank 1's falls steeply for five steps.
LOSSES = {0: [1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6],
          1: [5.0, 4.0, 3.0, 2.0, 1.0, 0.9, 0.9, 0.9, 0.9, 0.9]}
RULE = {"window": 2, "threshold": 0.0, "min_steps": 0}


def switch_step(losses: list[float]) -> tuple[dict[str, Any] | None, list[tuple[str, int]]]:
    """The event of one process observing ``losses``, and its ledger (stage, traffic bytes)."""
    switch = HybridSwitch(CountingPreconditioner(), **RULE)
    for loss in losses:
        switch.observe(loss)
    ledger = [(e.stage, e.traffic_bytes) for e in switch.communicator.ledger.entries]
    return None if switch.event is None else asdict(switch.event), ledger


def observe_own_losses(rank: int, world_size: int
                       ) -> tuple[dict[str, Any] | None, list[tuple[str, int]]]:
    return switch_step(LOSSES[rank])


def test_every_rank_switches_on_the_step_the_mean_loss_says() -> None:
    mean = [(a + b) / 2 for a, b in zip(LOSSES[0], LOSSES[1], strict=True)]
    expected, none_sent = switch_step(mean)
    alone = [switch_step(LOSSES[rank])[0] for rank in (0, 1)]
    assert expected is not None and none_sent == []
    assert [event and event["step"] for event in alone] != [expected["step"]] * 2  # would differ
    results = run_workers(observe_own_losses, 2)
    # One fp64 all-reduce per observed loss, in the ledger: 2(p − 1)/p · 8 bytes at p = 2.
    assert results == [(expected, [("hybrid_loss", 8)] * len(LOSSES[0]))] * 2
