"""Optimizers by name: first-order baselines and the papers' second-order compositions.

``build_optimizer("mkor", model, lr=..., weight_decay=..., base="lamb")`` gives MKOR's
preconditioner feeding LAMB, as in the MKOR paper's BERT runs. The names:

* ``sgd``, ``adamw``, ``lamb``: ``torch.optim.SGD`` (momentum), ``torch.optim.AdamW``,
  ``timm.optim.Lamb`` (the MKOR paper's first-order baseline), alone.
* ``kfac``, ``mkor``, ``eva``: :class:`~core.KFACPreconditioner`,
  :class:`~core.MKORPreconditioner` or :class:`~core.eva.EvaPreconditioner` rewrites the
  gradients, then the base optimizer (``base=``, default ``sgd``) steps.
* ``mkor-h``: MKOR inside :class:`~core.hybrid.HybridSwitch`, which drops to the base optimizer
  alone once second order stops paying; ``step(loss)`` feeds it the loss.

The first-order optimizers come from maintained libraries (torch, timm). For ``lamb`` and
``adamw`` bases, weight decay is not applied to biases and LayerNorm parameters (as BERT's
recipes do); ``sgd`` decays every parameter (as the ResNet recipes do). K-FAC's and Eva's KL
clip read the base optimizer's current learning rate, so an LR schedule on ``.base`` reaches
them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor, nn

from core.config import ConfigError, KFACConfig, check_choice, check_number, config_from_options
from core.eva import EvaConfig, EvaPreconditioner
from core.hybrid import HybridConfig, HybridSwitch
from core.mkor import MKORConfig, MKORPreconditioner
from core.preconditioner import KFACPreconditioner

FIRST_ORDER = ("sgd", "adamw", "lamb")
SECOND_ORDER = ("kfac", "mkor", "mkor-h", "eva")
OPTIMIZERS = FIRST_ORDER + SECOND_ORDER


def _no_decay(name: str, module: nn.Module) -> bool:
    return name.endswith("bias") or isinstance(module, nn.LayerNorm)


def _named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """``(qualified name, owning module, parameter)`` of every trainable parameter, once each."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                yield (f"{module_name}.{name}" if module_name else name), module, param


def parameter_groups(model: nn.Module, weight_decay: float, *, exclude_bias_and_norm: bool
                     ) -> list[dict[str, Any]]:
    """Parameter groups with ``weight_decay``; optionally none for biases and LayerNorms."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, module, param in _named_parameters(model):
        (no_decay if exclude_bias_and_norm and _no_decay(name, module) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_first_order(name: str, model: nn.Module, *, lr: float, weight_decay: float,
                      momentum: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    """``sgd``, ``adamw`` or ``lamb`` over ``model``'s trainable parameters."""
    check_choice("base", name, FIRST_ORDER)
    if name == "sgd":
        groups = parameter_groups(model, weight_decay, exclude_bias_and_norm=False)
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    groups = parameter_groups(model, weight_decay, exclude_bias_and_norm=True)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    from timm.optim import Lamb  # timm takes seconds to import; only LAMB's users pay for it

    return Lamb(groups, lr=lr, betas=betas)


class SecondOrderOptimizer:
    """A preconditioner (or none) followed by a first-order optimizer, stepped together.

    Args:
        name: The name it was built under (see :data:`OPTIMIZERS`).
        base: The first-order optimizer that applies the update.
        preconditioner: What rewrites ``.grad`` before ``base.step()``; None for first-order
            names. For ``mkor-h`` it is the :class:`~core.hybrid.HybridSwitch` around MKOR.

    Attributes:
        param_groups: ``base.param_groups`` (schedulers adjust ``lr`` there; pass ``.base`` to
            ``torch.optim.lr_scheduler`` and transformers' schedules).
    """

    def __init__(self, name: str, base: torch.optim.Optimizer, preconditioner: Any = None
                 ) -> None:
        self.name = name
        self.base = base
        self.preconditioner = preconditioner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.base.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the first-order optimizer. The preconditioner's layers are
        fixed when it is built: a weight frozen then, and unfrozen later, is updated
        first-order."""
        self.base.add_param_group(param_group)

    def step(self, loss: float | Tensor | None = None) -> None:
        """Precondition the gradients (feeding ``loss`` to MKOR-H's switch), then update.

        Raises:
            ValueError: for ``mkor-h`` without a loss (its switch needs every step's loss).
        """
        if isinstance(self.preconditioner, HybridSwitch):
            if loss is None:
                raise ValueError("mkor-h needs the step's loss: call step(loss)")
            self.preconditioner.observe(float(loss.detach() if isinstance(loss, Tensor) else loss))
        if self.preconditioner is not None:
            self.preconditioner.step()
        self.base.step()

    def skip_step(self) -> None:
        """Tell the preconditioner that this step's update was skipped without :meth:`step`
        (call it when a ``GradScaler`` skipped ``optimizer.step()`` on an overflow: its
        ``get_scale()`` fell in ``update()``), so the statistics captured in the step are
        dropped instead of entering the next update."""
        skip = getattr(self.preconditioner, "skip_step", None)
        if skip is not None:
            skip()

    def no_capture(self) -> AbstractContextManager[None]:
        """A context in which forward passes add nothing to the preconditioner's statistics
        (an adversarial example's, a gradient penalty's forward pass of its own); nothing to
        pause for first-order names."""
        return nullcontext() if self.preconditioner is None else self.preconditioner.no_capture()

    def metrics(self) -> dict[str, float]:
        """The preconditioner's metrics and the base's learning rate."""
        out: dict[str, float] = {"lr": float(self.base.param_groups[0]["lr"])}
        if self.preconditioner is not None:
            out.update(self.preconditioner.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Both states: ``{"name", "base", "preconditioner"}``.

        The preconditioner's part is a copy; the base's is PyTorch's ``Optimizer.state_dict``,
        whose tensors are the live state, which the next step updates in place: for an
        in-memory checkpoint (a rollback without ``torch.save``), ``copy.deepcopy`` the result.
        """
        return {
            "name": self.name,
            "base": self.base.state_dict(),
            "preconditioner": (None if self.preconditioner is None
                               else self.preconditioner.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output saved under the same name."""
        if state["name"] != self.name:
            raise ValueError(f"optimizer state was saved by {state['name']!r}, this is "
                             f"{self.name!r}")
        self.base.load_state_dict(state["base"])
        if self.preconditioner is not None:
            self.preconditioner.load_state_dict(state["preconditioner"])


def _split_hybrid(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``mkor-h`` options as (``HybridConfig``'s, ``MKORConfig``'s)."""
    hybrid_keys = {f.name for f in fields(HybridConfig)}
    return ({k: v for k, v in options.items() if k in hybrid_keys},
            {k: v for k, v in options.items() if k not in hybrid_keys})


def check_preconditioner_options(name: str, options: dict[str, Any]) -> None:
    """Validate :func:`build_optimizer`'s preconditioner options for ``name`` without a model,
    so that an entry point can refuse a bad one before it loads data or a model.

    Raises:
        ConfigError: an unknown optimizer, an option the method does not have, or an invalid
            value (naming the field and what it accepts).
    """
    check_choice("name", name, OPTIMIZERS)
    if name in FIRST_ORDER:
        if options:
            key = sorted(options)[0]
            raise ConfigError(key, options[key],
                              f"no preconditioner options for the first-order {name!r}")
        return
    options = {k: v for k, v in options.items() if k != "grad_scaler"}  # not a config field
    if name == "mkor-h":
        hybrid, mkor = _split_hybrid(options)
        config_from_options(HybridConfig, None, hybrid)
        config_from_options(MKORConfig, None, mkor)
        return
    config_type = {"kfac": KFACConfig, "eva": EvaConfig, "mkor": MKORConfig}[name]
    config_from_options(config_type, None, options)


def build_optimizer(name: str, model: nn.Module, *, lr: float, weight_decay: float = 0.0,
                    momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999),
                    base: str | None = None, **precond_options: Any) -> SecondOrderOptimizer:
    """The optimizer ``name`` over ``model``, composed as its paper does.

    Args:
        name: One of :data:`OPTIMIZERS`.
        model: The model (its trainable parameters are optimized; preconditioners hook into it).
        lr: Learning rate of the first-order optimizer.
        weight_decay: Weight decay (not on biases and LayerNorms for ``lamb``/``adamw``).
        momentum: SGD momentum.
        betas: Adam/LAMB moment coefficients.
        base: First-order optimizer under a second-order name (``sgd``, ``lamb``, ``adamw``);
            defaults to ``sgd``. For a first-order name it must be None or the name itself.
        **precond_options: Options of the preconditioner's config (``KFACConfig``,
            ``MKORConfig``, ``EvaConfig``); for ``mkor-h`` also ``HybridConfig``'s
            (``window``, ``threshold``, ``min_steps``); and ``grad_scaler``, an AMP
            ``GradScaler`` whose scale the preconditioner divides out of its statistics.

    Raises:
        ConfigError: for an unknown name (the message lists the valid ones), a bad base or an
            option the chosen method does not have.
    """
    check_choice("name", name, OPTIMIZERS)
    check_number("lr", lr, low=0.0)
    check_number("weight_decay", weight_decay, low=0.0)
    if name in FIRST_ORDER:
        if base not in (None, name):
            raise ConfigError("base", base, f"None or {name!r} for the first-order {name!r}")
        if precond_options:
            key = sorted(precond_options)[0]
            raise ConfigError(key, precond_options[key],
                              f"no preconditioner options for the first-order {name!r}")
        optimizer = build_first_order(name, model, lr=lr, weight_decay=weight_decay,
                                      momentum=momentum, betas=betas)
        return SecondOrderOptimizer(name, optimizer)

    first_order = build_first_order(base or "sgd", model, lr=lr, weight_decay=weight_decay,
                                    momentum=momentum, betas=betas)

    def current_lr(step: int) -> float:
        return float(first_order.param_groups[0]["lr"])

    preconditioner: Any
    if name == "kfac":
        preconditioner = KFACPreconditioner(model, **{"lr": current_lr, **precond_options})
    elif name == "eva":
        preconditioner = EvaPreconditioner(model, **{"lr": current_lr, **precond_options})
    elif name == "mkor":
        preconditioner = MKORPreconditioner(model, **precond_options)
    else:  # mkor-h
        hybrid, mkor = _split_hybrid(precond_options)
        preconditioner = HybridSwitch(MKORPreconditioner(model, **mkor), **hybrid)
    return SecondOrderOptimizer(name, first_order, preconditioner)

