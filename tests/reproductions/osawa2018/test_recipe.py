"""Each recipe component against its formula: schedules, momentum, rescaling, mixup, erasing."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core.config import ConfigError
from reproductions.osawa2018.config import load_config
from reproductions.osawa2018.erasing import RandomErasing
from reproductions.osawa2018.mixup import RunningMixup
from reproductions.osawa2018.models import build_model, small_resnet
from reproductions.osawa2018.momentum import HeavyBallSGD
from reproductions.osawa2018.rescaling import (
    add_weight_decay,
    rescale_weights,
    rescaled_weights,
)
from reproductions.osawa2018.schedule import IntervalSchedule, PolynomialDecay, epoch_at


def test_polynomial_decay_matches_the_formula() -> None:
    decay = PolynomialDecay(base_lr=8.18e-3, start_epoch=1, end_epoch=53, power=11)
    assert decay(0.0) == decay(0.999) == 8.18e-3
    for epoch in (1.0, 7.25, 35.0, 52.9):
        assert decay(epoch) == pytest.approx(8.18e-3 * (1 - (epoch - 1) / 52) ** 11, rel=1e-12)
    assert decay(53.0) == decay(80.0) == 0.0
    assert epoch_at(10_948, 4096, 1_281_167) == pytest.approx(35.0, abs=0.01)
    with pytest.raises(ConfigError, match="lr_decay_end_epoch"):
        PolynomialDecay(base_lr=0.1, start_epoch=5, end_epoch=5, power=2)


def test_interval_schedule_relaxes_updates() -> None:
    schedule = IntervalSchedule(((0, 1), (10, 5), (40, 20)))
    assert [schedule(s) for s in (0, 9, 10, 39, 40, 1000)] == [1, 1, 5, 5, 20, 20]
    updates = [s for s in range(70) if s % schedule(s) == 0]
    assert updates == [*range(10), 10, 15, 20, 25, 30, 35, 40, 60]
    from_epochs = IntervalSchedule.from_epochs([[0, 1], [1.5, 4], [2, 8]], steps_per_epoch=3.66)
    assert from_epochs.milestones == ((0, 1), (6, 4), (8, 8))
    for bad in ((), ((1, 1),), ((0, 1), (0, 2)), ((0, 0),)):
        with pytest.raises(ConfigError, match="factor_update_intervals"):
            IntervalSchedule(bad)


def test_heavy_ball_momentum_adjustment_follows_the_update_rule() -> None:
    param = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = HeavyBallSGD([param], lr=0.1, momentum=0.9, adjust_momentum=True)
    grads = [torch.tensor([0.5, 1.0]), torch.tensor([-1.0, 2.0]), torch.tensor([3.0, 0.5]),
             torch.tensor([1.0, 1.0])]
    rates = [0.1, 0.05, 0.05, 0.08]  # falls, stays, rises
    theta, v, previous = param.detach().clone(), torch.zeros(2), 0.1
    for g, lr in zip(grads, rates, strict=True):
        m = 0.9 * lr / previous if lr < previous else 0.9
        v = m * v - lr * g
        theta = theta + v
        previous = lr
        opt.param_groups[0]["lr"] = lr
        param.grad = g.clone()
        opt.step()
        assert torch.allclose(param.detach(), theta, atol=1e-7)
        assert opt.param_groups[0]["last_momentum"] == pytest.approx(m)
    restored = HeavyBallSGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    restored.load_state_dict(opt.state_dict())
    assert restored.param_groups[0]["previous_lr"] == 0.08


def test_heavy_ball_equals_torch_sgd_at_a_constant_rate() -> None:
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(5)), None
    b = nn.Parameter(a.detach().clone())
    ours = HeavyBallSGD([a], lr=0.05, momentum=0.9, adjust_momentum=True)
    ref = torch.optim.SGD([b], lr=0.05, momentum=0.9)
    for _ in range(5):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(a, b, atol=1e-6)


def test_weight_rescaling_caps_the_norm_at_sqrt_two_d_out() -> None:
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 3))
    weights = rescaled_weights(model)
    assert [w.shape[0] for w in weights] == [4, 3]  # no BatchNorm, no biases
    with torch.no_grad():
        weights[0].fill_(1.0)    # norm sqrt(72) > sqrt(2 * 4): rescaled
        weights[1].fill_(0.1)    # norm 0.1 * sqrt(12) < sqrt(2 * 3): kept
    rescale_weights(weights)
    assert float(weights[0].detach().norm()) == pytest.approx(math.sqrt(8.0), rel=1e-6)
    assert torch.allclose(weights[0], torch.full_like(weights[0], math.sqrt(8 / 72)))
    assert torch.equal(weights[1], torch.full_like(weights[1], 0.1))
    weights[1].grad = torch.ones_like(weights[1])
    add_weight_decay(weights, 0.5)
    assert torch.allclose(weights[1].grad, torch.full_like(weights[1], 1.05))


def test_running_mixup_mixes_with_the_previous_mixed_batch() -> None:
    torch.manual_seed(0)
    mixup = RunningMixup(alpha=0.4, num_classes=3, running=True)
    x1, y1 = torch.randn(4, 1, 2, 2), torch.tensor([0, 1, 2, 0])
    out1, t1 = mixup(x1, y1)
    assert torch.equal(out1, x1) and torch.equal(t1, nn.functional.one_hot(y1, 3).float())
    x2, y2 = torch.randn(4, 1, 2, 2), torch.tensor([2, 2, 1, 0])
    state = torch.get_rng_state()
    lam = mixup.sample_lambda(4)
    assert bool((lam >= 0.5).all() & (lam <= 1).all())
    torch.set_rng_state(state)
    out2, t2 = mixup(x2, y2)
    onehot2 = nn.functional.one_hot(y2, 3).float()
    assert torch.allclose(out2, lam.view(-1, 1, 1, 1) * x2 + (1 - lam.view(-1, 1, 1, 1)) * x1)
    assert torch.allclose(t2, lam.view(-1, 1) * onehot2 + (1 - lam.view(-1, 1)) * t1)
    assert torch.allclose(t2.sum(1), torch.ones(4))
    # running: the third batch's partner is the second batch after mixing (and transform)
    erase_all = lambda x: torch.zeros_like(x)  # noqa: E731
    mixup(torch.randn(4, 1, 2, 2), y1, transform=erase_all)
    assert torch.equal(mixup.previous[0], torch.zeros(4, 1, 2, 2))
    plain = RunningMixup(alpha=1.0, num_classes=3, running=False)
    plain(x1, y1)
    plain(x2, y2)
    assert torch.equal(plain.previous[0], x2)  # the raw batch, not the mixed one
    out_odd, _ = plain(torch.randn(3, 1, 2, 2), y1[:3])  # shape change: unmixed
    assert torch.equal(plain.previous[0], out_odd)
    with pytest.raises(ConfigError, match="mixup_alpha"):
        RunningMixup(alpha=0.0, num_classes=3)


def test_random_erasing_rectangles_follow_the_recipe() -> None:
    torch.manual_seed(0)
    erasing = RandomErasing(rate=0.5, area=(0.02, 0.25), min_aspect=0.3)
    x = torch.randn(400, 2, 20, 30).abs() + 1.0
    state = torch.get_rng_state()
    erase, top, left, h, w = erasing.rectangles(400, 20, 30)
    torch.set_rng_state(state)
    out = erasing(x)
    zero = out == 0
    assert torch.equal(zero[:, 0], zero[:, 1])  # every channel erased alike
    erased = zero[:, 0].flatten(1).any(1)
    assert torch.equal(erased, erase) and 150 < int(erase.sum()) < 250
    for i in torch.nonzero(erase).flatten().tolist():
        expected = torch.zeros(20, 30, dtype=torch.bool)
        expected[top[i]:top[i] + h[i], left[i]:left[i] + w[i]] = True
        assert torch.equal(zero[i, 0], expected)
        area = int(expected.sum())
        assert 0.02 * 600 * 0.5 <= area <= 0.25 * 600 * 1.5
    assert bool((top + h <= 20).all() & (left + w <= 30).all())
    assert torch.equal(RandomErasing(0.0, (0.02, 0.25), 0.3)(x), x)
    with pytest.raises(ConfigError, match="erasing_area"):
        RandomErasing(0.5, (0.3, 0.2), 0.3)


def test_models_have_the_expected_layers() -> None:
    small = small_resnet()
    assert sum(isinstance(m, nn.Conv2d) for m in small.modules()) == 9
    assert small(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    big = build_model("resnet50", num_classes=1000, in_channels=3)
    counts = [sum(isinstance(m, t) for m in big.modules())
              for t in (nn.Conv2d, nn.BatchNorm2d, nn.Linear)]
    assert counts == [53, 53, 1]
    with pytest.raises(ValueError, match="3-channel"):
        build_model("resnet50", num_classes=10, in_channels=1)


@pytest.mark.parametrize("alpha", [5e-79, 1e-3])
def test_a_mixup_alpha_below_what_the_sampler_supports_is_refused(alpha: float) -> None:
    """PyTorch's Beta sampler drifts to λ = 1/2 below α ≈ 0.01 (mixing everything half and
    half where it should mix nothing): such an α is refused, naming the field."""
    with pytest.raises(ConfigError, match="mixup_alpha"):
        RunningMixup(alpha=alpha, num_classes=3)
    with pytest.raises(ConfigError, match=r"mixup_alpha.*0 \(no mixup\) or at least 0.01"):
        load_config("fmnist_default", {"mixup_alpha": alpha})
    assert load_config("fmnist_default", {"mixup_alpha": 0}).mixup_alpha == 0


def test_polynomial_decay_edges_that_the_config_accepts() -> None:
    """``p = 0``: constant until ``e_end`` and 0 from it; ``lr = 0`` and ``e_start = 0`` are
    valid schedules, as :class:`OsawaConfig` accepts them; the first update is at epoch 0."""
    flat = PolynomialDecay(0.1, 1, 5, 0)
    assert flat(4.99) == pytest.approx(0.1) and flat(5.0) == 0.0
    assert PolynomialDecay(0.0, 1, 5, 2)(0.5) == 0.0
    assert PolynomialDecay(0.1, 0, 5, 2)(0.0) == pytest.approx(0.1)
    assert epoch_at(0, 256, 60_000) == 0.0 and epoch_at(3, 256, 60_000) == 3 * 256 / 60_000
