"""Measured cost of each method on a model: state memory, communication and update time.

For the MKOR paper's Table 1 (per layer, against the layer width ``d``) and its per-GPU memory
table (BERT-Large and ResNet-50 at 64 GPUs). Everything is measured by the code that trains, at
the given world size, in one process:

* **K-FAC (KAISA)**: :func:`core.distributed.simulate.simulate` runs the real strategy (the
  options' ``strategy``: comm-opt, mem-opt, ...) on a communicator that records every collective
  and moves nothing, with ``meta`` tensors for the factors; memory and bytes come from its
  per-rank memory report and ledger.
* **MKOR, Eva**: the real preconditioner on the real model, with a simulated communicator of
  ``world_size`` ranks (``Communicator.simulated``): one forward/backward and one update step;
  memory from ``memory_usage()``, bytes from the ledger of that step's all-reduce.
* **LAMB, SGD**: the first-order optimizer (timm's LAMB; torch's SGD with momentum) stepped
  once; its state (LAMB: two moments per parameter; SGD: one momentum buffer) is its memory; its
  only communication is the gradient all-reduce every method shares, so none is counted here.

Communication counts the second-order collectives of one update step (factor, inverse and
gradient-broadcast stages), not the data-parallel gradient all-reduce common to all methods.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from core.distributed.communicator import Communicator
from core.distributed.simulate import simulate
from core.eva import EvaPreconditioner
from core.mkor import MKORPreconditioner
from core.optim import build_first_order
from core.preconditioner import KFACPreconditioner

METHODS = ("mkor", "kfac", "eva", "lamb")
"""The methods of Table 1 that run here (SNGD/HyLo is not implemented in this project)."""

FIRST_ORDER_METHODS = ("lamb", "sgd")
"""First-order optimizers :func:`measure_costs` can measure (BERT's LAMB, ResNet-50's SGD)."""

SHARED_STAGES = ("grad_allreduce",)
"""Ledger stages every method pays alike; left out of the second-order communication."""

LossFn = Callable[[nn.Module], Tensor]


@dataclass(frozen=True)
class Cost:
    """One method's measured cost.

    Attributes:
        state_bytes: Bytes of optimizer state per GPU that the method adds (preconditioner
            state; LAMB: its moments). For K-FAC, the largest over the simulated ranks.
        comm_bytes: Payload bytes of the method's collectives in one update step, per GPU
            (largest over ranks); 0 for LAMB.
        traffic_bytes: Bytes received per GPU in that step under the bandwidth-optimal
            algorithm of each collective (the ledger's ``traffic_bytes``).
    """

    state_bytes: int
    comm_bytes: int
    traffic_bytes: int


def _kfac(model: nn.Module, world_size: int, options: dict[str, Any], ranks: int) -> Cost:
    settings = {k: v for k, v in options.items() if k != "lr"}
    strategy = settings.pop("strategy", "comm-opt")
    report = simulate(model, strategy, world_size, steps=1, average_grads=False,
                      ranks=sorted({round(i * (world_size - 1) / max(1, ranks - 1))
                                    for i in range(ranks)}), **settings)
    return Cost(state_bytes=max(report.memory("total")),
                comm_bytes=max(report.per_worker(field="bytes")),
                traffic_bytes=max(report.per_worker()))


def _rank1(kind: type, model: nn.Module, loss_fn: LossFn, world_size: int,
           options: dict[str, Any]) -> Cost:
    communicator = Communicator.simulated(0, world_size)
    interval = "inv_update_steps" if kind is MKORPreconditioner else "factor_update_steps"
    precond = kind(model, communicator=communicator, **{**options, interval: 1})
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    with warnings.catch_warnings():
        # bytes are counted, not values: a float16 wire's report of the values it loses
        # (the paper's half-precision vectors of this batch) says nothing about them
        warnings.filterwarnings("ignore", message=".*fell outside its range",
                                category=UserWarning)
        precond.step()
    precond.remove_hooks()
    entries = [e for e in communicator.ledger.entries if e.stage not in SHARED_STAGES]
    return Cost(state_bytes=precond.memory_usage()["total"],
                comm_bytes=sum(e.bytes for e in entries),
                traffic_bytes=sum(e.traffic_bytes for e in entries))


def _first_order(name: str, model: nn.Module, loss_fn: LossFn, options: dict[str, Any]
                 ) -> Cost:
    settings = {"lr": 1e-3, "weight_decay": 0.01, "momentum": 0.9 if name == "sgd" else 0.0,
                "betas": (0.9, 0.999), **options}
    optimizer = build_first_order(name, model, **settings)
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                for t in s.values() if isinstance(t, Tensor))
    return Cost(state_bytes=state, comm_bytes=0, traffic_bytes=0)


def measure_costs(model: nn.Module, loss_fn: LossFn, *, world_size: int,
                  options: dict[str, dict[str, Any]], kfac_ranks: int = 64,
                  methods: Sequence[str] = METHODS) -> dict[str, Cost]:
    """Memory and communication of ``methods`` on ``model`` at ``world_size`` GPUs.

    Args:
        model: A real (CPU) model; its gradients are overwritten.
        loss_fn: A scalar loss of ``model`` on a small fixed batch (shapes matter, not values).
        world_size: Simulated number of GPUs.
        options: Per method, its options (e.g. the ``preconditioner`` section of an experiment
            config: damping, intervals, fp16 storage and wire dtype, K-FAC's ``strategy`` and
            ``skip_layers``; for ``lamb`` and ``sgd``, ``build_first_order``'s keywords).
        kfac_ranks: How many of the ranks to simulate for K-FAC (evenly spread; the maximum
            over them is reported). Fewer is faster; for symmetric strategies one suffices.
        methods: Which to measure: any of :data:`METHODS` and :data:`FIRST_ORDER_METHODS`.

    Returns:
        A :class:`Cost` per method, in the order of ``methods``.
    """
    measure: dict[str, Callable[[], Cost]] = {
        "kfac": lambda: _kfac(model, world_size, options.get("kfac", {}),
                              min(kfac_ranks, world_size)),
        "mkor": lambda: _rank1(MKORPreconditioner, model, loss_fn, world_size,
                               options.get("mkor", {})),
        "eva": lambda: _rank1(EvaPreconditioner, model, loss_fn, world_size,
                              options.get("eva", {})),
        **{name: (lambda name=name: _first_order(name, model, loss_fn, options.get(name, {})))
           for name in FIRST_ORDER_METHODS},
    }
    unknown = [m for m in methods if m not in measure]
    if unknown:
        raise ValueError(f"cannot measure {unknown}: choose from {sorted(measure)}")
    return {method: measure[method]() for method in methods}


UPDATE_STAGES = ("factors", "factor_comm", "inversion", "inverse_comm")
"""Timer stages of the second-order update itself: statistics, their reduction, and the
inversion (K-FAC), Sherman-Morrison update (MKOR) or running-vector update (Eva)."""

APPLY_STAGES = ("precondition", "grad_comm", "scale")
"""Timer stages that apply the curvature to the gradient (every step, update or not)."""


def update_times(method: str, model: nn.Module, loss_fn: LossFn, options: dict[str, Any],
                 repeats: int = 3) -> dict[str, float]:
    """Seconds of one update step of ``method``'s preconditioner on one process.

    Every timed step is an update step. Its stage times are split into the update
    (:data:`UPDATE_STAGES`, Table 1's computation column) and the preconditioning
    (:data:`APPLY_STAGES`: ``L⁻¹ ∇W R⁻¹`` is a product of ``d x d`` matrices for K-FAC and
    MKOR, whatever the update costs); the fastest of ``repeats`` is kept for each.

    Returns:
        ``{"update": seconds, "precondition": seconds}``.
    """
    settings = {k: v for k, v in options.items() if k not in ("strategy", "lr")}
    if method == "kfac":
        precond: Any = KFACPreconditioner(model, **{**settings, "factor_update_steps": 1,
                                                    "inv_update_steps": 1})
    elif method == "mkor":
        precond = MKORPreconditioner(model, **{**settings, "inv_update_steps": 1})
    elif method == "eva":
        precond = EvaPreconditioner(model, **{**settings, "factor_update_steps": 1})
    else:
        raise ValueError(f"no second-order update to time for {method!r}")
    best = {"update": float("inf"), "precondition": float("inf")}
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        loss_fn(model).backward()
        precond.step()
        last = precond.timer.last
        best["update"] = min(best["update"], sum(last.get(s, 0.0) for s in UPDATE_STAGES))
        best["precondition"] = min(best["precondition"],
                                   sum(last.get(s, 0.0) for s in APPLY_STAGES))
    precond.remove_hooks()
    return best


TABLE1_ROWS = 64
"""Rows of the batch M1 measures Table 1's layer on."""


def linear_layer(d: int, rows: int = TABLE1_ROWS, seed: int = 0) -> tuple[nn.Module, LossFn]:
    """One ``d x d`` linear layer and a loss on ``rows`` random inputs (Table 1's "layer")."""
    generator = torch.Generator().manual_seed(seed)
    layer = nn.Sequential(nn.Linear(d, d))
    x = torch.randn(rows, d, generator=generator)

    def loss(model: nn.Module) -> Tensor:
        return model(x).pow(2).mean()

    return layer, loss


def image_classifier(name: str = "resnet50", batch: int = 2, size: int = 64, seed: int = 0
                     ) -> tuple[nn.Module, LossFn]:
    """torchvision's ``name`` (1,000 ImageNet classes) and a cross-entropy loss on ``batch``
    random ``size x size`` images.

    The state of every method depends on the layers' shapes only (a convolution's factors are
    ``c_in·k_h·k_w (+1)`` and ``c_out`` wide, whatever the image size), so small images measure
    the state of ImageNet's 224 x 224 training exactly, and quickly.
    """
    from reproductions.common.shapes import torchvision_model

    torch.manual_seed(seed)
    model = torchvision_model(name)()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=generator)
    y = torch.randint(0, 1000, (batch,), generator=generator)

    def loss(m: nn.Module) -> Tensor:
        return nn.functional.cross_entropy(m(x), y)

    return model, loss
