"""Numerical faults: a real AMP ``GradScaler`` overflow, a NaN activation in the middle of the
Osawa et al. training loop, and singular factors. In each the bad update is skipped and counted,
the last good statistics are kept, and training continues with finite values."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core import EvaPreconditioner, KFACPreconditioner, MKORPreconditioner
from reproductions.osawa2018.config import OsawaConfig
from reproductions.osawa2018.trainer import OsawaTrainer

PRECONDITIONERS = {
    "kfac": lambda model, scaler: KFACPreconditioner(model, grad_scaler=scaler, kl_clip=None),
    "mkor": lambda model, scaler: MKORPreconditioner(model, grad_scaler=scaler,
                                                     inv_update_steps=1),
    "eva": lambda model, scaler: EvaPreconditioner(model, grad_scaler=scaler),
}


def statistics(precond: object) -> list[torch.Tensor]:
    """Every tensor the preconditioner keeps between steps (factors, inverses, vectors)."""
    found: list[torch.Tensor] = []

    def collect(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value.clone())
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list | tuple):
            for item in value:
                collect(item)

    collect(precond.state_dict()["layers"])  # type: ignore[attr-defined]
    return found


@pytest.mark.parametrize("name", sorted(PRECONDITIONERS))
def test_gradscaler_overflow_step_leaves_statistics_untouched(name: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = PRECONDITIONERS[name](model, scaler)
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def train_step(inputs: torch.Tensor) -> None:
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(inputs), y)).backward()
        scaler.unscale_(optimizer)
        precond.step()
        scaler.step(optimizer)
        scaler.update()

    train_step(x)
    before_stats = statistics(precond)
    assert before_stats, "the first step must have built statistics to protect"
    before_params = copy.deepcopy(model.state_dict())
    scale = scaler.get_scale()
    train_step(x * 1e38)  # overflows in the scaled backward pass, as an fp16 overflow does
    assert scaler.get_scale() < scale, "the scaler saw the overflow"
    for kept, old in zip(statistics(precond), before_stats, strict=True):
        assert torch.equal(kept, old)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before_params[key]), "the optimizer skipped the step"
    assert precond.metrics()["skipped_overflow_steps"] == 1
    train_step(x)  # and training continues with finite gradients and statistics
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(t).all() for t in statistics(precond))


def train_step(model: nn.Module, precond: KFACPreconditioner, x: torch.Tensor,
               y: torch.Tensor) -> None:
    """Backward of an MSE loss and a preconditioner step (the gradients are left in ``.grad``)."""
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    precond.step()


@pytest.mark.parametrize("method", ["cholesky", "inverse", "cholesky_solve"])
def test_singular_factor_beyond_fp32_keeps_the_last_good_inverse(method: str) -> None:
    """All-zero input rows make ``A = 0``; with a damping too small to regularise it, the damped
    inverse is ~1e40, beyond fp32 even when the fp64 retry computes it (``cholesky_solve``: its
    factor, 1e-20·I, fits fp32, but the inverse it stands for does not): the update is skipped
    and counted, the last good inverse is kept, and the gradients stay finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 2, bias=False))
    precond = KFACPreconditioner(model, inverse_method=method, damping_split="full",
                                 damping=1e-40, factor_decay=0.0, kl_clip=None)
    y = torch.randn(8, 2)
    train_step(model, precond, torch.randn(8, 4), y)
    good = [[t.clone() for t in layer.state.tensors()] for layer in precond.layers]
    with pytest.warns(UserWarning, match=f"{method} failed.*keeping the last good inverse"):
        train_step(model, precond, torch.zeros(8, 4), y)  # tanh(0) = 0: both layers' A = 0
    assert precond.metrics()["decomposition_failures"] == 2
    for layer, before in zip(precond.layers, good, strict=True):
        for kept, old in zip(layer.state.tensors(), before, strict=True):
            assert torch.equal(kept, old)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    train_step(model, precond, torch.randn(8, 4), y)  # and the next good batch is used
    assert precond.metrics()["decomposition_failures"] == 2
    assert not torch.equal(precond.layers[0].state.tensors()[0], good[0][0])


def test_singular_factor_that_fails_fp32_cholesky_is_inverted_in_fp64() -> None:
    """Constant input rows make ``A`` rank one; its damped fp32 Cholesky fails, the fp64 retry
    succeeds and gives the exact damped inverse, so nothing is lost or counted."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2, bias=False)
    damping = 1e-4
    precond = KFACPreconditioner(model, inverse_method="cholesky", damping_split="full",
                                 damping=damping, factor_decay=0.0, kl_clip=None)
    train_step(model, precond, torch.full((8, 5), 100.0), torch.randn(8, 2))
    a = torch.full((5, 5), 1e4)  # (1/B) Σ x xᵀ of the rows of 100s
    _, info = torch.linalg.cholesky_ex(a + damping * torch.eye(5))
    assert int(info) != 0, "the damped factor must defeat an fp32 Cholesky"
    expected = torch.linalg.inv(a.double() + damping * torch.eye(5, dtype=torch.float64))
    assert precond.metrics()["decomposition_failures"] == 0
    torch.testing.assert_close(precond.layers[0].state.tensors()[0], expected.float(),
                               rtol=1e-4, atol=0.0)


def test_nan_activation_mid_network_skips_the_update_and_training_continues() -> None:
    """The recipe's trainer (K-FAC, BatchNorm Fisher, running mixup, erasing) with a forward hook
    that puts a NaN into the first residual stage's output at the third update."""
    torch.manual_seed(0)
    config = OsawaConfig(width=4, batch_size=8, micro_batch_size=4, epochs=1.0)
    trainer = OsawaTrainer(config, num_classes=3, in_channels=1, dataset_size=64,
                           device=torch.device("cpu"))
    assert trainer.kfac is not None and trainer.bn is not None and trainer.mixup is not None
    poison = {"on": False}

    def inject_nan(module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        if not poison["on"]:
            return output
        output = output.clone()
        output[0, 0, 0, 0] = float("nan")
        return output

    trainer.model[3].register_forward_hook(inject_nan)
    batches = [[(torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))) for _ in range(2)]
               for _ in range(6)]
    losses = [trainer.train_step(batches[step])["loss"] for step in range(2)]
    before = copy.deepcopy(trainer.model.state_dict())
    factors = statistics(trainer.kfac) + [b.fisher.value.clone() for b in trainer.bn.blocks]
    remembered = trainer.mixup.previous
    poison["on"] = True
    with pytest.warns(RuntimeWarning, match="step 3: non-finite gradients, update skipped"), \
            pytest.warns(UserWarning, match="non-finite Fisher batch skipped"):
        losses.append(trainer.train_step(batches[2])["loss"])
    poison["on"] = False
    assert losses[2] != losses[2], "the poisoned step's loss is NaN"
    for key, value in trainer.model.state_dict().items():  # weights and BatchNorm statistics
        assert torch.equal(value, before[key]), key
    kept = statistics(trainer.kfac) + [b.fisher.value for b in trainer.bn.blocks]
    assert all(torch.equal(k, f) for k, f in zip(kept, factors, strict=True))
    assert trainer.mixup.previous is remembered
    metrics = trainer.metrics()
    assert metrics["skipped_steps"] == 1 and metrics["kfac/skipped_overflow_steps"] == 1
    assert metrics["bn/nonfinite_skips"] == len(trainer.bn.blocks)
    losses += [trainer.train_step(batches[step])["loss"] for step in range(3, 6)]
    assert trainer.step == 6 and trainer.skipped_steps == 1
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses[3:])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.metrics()["bn/preconditioned_layers"] == len(trainer.bn.blocks)
