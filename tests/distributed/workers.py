"""Code that runs inside the spawned gloo workers (importable by the spawned processes)."""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from core import KFACPreconditioner
from core.distributed import average_gradients
from core.inverse import SIDES
from core.strategy import Strategy
from tests.distributed.helpers import local_rows, make_data, make_model

#: Options every run shares; inverses every 2 steps, so step 1 preconditions with stale state.
COMMON: dict[str, Any] = {"damping": 1e-2, "factor_decay": 0.9, "inv_update_steps": 2,
                          "kl_clip": 1e-4, "lr": 0.1}
STEPS = 3
#: Options that change the mathematics (the rest only change who does what).
MATH_OPTIONS = ("damping", "factor_decay", "inv_update_steps", "kl_clip", "lr",
                "inverse_method", "prediv_eigenvalues", "damping_split", "factor_scaling",
                "factor_dtype", "inverse_dtype", "precondition_dtype",
                "precondition_dtype_tolerance")


def rising_damping(step: int) -> float:
    """A damping that changes at every step (a module-level function, so spawned workers can
    receive it): step 1 preconditions with step 0's state, which pre-divided eigenvalues damp
    with step 0's value and ``eigen`` with step 1's."""
    return 1e-2 * (1 + step)

Grads = dict[str, Tensor | None]


def _grads(model: nn.Module) -> Grads:
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def _relative_error(got: Grads, expected: Grads) -> float:
    """Largest ``max|got − expected| / max|expected|`` over parameters (inf if one is None)."""
    worst = 0.0
    for name, e in expected.items():
        g = got[name]
        if g is None or e is None:
            worst = max(worst, 0.0 if g is None and e is None else float("inf"))
            continue
        worst = max(worst, float((g - e).abs().max() / e.abs().max().clamp_min(1e-30)))
    return worst


class _Reference:
    """A single-process preconditioner, run on a given batch, optionally with a given gradient
    (for ``dp-kfac``: factors from one rank's batch, gradient averaged over all ranks)."""

    def __init__(self, options: dict[str, Any], with_unused: bool) -> None:
        self.model = make_model(with_unused)
        math = {k: v for k, v in options.items() if k in MATH_OPTIONS}
        self.pre = KFACPreconditioner(self.model, strategy_impl=Strategy(), **math)

    def step(self, params: dict[str, Tensor], x: Tensor, y: Tensor,
             grads: Grads | None = None) -> Grads:
        self.model.load_state_dict(params)
        self.model.zero_grad()
        nn.functional.cross_entropy(self.model(x), y).backward()
        if grads is not None:
            for name, p in self.model.named_parameters():
                p.grad = None if grads[name] is None else grads[name].clone()
        self.pre.step()
        return _grads(self.model)


def train_and_compare(rank: int, world_size: int, options: dict[str, Any], *, ddp: bool,
                      with_unused: bool) -> dict[str, Any]:
    """Train :data:`STEPS` steps with a strategy and compare each step's preconditioned
    gradients with the single-process reference on the same data.

    The reference is the global batch, except for ``dp-kfac``: per layer, the single-process
    result whose factors come from the layer owner's local batch (its distance to the global
    batch result is returned too, to show that the distinction is visible).
    """
    options = COMMON | options
    x, y = make_data()
    rows = local_rows(rank, world_size)
    model = make_model(with_unused)
    net = (DistributedDataParallel(model, find_unused_parameters=with_unused) if ddp
           else model)
    pre = KFACPreconditioner(net, **options)
    dp_kfac = options.get("strategy") == "dp-kfac"
    refs = [_Reference(options, with_unused) for _ in range(1 + (world_size if dp_kfac else 0))]
    prefix = "module." if ddp else ""
    owners = ({layer.name.removeprefix(prefix): pre.strategy.owner(layer)  # type: ignore[attr-defined]
               for layer in pre.layers} if dp_kfac else {})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    errors, global_errors, kl_scales, state_dtypes = [], [], [], []
    for _ in range(STEPS):
        params = {k: v.clone() for k, v in model.state_dict().items()}
        model.zero_grad()
        nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
        if not ddp:
            average_gradients(model.parameters(), pre.strategy.communicator)
        averaged = _grads(model)
        pre.step()
        global_batch = refs[0].step(params, x, y)
        if dp_kfac:
            per_rank = [ref.step(params, x[local_rows(r, world_size)],
                                 y[local_rows(r, world_size)], averaged)
                        for r, ref in enumerate(refs[1:])]
            expected = {name: per_rank[owners[name.rsplit(".", 1)[0]]][name]
                        for name in averaged}
        else:
            expected = global_batch
        errors.append(_relative_error(_grads(model), expected))
        global_errors.append(_relative_error(_grads(model), global_batch))
        kl_scales.append(pre.last_kl_scale)
        state_dtypes.append({layer.name.removeprefix(prefix): [
            str(layer.state.side_dtype(side)).removeprefix("torch.") for side in SIDES]
            for layer in pre.layers if layer.state is not None})
        optimizer.step()
    return {
        "errors": errors,
        "global_batch_errors": global_errors,
        "kl_scales": kl_scales,
        "state_dtypes": state_dtypes,
        "final_grads": _grads(model),
        "ledger": [e.as_tuple() for e in pre.strategy.communicator.ledger.entries],
        "assignment": pre.strategy.assignment.as_rows(),  # type: ignore[attr-defined]
        "memory": pre.memory_usage(),
        "describe": pre.strategy.describe(),
    }


def state_dict_round_trip(rank: int, world_size: int, options: dict[str, Any]
                          ) -> dict[str, Any]:
    """Save after 3 steps (the next step reuses stale inverses), train 2 more; a fresh
    preconditioner loaded from the save must give bit-identical gradients for those 2 steps."""
    options = COMMON | options
    x, y = make_data()
    rows = local_rows(rank, world_size)

    def build() -> tuple[nn.Module, nn.Module, KFACPreconditioner, torch.optim.Optimizer]:
        model = make_model()
        net = DistributedDataParallel(model)
        return (model, net, KFACPreconditioner(net, **options),
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def train(run: tuple[nn.Module, nn.Module, KFACPreconditioner, torch.optim.Optimizer],
              steps: int) -> list[Grads]:
        model, net, pre, optimizer = run
        out = []
        for _ in range(steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
            pre.step()
            out.append(_grads(model))
            optimizer.step()
        return out

    first = build()
    train(first, 3)
    wide_at_save = first[2].metrics().get("wide_state_sides", 0)
    buffers_at_save = first[2].memory_usage()["buffers"]
    buffer = io.BytesIO()
    torch.save({"model": first[0].state_dict(), "pre": first[2].state_dict(),
                "optimizer": first[3].state_dict()}, buffer)
    expected = train(first, 2)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    second = build()
    second[0].load_state_dict(saved["model"])
    second[2].load_state_dict(saved["pre"])
    second[3].load_state_dict(saved["optimizer"])
    buffers_loaded = second[2].memory_usage()["buffers"]
    got = train(second, 2)

    wrong_rank = dict(saved["pre"], signature=dict(saved["pre"]["signature"],
                                                   rank=1 - rank))
    try:
        build()[2].load_state_dict(wrong_rank)
        rejected = ""
    except ValueError as error:
        rejected = str(error)
    return {"wide_state_sides": wide_at_save,
            "buffers": (buffers_at_save, buffers_loaded),
            "max_difference": max(_relative_error(g, e) for g, e in zip(got, expected,
                                                                          strict=True)),
            "ready": saved["pre"]["strategy"]["ready"],
            "rejected_other_rank": rejected}


def suite(rank: int, world_size: int, configs: dict[str, dict[str, Any]], *, ddp: bool,
          with_unused: bool, round_trips: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every configuration in one set of processes (spawning is the slow part), and the
    warnings that a layer captured nothing (none expected: under ``dp-kfac`` only owners
    capture, and a layer not run on a rank has no gradient there)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = {
            "runs": {name: train_and_compare(rank, world_size, options, ddp=ddp,
                                             with_unused=with_unused)
                     for name, options in configs.items()},
            "round_trips": {name: state_dict_round_trip(rank, world_size, options)
                            for name, options in round_trips.items()},
        }
    out["uncaptured_warnings"] = [str(w.message) for w in caught
                                  if "nothing captured" in str(w.message)]
    return out
