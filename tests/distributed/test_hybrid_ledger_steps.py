"""MKOR-H in a distributed run, after the switch: the collectives of every later step (the loss
average, the gradient all-reduce) are tagged in the ledger with their own step, also after a
resume from a checkpoint saved once switched; the preconditioner, which moved the tag, no
longer steps."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from core import HybridSwitch, MKORPreconditioner
from core.distributed import average_gradients
from tests.distributed.helpers import local_rows, make_data, make_model, run_workers

#: Switches as soon as two losses are at hand: on step 1, the first first-order step.
RULE = {"window": 1, "threshold": float("inf"), "min_steps": 0}
STEPS = 5
SAVE_AFTER = 3


def _build() -> tuple[torch.nn.Module, HybridSwitch, torch.optim.Optimizer]:
    model = make_model()
    switch = HybridSwitch(MKORPreconditioner(model, inv_update_steps=1), **RULE)
    return model, switch, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(run: tuple[torch.nn.Module, HybridSwitch, torch.optim.Optimizer], rank: int,
           world_size: int, steps: int) -> None:
    model, switch, optimizer = run
    x, y = make_data()
    rows = local_rows(rank, world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        average_gradients(model.parameters(), switch.communicator)
        switch.observe(loss.item())
        switch.step()
        optimizer.step()


def _tags(switch: HybridSwitch) -> list[tuple[int, str]]:
    return [(entry.step, entry.stage) for entry in switch.communicator.ledger.entries]


def switched_then_resumed(rank: int, world_size: int) -> dict[str, Any]:
    """The ledger's (step, stage) of an uninterrupted run, and of a run resumed from the state
    saved after :data:`SAVE_AFTER` steps (its later steps only)."""
    torch.set_num_threads(1)
    first = _build()
    _train(first, rank, world_size, SAVE_AFTER)
    saved = copy.deepcopy({"model": first[0].state_dict(), "switch": first[1].state_dict()})
    _train(first, rank, world_size, STEPS - SAVE_AFTER)
    second = _build()
    second[0].load_state_dict(saved["model"])
    second[1].load_state_dict(saved["switch"])
    _train(second, rank, world_size, STEPS - SAVE_AFTER)
    return {"event_step": first[1].event and first[1].event.step,
            "uninterrupted": _tags(first[1]), "resumed": _tags(second[1])}


def test_steps_after_the_switch_are_tagged_with_their_own_step() -> None:
    expected = [(step, stage) for step in range(STEPS)
                for stage in ("grad_allreduce", "hybrid_loss")
                + (("factor_comm",) if step == 0 else ())]
    for result in run_workers(switched_then_resumed, 2, timeout=120.0):
        assert result["event_step"] == 2  # the second loss: step 1 is first-order
        assert result["uninterrupted"] == expected
        assert result["resumed"] == expected[-2 * (STEPS - SAVE_AFTER):]
