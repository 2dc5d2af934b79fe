"""The DP-KFAC paper's 64-GPU workloads and the schemes it compares, as shapes and options.

The workloads are :class:`~reproductions.common.shapes.Workload` objects (models built on the
``meta`` device, per-GPU batch, image size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from reproductions.common.shapes import Workload, torchvision_model


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name)
    return build


WORKLOADS: tuple[Workload, ...] = (
    Workload("resnet50", "ResNet-50", torchvision_model("resnet50"), 32, 224,
             "torchvision; 32 images per GPU (batch.sh, PAPERS.md §4.3)"),
    Workload("resnet152", "ResNet-152", torchvision_model("resnet152"), 32, 224,
             "torchvision; the scripts give no ResNet-152 batch: ResNet-50's 32 is used"),
    Workload("densenet201", "DenseNet-201", torchvision_model("densenet201"), 16, 224,
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
class Scheme:
    """One distributed K-FAC scheme of the comparison.

    Attributes:
        label: Name in tables.
        strategy: ``core`` strategy name.
        options: Further :class:`~core.config.KFACConfig` fields.
        note: What it is and whose code it follows.
        split_when_more_workers: Place a layer's ``A`` and ``G`` on different workers only when
            there are more workers than layers, as the ``eigen`` preconditioner of
            lzhangbv/kfac_pytorch does by default (``distribute_layer_factors=None``); else
            together. :meth:`options_for` fills ``colocate_factors`` from it.
    """

    label: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    split_when_more_workers: bool = False

    def options_for(self, layers: int, world_size: int, inverse_method: str = "eigen"
                    ) -> dict[str, Any]:
        """:attr:`options` for a model of ``layers`` K-FAC layers on ``world_size`` workers
        decomposing by ``inverse_method`` (pre-divided eigenvalues, KAISA's default, only
        where that is ``eigen``)."""
        options = dict(self.options)
        if inverse_method != "eigen":
            options.pop("prediv_eigenvalues", None)
        if self.split_when_more_workers:
            options["colocate_factors"] = world_size <= layers
        return options


HYBRID_FRACTION = 0.25
"""KAISA HYBRID-OPT's gradient-worker fraction here (16 of 64 workers per layer)."""
KAISA_OPTIONS: dict[str, Any] = {"prediv_eigenvalues": True}
"""KAISA's default ``compute_eigenvalue_outer_product=True``: its eigen state holds and sends
``1/(d_G d_Aᵀ + λ)`` instead of the eigenvalues (PAPERS.md §3.2-3.3)."""

SCHEMES: tuple[Scheme, ...] = (
    Scheme("D-KFAC", "d-kfac", {},
           "factors all-reduced; every worker inverts every layer"),
    Scheme("MPD-KFAC", "mpd-kfac", {"assignment": "round-robin"},
           "lzhangbv/kfac_pytorch `inverse`: layer l inverted on rank l mod P, which broadcasts "
           "its preconditioned gradient"),
    Scheme("MPD-KFAC (eigen)", "comm-opt", {"assignment": "round-robin"},
           "lzhangbv/kfac_pytorch `eigen`: with more workers than layers factor j (a layer's A, "
           "then its G) is decomposed on rank j mod P, else layer l's two on rank l mod P (its "
           "default `distribute_layer_factors=None`); that rank broadcasts the eigenbases and "
           "eigenvalues to every worker", split_when_more_workers=True),
    Scheme("KAISA COMM-OPT", "comm-opt", KAISA_OPTIONS,
           "KAISA f = 1: greedy n³ placement, eigenbases and pre-divided eigenvalues "
           "broadcast to all"),
    Scheme("KAISA HYBRID-OPT", "hybrid-opt",
           KAISA_OPTIONS | {"grad_worker_fraction": HYBRID_FRACTION},
           f"KAISA f = {HYBRID_FRACTION}, pre-divided eigenvalues"),
    Scheme("KAISA MEM-OPT", "mem-opt", KAISA_OPTIONS,
           "KAISA f = 1/P: greedy n³ placement, preconditioned gradient broadcast"),
    Scheme("DP-KFAC", "dp-kfac", {"assignment": "round-robin"},
           "lzhangbv/kfac_pytorch `eigen_dp`: owner l mod P builds layer l's factors from its "
           "own batch, inverts, preconditions and broadcasts"),
)

DP_KFAC = SCHEMES[-1]
BASELINES = SCHEMES[:-1]
