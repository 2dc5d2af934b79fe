"""Models at a per-GPU batch, as the shapes that FLOP counts and kernel timings need.

Models are built on the ``meta`` device (shapes, no memory); one ``meta`` forward pass at the
per-GPU batch gives each K-FAC layer's factor rows (``B`` for a Linear layer, ``B·L`` for a
convolution with ``L`` output locations). Shared by the reproductions' modelled tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
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


def torchvision_model(name: str) -> Callable[[], nn.Module]:
    """A builder of torchvision's model ``name`` (imported on first use: it is slow to load)."""
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)()
    return build


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
