"""The DP-KFAC paper's 64-GPU workloads and the schemes it compares, as shapes and options.

Models are built on the ``meta`` device (shapes, no memory); one ``meta`` forward pass at the
per-GPU batch gives each K-FAC layer's factor rows (``B`` for a Linear layer, ``B·L`` for a
convolution with ``L`` output locations), which the FLOP counts and kernel timings need.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from core.layers import helper_for
from core.preconditioner import discover_layers

META = torch.device("meta")


@dataclass(frozen=True)
class Workload:
    """A model at the per-GPU batch of the paper's efficiency runs.

    Attributes:
        key: Short name (``"resnet50"``).
        label: Name in tables (``"ResNet-50"``).
        build: Builds the model (on the current default device).
        batch: Images per GPU.
        image_size: Input height and width.
        note: Where ``batch`` and ``image_size`` come from.
    """

    key: str
    label: str
    build: Callable[[], nn.Module]
    batch: int
    image_size: int
    note: str

    def meta_model(self) -> nn.Module:
        """The model on the ``meta`` device."""
        with META:
            return self.build()


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)()
    return build


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name)
    return build


WORKLOADS: tuple[Workload, ...] = (
    Workload("resnet50", "ResNet-50", _torchvision("resnet50"), 32, 224,
             "torchvision; 32 images per GPU (batch.sh, PAPERS.md §4.3)"),
    Workload("resnet152", "ResNet-152", _torchvision("resnet152"), 32, 224,
             "torchvision; the scripts give no ResNet-152 batch: ResNet-50's 32 is used"),
    Workload("densenet201", "DenseNet-201", _torchvision("densenet201"), 16, 224,
             "torchvision; 16 images per GPU (batch.sh)"),
    Workload("inception_v4", "Inception-v4", _timm("inception_v4"), 16, 299,
             "timm `inception_v4`; 16 images per GPU (batch.sh), 299×299 inputs"),
)


def workload(key: str) -> Workload:
    """The workload named ``key``."""
    for w in WORKLOADS:
        if w.key == key:
            return w
    raise KeyError(f"unknown workload {key!r}; choose among "
                   + ", ".join(w.key for w in WORKLOADS))


@dataclass(frozen=True)
class LayerShape:
    """One K-FAC layer at a given batch.

    Attributes:
        name: Module name.
        a_dim: Dimension of ``A``.
        g_dim: Dimension of ``G``.
        rows: Factor rows per batch: ``B`` (Linear; ``B·T`` for inputs with positions),
            ``B·L`` (Conv2d, ``L`` output locations); a module called twice counts twice.
    """

    name: str
    a_dim: int
    g_dim: int
    rows: int


def layer_shapes(model: nn.Module, batch: int, image_size: int) -> list[LayerShape]:
    """Every K-FAC layer of ``model`` (model order) with its factor rows at ``batch``.

    Args:
        model: The model, on ``meta`` or any device (a forward pass on ``meta`` inputs needs a
            ``meta`` model).
        batch: Images per batch.
        image_size: Input height and width (3 channels).
    """
    found = discover_layers(model, ())
    rows: dict[str, int] = {}

    def record(name: str) -> Callable[[nn.Module, Any, Tensor], None]:
        def hook(module: nn.Module, inputs: Any, output: Tensor) -> None:
            del inputs
            positions = (output.shape[:1] + output.shape[2:] if isinstance(module, nn.Conv2d)
                         else output.shape[:-1])
            rows[name] = rows.get(name, 0) + math.prod(positions)
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in found]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model(torch.empty(batch, 3, image_size, image_size, device=device))
    finally:
        for handle in handles:
            handle.remove()
    shapes = []
    for name, module in found:
        helper = helper_for(module)
        assert helper is not None, "discover_layers returns supported modules only"
        shapes.append(LayerShape(name, helper.a_dim, helper.g_dim, rows.get(name, 0)))
    return shapes


@dataclass(frozen=True)
class Scheme:
    """One distributed K-FAC scheme of the comparison.

    Attributes:
        label: Name in tables.
        strategy: ``core`` strategy name.
        options: Further :class:`~core.config.KFACConfig` fields.
        note: What it is and whose code it follows.
    """

    label: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    note: str = ""


HYBRID_FRACTION = 0.25
"""KAISA HYBRID-OPT's gradient-worker fraction here (16 of 64 workers per layer)."""

SCHEMES: tuple[Scheme, ...] = (
    Scheme("D-KFAC", "d-kfac", {},
           "factors all-reduced; every worker inverts every layer"),
    Scheme("MPD-KFAC", "mpd-kfac", {"assignment": "round-robin"},
           "lzhangbv/kfac_pytorch `inverse`: layer l inverted on rank l mod P, which broadcasts "
           "its preconditioned gradient"),
    Scheme("KAISA COMM-OPT", "comm-opt", {},
           "KAISA f = 1: greedy n³ placement, eigen state broadcast to all"),
    Scheme("KAISA HYBRID-OPT", "hybrid-opt", {"grad_worker_fraction": HYBRID_FRACTION},
           f"KAISA f = {HYBRID_FRACTION}"),
    Scheme("KAISA MEM-OPT", "mem-opt", {},
           "KAISA f = 1/P: greedy n³ placement, preconditioned gradient broadcast"),
    Scheme("DP-KFAC", "dp-kfac", {"assignment": "round-robin"},
           "lzhangbv/kfac_pytorch `eigen_dp`: owner l mod P builds layer l's factors from its "
           "own batch, inverts, preconditions and broadcasts"),
)

DP_KFAC = SCHEMES[-1]
BASELINES = SCHEMES[:-1]
