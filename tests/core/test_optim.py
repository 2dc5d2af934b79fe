"""The optimizer factory: every name builds and steps; state round trips; groups; schedules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.optim import Lamb
from torch import nn

from core import ConfigError, EvaPreconditioner, HybridSwitch, build_optimizer
from core.optim import OPTIMIZERS, check_preconditioner_options

torch.set_num_threads(1)


class Tiny(nn.Module):
    """Conv, LayerNorm and Linear: something for every optimizer to precondition or exclude."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.norm = nn.LayerNorm(12)
        self.fc = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(F.relu(self.conv(x)).flatten(1)))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 2, 4, 4, generator=gen), torch.randint(0, 4, (6,), generator=gen))
            for _ in range(n)]


def _make(name: str, **kwargs: object) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = Tiny()
    options = {"window": 1, "min_steps": 3} if name == "mkor-h" else {}
    options.update(kwargs)
    return model, build_optimizer(name, model, lr=0.05, weight_decay=0.01, **options)


def _train(model: nn.Module, opt: object, batches: list) -> None:
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(loss)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_name_builds_and_steps(name: str) -> None:
    model, opt = _make(name)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, _batches(1))
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert opt.metrics()["lr"] == 0.05


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_round_trip_gives_an_identical_next_step(name: str) -> None:
    batches = _batches(4)
    model, opt = _make(name)
    _train(model, opt, batches[:3])
    # Deep copies, as a checkpoint on disk would be (state dicts share tensors with the live
    # objects).
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed_model, resumed = _make(name)
    resumed_model.load_state_dict(saved_model)
    resumed.load_state_dict(saved_opt)
    _train(model, opt, batches[3:])
    _train(resumed_model, resumed, batches[3:])
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_state_saved_by_another_optimizer_is_refused() -> None:
    _, sgd = _make("sgd")
    _, kfac = _make("kfac")
    with pytest.raises(ValueError, match="saved by 'sgd', this is 'kfac'"):
        kfac.load_state_dict(sgd.state_dict())


def test_compositions_and_bases() -> None:
    _, mkor_lamb = _make("mkor", base="lamb")
    assert isinstance(mkor_lamb.base, Lamb)
    _, eva = _make("eva")
    assert isinstance(eva.preconditioner, EvaPreconditioner)
    assert isinstance(eva.base, torch.optim.SGD)
    _, hybrid = _make("mkor-h", base="lamb", window=5, threshold=0.01, stat_decay=0.9)
    assert isinstance(hybrid.preconditioner, HybridSwitch)
    assert hybrid.preconditioner.config.window == 5
    assert hybrid.preconditioner.preconditioner.config.stat_decay == 0.9


@pytest.mark.parametrize(("name", "options", "expected"), [
    ("sgd", {"momentum": 0.5}, {"momentum": 0.5}),
    ("adamw", {"betas": (0.8, 0.9)}, {"betas": (0.8, 0.9)}),
    ("lamb", {"betas": (0.8, 0.9)}, {"betas": (0.8, 0.9)}),
    ("kfac", {"base": "lamb", "betas": (0.7, 0.95)}, {"betas": (0.7, 0.95)}),
])
def test_momentum_and_betas_reach_the_base_optimizer(name: str, options: dict,
                                                      expected: dict) -> None:
    _, opt = _make(name, **options)
    for group in opt.param_groups:
        assert {key: group[key] for key in expected} == expected


def test_a_weight_shared_by_two_layers_is_updated_once() -> None:
    """A tied weight listed twice in a group got the base's update twice per step."""
    torch.manual_seed(0)
    first, second = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    opt = build_optimizer("sgd", model, lr=0.1, momentum=0.0)
    assert [len(group["params"]) for group in opt.param_groups] == [1]
    before = first.weight.detach().clone()
    model(torch.ones(2, 3)).sum().backward()
    assert first.weight.grad is not None
    expected = before - 0.1 * first.weight.grad
    opt.step()
    torch.testing.assert_close(first.weight.detach(), expected, rtol=0, atol=1e-7)


def test_weight_decay_excludes_bias_and_layernorm_for_lamb_and_adamw_only() -> None:
    for name in ("lamb", "adamw"):
        model, opt = _make(name)
        decayed, exempt = opt.param_groups
        assert decayed["weight_decay"] == 0.01 and exempt["weight_decay"] == 0.0
        assert {id(p) for p in decayed["params"]} == {id(model.conv.weight), id(model.fc.weight)}
    _, sgd = _make("sgd")
    assert len(sgd.param_groups) == 1 and sgd.param_groups[0]["weight_decay"] == 0.01


@pytest.mark.parametrize("name", ["kfac", "eva"])
def test_lr_schedule_on_the_base_reaches_the_kl_clip(name: str) -> None:
    model, opt = _make(name)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt.base, lambda step: 0.5 ** step)
    _train(model, opt, _batches(1))
    schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert opt.preconditioner.config.lr(0) == pytest.approx(0.025)


@pytest.mark.parametrize(("name", "kwargs", "field"), [
    ("shampoo", {}, "name"),
    ("sgd", {"base": "lamb"}, "base"),
    ("mkor", {"base": "adagrad"}, "base"),
    ("adamw", {"damping": 0.1}, "damping"),
    ("mkor", {"damping": 0.1}, "damping"),
    ("sgd", {"weight_decay": -0.1}, "weight_decay"),
])
def test_bad_names_and_options(name: str, kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_optimizer(name, Tiny(), lr=0.1, **kwargs)
    assert err.value.field_name == field
    if field == "name":
        assert all(repr(valid) in str(err.value) for valid in OPTIMIZERS)


@pytest.mark.parametrize(("name", "options", "field"), [
    ("kfac", {"damping": -1.0}, "damping"),
    ("eva", {"inverse_method": "eigen"}, "inverse_method"),
    ("mkor-h", {"window": 0}, "window"),
    ("mkor-h", {"update_rule": "nope"}, "update_rule"),
    ("lamb", {"damping": 0.1}, "damping"),
])
def test_preconditioner_options_are_checked_without_a_model(name: str, options: dict,
                                                             field: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_preconditioner_options(name, options)
    assert err.value.field_name == field
    check_preconditioner_options(name.replace("lamb", "sgd"), {} if name == "lamb" else
                                 {"mkor-h": {"window": 5}}.get(name, {}))


def test_mkor_h_needs_the_loss() -> None:
    model, opt = _make("mkor-h")
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="needs the step's loss"):
        opt.step()


def test_the_wrapper_adds_parameter_groups_and_the_check_accepts_a_grad_scaler() -> None:
    """``add_param_group`` was missing from the wrapper (unfreezing a backbone needs it), and
    the options check refused ``grad_scaler``, which build_optimizer takes."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = build_optimizer("kfac", model, lr=0.1)
    model[0].requires_grad_(True)
    opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.01})
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    check_preconditioner_options("kfac", {"damping": 0.01, "grad_scaler": scaler})
    build_optimizer("kfac", model, lr=0.1, grad_scaler=scaler)
