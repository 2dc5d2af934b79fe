"""Every method on every available device against the same run in float64 on the CPU.

The CPU takes its own kernels in places (BLAS ``syrk`` for factors, LAPACK in place for
inverses), a GPU the device-generic ones; both must give the float64 reference's update to
fp32 precision. On a machine without CUDA the ``cuda`` cases are skipped (CI has no GPU);
``scripts/gpu_check.sh`` runs this module on a lent GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core import build_optimizer


@pytest.fixture(params=[
    "cpu",
    "cpu-generic",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The device to run on; ``cpu-generic`` is the CPU with its own kernels switched off, so
    the path a GPU takes (block GEMMs for factors, out-of-place decompositions) runs here."""
    if request.param == "cpu-generic":
        monkeypatch.setattr("core.factors.HOST_SYRK", False)
        monkeypatch.setattr("core.inverse.HOST_IN_PLACE", False)
        return "cpu"
    if request.param == "cuda":  # fp32 products in fp32: TF32 (Ampere on) errs by ~1e-3
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    return str(request.param)


KFAC_FP64 = {"factor_dtype": "float64", "inverse_dtype": "float64"}
#: Damping that keeps the damped factors' condition number moderate, so fp32 and bf16 runs
#: can be held to tolerances of their own precision.
DAMPING = {"damping": 0.03}
#: (optimizer, options of the run under test, options the float64 reference adds).
METHODS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "kfac-eigen": ("kfac", {"inverse_method": "eigen", **DAMPING}, KFAC_FP64),
    "kfac-inverse": ("kfac", {"inverse_method": "inverse", **DAMPING}, KFAC_FP64),
    "kfac-solve": ("kfac", {"inverse_method": "cholesky_solve", **DAMPING}, KFAC_FP64),
    "kfac-in-backward": ("kfac", {"inverse_method": "inverse", "factors_in_backward": True,
                                  **DAMPING}, KFAC_FP64),
    "dp-kfac": ("kfac", {"inverse_method": "inverse", "strategy": "dp-kfac",
                         "factor_scaling": "dpkfac", "damping_split": "pi", **DAMPING}, KFAC_FP64),
    "mkor": ("mkor", {}, {"dtype": "float64"}),
    "eva": ("eva", {}, {"dtype": "float64"}),
}


class ConvNet(nn.Module):
    """A strided, padded, dilated convolution (with bias, its ``A`` from patch rows), a stride-1
    one (``A`` from shifted views of its input, core.conv_gram), and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=2, dilation=2)
        self.same = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.fc = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.same(torch.tanh(self.conv(x)))).flatten(1))


def _updates(device: str, dtype: torch.dtype, name: str, options: dict[str, Any],
             autocast: bool = False) -> list[Tensor]:
    """Each parameter's change over three steps (updates every step), on the CPU in float64."""
    torch.manual_seed(0)
    model = ConvNet().to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (8,), generator=gen)
    x, y = x.to(device=device, dtype=dtype), y.to(device)
    opt = build_optimizer(name, model, lr=0.1, **options)
    before = [p.detach().double().cpu().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(loss)
    return [p.detach().double().cpu() - b for p, b in zip(model.parameters(), before,
                                                          strict=True)]


@functools.cache
def _reference(method: str) -> list[Tensor]:
    """The float64 run on the CPU's own kernels, whichever path the case under test takes."""
    name, options, fp64 = METHODS[method]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("core.factors.HOST_SYRK", True)
        patch.setattr("core.inverse.HOST_IN_PLACE", True)
        return _updates("cpu", torch.float64, name, {**options, **fp64})


def _relative_error(got: list[Tensor], expected: list[Tensor]) -> float:
    return max(float((g - e).norm() / e.norm()) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_fp32_update_on_the_device_matches_float64_on_the_cpu(device: str, method: str) -> None:
    name, options, _ = METHODS[method]
    got = _updates(device, torch.float32, name, options)
    assert _relative_error(got, _reference(method)) < 1e-4


@pytest.mark.parametrize("method", ["kfac-inverse", "dp-kfac"])
def test_bf16_state_on_the_device_stays_near_float64_on_the_cpu(device: str, method: str) -> None:
    """bf16 state (KAISA's ``inv_dtype``): within a few bf16 roundings of the reference."""
    name, options, _ = METHODS[method]
    got = _updates(device, torch.float32, name,
                   {**options, "precondition_dtype": "bfloat16",
                    "precondition_dtype_tolerance": None})
    assert _relative_error(got, _reference(method)) < 5e-2


@pytest.mark.parametrize("method", ["kfac-eigen", "mkor"])
def test_bf16_autocast_on_the_device_stays_near_float64_on_the_cpu(device: str,
                                                                  method: str) -> None:
    """A bf16 forward and backward (autocast) moves the update by bf16 rounding only: the
    factors are still accumulated in fp32. bf16 rounds each product to 2⁻⁸ relative, and the
    rounding compounds through the three layers' forward and backward (1.1% for K-FAC eigen)."""
    name, options, _ = METHODS[method]
    got = _updates(device, torch.float32, name, options, autocast=True)
    assert _relative_error(got, _reference(method)) < 2e-2


def test_stage_times_are_recorded_on_the_device(device: str) -> None:
    """Host clock on the CPU, device events on a GPU: each stage a step runs has a time."""
    torch.manual_seed(0)
    model = ConvNet().to(device)
    opt = build_optimizer("kfac", model, lr=0.1)
    x, y = torch.randn(4, 3, 8, 8, device=device), torch.randint(0, 5, (4,), device=device)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    times = opt.preconditioner.timer.last
    assert all(times[stage] > 0 for stage in ("factors", "inversion", "precondition", "scale"))
