"""Behaviour of KFACPreconditioner as a whole: hooks, schedules, accumulation, state, errors."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from core import (
    ConfigError,
    EvaPreconditioner,
    KFACConfig,
    KFACPreconditioner,
    MKORPreconditioner,
)
from core.batchnorm import BatchNormPreconditioner
from core.config import update_due
from core.kfac_layer import KFACLayer
from core.strategy import FactorReduction, Strategy


def mlp(inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=inplace), nn.Linear(6, 3)).double()


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> None:
    (nn.functional.mse_loss(model(x), y) * scale).backward()


def test_inplace_relu_after_linear_gives_the_same_factors() -> None:
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    factors = []
    for inplace in (False, True):
        model = mlp(inplace)
        precond = KFACPreconditioner(model, factor_dtype="float64")
        backward(model, x, y)
        precond.step()
        factors.append([(layer.a.value, layer.g.value) for layer in precond.layers])
    for (a0, g0), (a1, g1) in zip(*factors, strict=True):
        torch.testing.assert_close(a0, a1)
        torch.testing.assert_close(g0, g1)


def test_inplace_relu_g_factor_is_gradient_of_linear_output() -> None:
    model = mlp(inplace=True)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    precond = KFACPreconditioner(model, factor_dtype="float64", factor_scaling="kfc")
    captured = {}

    def keep_output_grad(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        output.register_hook(lambda g: captured.setdefault("g", g.clone()))

    model[0].register_forward_hook(keep_output_grad)
    backward(model, x, y)
    precond.step()
    delta = 8 * captured["g"]
    torch.testing.assert_close(precond.layers[0].g.value, delta.T @ delta / 8)


@pytest.mark.parametrize("in_backward", [False, True])
def test_module_called_twice_averages_both_calls(in_backward: bool) -> None:
    """Built in the backward pass, the factors wait for both calls' output gradients."""
    torch.manual_seed(1)
    shared = nn.Linear(3, 3).double()
    precond = KFACPreconditioner(shared, factor_dtype="float64", factor_scaling="kfc",
                                 factors_in_backward=in_backward)
    x = torch.randn(5, 3, dtype=torch.float64)
    hidden = shared(x)
    shared(torch.tanh(hidden)).pow(2).mean().backward()
    precond.step()
    rows1 = torch.cat([x, torch.ones(5, 1, dtype=torch.float64)], 1)
    rows2 = torch.cat([torch.tanh(hidden.detach()), torch.ones(5, 1, dtype=torch.float64)], 1)
    expected = (rows1.T @ rows1 / 5 + rows2.T @ rows2 / 5) / 2
    torch.testing.assert_close(precond.layers[0].a.value, expected)


def test_skip_layers_by_regex_and_class() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 4), nn.Linear(4, 2))
    names = [layer.name for layer in KFACPreconditioner(model, skip_layers=["^3$"]).layers]
    assert names == ["0", "2"]
    names = [layer.name for layer in KFACPreconditioner(model, skip_layers=[nn.Conv2d]).layers]
    assert names == ["2", "3"]


def test_skipped_and_unsupported_layers_keep_raw_gradients() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    precond = KFACPreconditioner(model, skip_layers=["^2$"])
    backward(model, torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64))
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    precond.step()
    for name, param in model.named_parameters():
        changed = not torch.equal(param.grad, raw[name])
        assert changed == name.startswith("0."), name


@pytest.mark.parametrize("scaling", ["kaisa", "kfc", "dpkfac"])
def test_gradient_accumulation_equals_the_full_batch(scaling: str) -> None:
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    full = mlp()
    p_full = KFACPreconditioner(full, factor_dtype="float64", inverse_dtype="float64",
                                factor_scaling=scaling)
    backward(full, x, y)
    p_full.step()
    accum = mlp()
    p_accum = KFACPreconditioner(accum, factor_dtype="float64", inverse_dtype="float64",
                                 accumulation_steps=2, factor_scaling=scaling)
    for half in (slice(0, 4), slice(4, 8)):
        backward(accum, x[half], y[half], scale=0.5)
    p_accum.step()
    for a, b in zip(full.parameters(), accum.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_intervals_and_damping_accept_callables() -> None:
    model = mlp()
    seen = []

    def damping(step: int) -> float:
        seen.append(step)
        return 1e-3 * (step + 1)

    precond = KFACPreconditioner(model, damping=damping, factor_update_steps=lambda s: 2,
                                 inv_update_steps=lambda s: 3)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    captured = []
    for _ in range(4):
        model.zero_grad()
        backward(model, x, y)
        captured.append(bool(precond.layers[0].captured_inputs))
        precond.step()
    assert captured == [True, False, True, False]
    assert set(seen) == {0, 1, 2, 3}
    # the damping the last step (step 3) used, not the next step's
    assert precond.metrics()["damping"] == pytest.approx(4e-3)


@pytest.mark.parametrize(("make", "field", "bad"), [
    (KFACPreconditioner, "damping", -1.0),
    (KFACPreconditioner, "damping", 0.0),  # a constant 0 is refused: so is a scheduled one
    (KFACPreconditioner, "factor_decay", 3.0),  # made A indefinite
    (KFACPreconditioner, "factor_decay", 1.0),
    (KFACPreconditioner, "kl_clip", 0.0),  # zeroed every preconditioned gradient
    (EvaPreconditioner, "damping", 0.0),
    (EvaPreconditioner, "factor_decay", 1.0),
    (MKORPreconditioner, "stat_decay", 0.0),
    (BatchNormPreconditioner, "damping", 0.0),
    (BatchNormPreconditioner, "factor_decay", 1.5),
    (KFACPreconditioner, "damping", math.inf),  # zeroed every preconditioned gradient
    (KFACPreconditioner, "lr", math.inf),
    (EvaPreconditioner, "kl_clip", math.inf),
])
def test_a_schedule_is_held_to_the_range_of_a_constant(make: type, field: str,
                                                       bad: float) -> None:
    """A callable's value was checked against a looser range than a constant (only its
    lower end, inclusively), so a schedule could run what the constant is refused for."""
    with pytest.raises(ConfigError, match=field):
        make(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), **{field: bad})
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    precond = make(model, **{field: lambda step: bad})
    model(torch.randn(4, 4, dtype=torch.float64)).square().sum().backward()
    with pytest.raises(ConfigError, match=field):
        precond.step()


def train_steps(model: nn.Module, precond: KFACPreconditioner, opt: torch.optim.Optimizer,
                batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        opt.zero_grad()
        backward(model, x, y)
        precond.step()
        opt.step()


@pytest.mark.parametrize("method", ["eigen", "eigen_prediv", "cholesky", "cholesky_solve"])
def test_state_dict_round_trip_gives_bit_identical_next_gradients(method: str) -> None:
    torch.manual_seed(5)
    batches = [(torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64))
               for _ in range(4)]
    options = dict(inverse_method=method.split("_")[0], factor_update_steps=1,
                   inv_update_steps=2, prediv_eigenvalues=method == "eigen_prediv")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, **options)
    train_steps(model, precond, opt, batches[:3])
    state = copy.deepcopy(precond.state_dict())
    clone = copy.deepcopy(model)
    clone_precond = KFACPreconditioner(clone, **options)
    clone_precond.load_state_dict(state)
    for m, p in ((model, precond), (clone, clone_precond)):
        m.zero_grad()
        backward(m, *batches[3])
        p.step()
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(("saved", "loaded", "named"), [
    # Damped inverses and Cholesky factors have the same shapes but other meanings.
    ({"inverse_method": "cholesky_solve"}, {"inverse_method": "inverse"},
     "inverse_method='inverse'"),
    ({"inverse_method": "cholesky"}, {"inverse_method": "cholesky_solve"},
     "inverse_method='cholesky_solve'"),
    # Pre-divided eigenvalues hold no eigenvalue vectors, and the other way round.
    ({}, {"prediv_eigenvalues": True}, "prediv_eigenvalues=True needs .*saved under"),
    ({"prediv_eigenvalues": True}, {}, "prediv_eigenvalues=False needs .*saved under"),
])
def test_load_state_dict_rejects_a_state_of_another_kind(saved: dict, loaded: dict,
                                                         named: str) -> None:
    """The error names the setting to resume with; the saving settings load it."""
    model = mlp()
    precond = KFACPreconditioner(model, **saved)
    backward(model, torch.randn(6, 4, dtype=torch.float64),
             torch.randn(6, 3, dtype=torch.float64))
    precond.step()
    with pytest.raises(ValueError, match=named):
        KFACPreconditioner(mlp(), **loaded).load_state_dict(precond.state_dict())
    KFACPreconditioner(mlp(), **saved).load_state_dict(precond.state_dict())


def test_load_state_dict_rejects_another_model() -> None:
    state = KFACPreconditioner(mlp()).state_dict()
    other = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="does not match the model's layers"):
        KFACPreconditioner(other).load_state_dict(state)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("damping", 0.0), ("damping", "big"), ("factor_decay", 1.0), ("factor_update_steps", 0),
        ("inv_update_steps", 1.5), ("inverse_method", "svd"), ("damping_split", "half"),
        ("factor_scaling", "mine"), ("kl_clip", -1.0), ("lr", -0.1), ("strategy", "magic"),
        ("skip_layers", "fc"), ("skip_layers", [3]), ("skip_layers", ["(unclosed"]),
        ("accumulation_steps", 0), ("factor_dtype", "float16"), ("grad_worker_fraction", 2.0),
    ],
)
def test_bad_arguments_raise_an_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        KFACPreconditioner(mlp(), **{field: value})
    assert info.value.field_name == field
    assert "expected" in str(info.value)


@pytest.mark.parametrize(("options", "field"), [
    ({"strategy": "hybrid-opt", "grad_worker_fraction": 0.0}, "grad_worker_fraction"),
    ({"strategy": "comm-opt", "grad_worker_fraction": 0.5}, "grad_worker_fraction"),
    ({"strategy": "osawa", "colocate_factors": False}, "colocate_factors"),
    ({"strategy": "dp-kfac", "colocate_factors": False}, "colocate_factors"),
    ({"strategy": "comm-opt", "colocate_factors": False, "prediv_eigenvalues": True},
     "colocate_factors"),
    ({"inverse_method": "inverse", "prediv_eigenvalues": True}, "prediv_eigenvalues"),
    ({"inverse_method": "cholesky_solve", "precondition_dtype": "bfloat16"},
     "precondition_dtype"),
    ({"precondition_dtype_tolerance": -0.1}, "precondition_dtype_tolerance"),
    ({"assignment": "random"}, "assignment"),
])
def test_options_that_contradict_each_other_raise_naming_the_field(
        options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        KFACConfig(**options)  # type: ignore[arg-type]
    assert info.value.field_name == field


@pytest.mark.parametrize("interval", [0, 1.5])
def test_a_scheduled_interval_is_checked_when_it_is_evaluated(interval: float) -> None:
    with pytest.raises(ConfigError, match="inv_update_steps"):
        update_due("inv_update_steps", lambda step: interval, 3)  # type: ignore[arg-type,return-value]


def test_unknown_option_and_eigen_with_pi_are_rejected() -> None:
    with pytest.raises(ConfigError, match="dampening"):
        KFACPreconditioner(mlp(), dampening=0.1)
    with pytest.raises(ConfigError, match="damping_split"):
        KFACConfig(inverse_method="eigen", damping_split="pi")
    with pytest.raises(ConfigError, match="grad_worker_fraction"):
        KFACConfig(strategy="hybrid-opt")


def test_model_without_supported_layers_warns_and_leaves_gradients() -> None:
    model = nn.Sequential(nn.LayerNorm(3))
    with pytest.warns(UserWarning, match="no supported layers"):
        precond = KFACPreconditioner(model)
    model(torch.randn(2, 3)).sum().backward()
    before = model[0].weight.grad.clone()
    precond.step()
    assert torch.equal(model[0].weight.grad, before)


def test_overflow_step_leaves_factors_untouched_and_grads_raw() -> None:
    model = mlp()
    precond = KFACPreconditioner(model, factor_dtype="float64")
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    backward(model, x, y)
    precond.step()
    factors = [layer.a.value.clone() for layer in precond.layers]
    model.zero_grad()
    backward(model, x * 1e300, y)  # overflows to inf in the gradients, as an AMP overflow does
    raw = [p.grad.clone() for p in model.parameters()]
    precond.step()
    assert precond.skipped_overflow_steps == 1
    for layer, before in zip(precond.layers, factors, strict=True):
        assert torch.equal(layer.a.value, before)
        assert layer.a.pending is None
    for p, r in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad.nan_to_num(), r.nan_to_num())


def test_grad_scaler_scale_is_divided_out_of_g() -> None:
    class FixedScaler:
        def get_scale(self) -> float:
            return 1024.0

    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    plain, scaled = mlp(), mlp()
    p_plain = KFACPreconditioner(plain, factor_dtype="float64")
    p_scaled = KFACPreconditioner(scaled, factor_dtype="float64", grad_scaler=FixedScaler())
    backward(plain, x, y)
    backward(scaled, x, y, scale=1024.0)
    for p in scaled.parameters():
        p.grad /= 1024.0  # what scaler.unscale_ does
    p_plain.step()
    p_scaled.step()
    for a, b in zip(p_plain.layers, p_scaled.layers, strict=True):
        torch.testing.assert_close(a.g.value, b.g.value)


def test_memory_usage_and_stage_timings_are_reported() -> None:
    model = mlp()
    precond = KFACPreconditioner(model, inverse_method="eigen")
    backward(model, torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    precond.step()
    usage = precond.memory_usage()
    elem = 4  # float32 storage
    factors = (5 * 5 + 6 * 6 + 7 * 7 + 3 * 3) * elem
    inverses = factors + (5 + 6 + 7 + 3) * elem
    assert usage == {"factors": factors, "inverses": inverses, "buffers": 0,
                     "total": factors + inverses}
    metrics = precond.metrics()
    assert metrics["time/inversion"] > 0 and metrics["time/factors"] > 0


def test_decompositions_run_widest_factor_first_and_the_order_changes_no_gradient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The widest factors are decomposed first (their transients then meet an empty heap); the
    layers are independent, so the preconditioned gradients equal those of model order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 9), nn.Tanh(),
                          nn.Linear(9, 2)).double()
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    grads = {}
    for order in ("widest first", "model order"):
        replica = copy.deepcopy(model)
        precond = KFACPreconditioner(replica, inverse_method="eigen", factor_dtype="float64",
                                     inverse_dtype="float64")
        if order == "model order":
            precond._widest_first = list(precond.layers)
        calls: list[str] = []
        compute = KFACLayer.compute_inverse

        def spy(layer: KFACLayer, calls: list[str] = calls, compute=compute, **kwargs) -> None:
            calls.append(layer.name)
            compute(layer, **kwargs)

        monkeypatch.setattr(KFACLayer, "compute_inverse", spy)
        backward(replica, x, y)
        precond.step()
        monkeypatch.undo()
        grads[order] = [p.grad.clone() for p in replica.parameters()]
        if order == "widest first":  # widths (a, g): (4, 5), (6, 9), (10, 2)
            assert calls == ["4", "2", "0"]
    for widest, ordered in zip(grads["widest first"], grads["model order"], strict=True):
        assert torch.equal(widest, ordered)


def test_disabled_stage_is_skipped() -> None:
    model = mlp()
    precond = KFACPreconditioner(model, disabled_stages=["precondition"])
    backward(model, torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    raw = [p.grad.clone() for p in model.parameters()]
    precond.step()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), raw, strict=True))
    assert precond.layers[0].state is not None
    with pytest.raises(ConfigError, match="disabled_stages"):
        KFACPreconditioner(model, disabled_stages=["everything"])


def test_nonfinite_factor_is_skipped_counted_and_training_continues() -> None:
    torch.manual_seed(6)
    model = nn.Linear(3, 2)  # float32: squares of 1e20 overflow, the gradient does not
    precond = KFACPreconditioner(model, kl_clip=None)
    x = torch.randn(4, 3)
    model(x).pow(2).mean().backward()
    precond.step()
    good = precond.layers[0].a.value.clone()
    model.zero_grad()
    model(x * 1e20).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.warns(UserWarning, match="non-finite factor batch skipped"):
        precond.step()
    assert torch.equal(precond.layers[0].a.value, good)
    assert precond.metrics()["nonfinite_factor_skips"] == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


class _RecordingStrategy(Strategy):
    """One process that says it communicates factors, and logs the calls it gets."""

    communicates_factors = True

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def setup(self, layers: list[KFACLayer], *, method: str, dtype: torch.dtype) -> None:
        self.layers = layers

    def factor_reduction(self) -> FactorReduction:
        log, layers = self.log, self.layers

        class Logged(FactorReduction):
            def add(self, layer: KFACLayer) -> None:
                assert layer.batch_a is not None and layer.batch_g is not None  # staged
                super().add(layer)
                staged = [x for x in layers if x.batch_a is not None]
                assert all(x in self.layers for x in staged)  # before the next is built
                log.append(f"add {layer.name}")

            def finish(self) -> Callable[[], None]:
                log.append("finish")
                return lambda: log.append("complete")

        return Logged()

    def communicate_gradients(self, layers: list[KFACLayer], grads: dict[str, Tensor]) -> None:
        self.log.append("gradients")


def test_factor_collectives_overlap_the_preconditioning_of_a_step_that_keeps_its_inverses(
        ) -> None:
    """Inverses every 2 steps, factors every step: each layer goes to the reduction once its
    factors are staged; on step 1 the reduction completes after the gradients are
    preconditioned and moved, and the running factors end as they do when everything runs
    in order."""
    torch.manual_seed(1)
    data = [(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64))
            for _ in range(3)]
    results = []
    for strategy in (_RecordingStrategy(), None):
        model = mlp()
        precond = KFACPreconditioner(model, factor_dtype="float64", inverse_dtype="float64",
                                     inv_update_steps=2, strategy_impl=strategy)
        for x, y in data:
            model.zero_grad()
            backward(model, x, y)
            precond.step()
        results.append(([(layer.a.value, layer.g.value) for layer in precond.layers],
                        [p.grad.clone() for p in model.parameters()]))
        if strategy is not None:
            adds = [f"add {layer.name}" for layer in precond.layers]
            assert strategy.log == [*adds, "finish", "complete", "gradients",  # step 0 inverts
                                    *adds, "finish", "gradients", "complete",  # step 1 keeps
                                    *adds, "finish", "complete", "gradients"]  # step 2 inverts
    (factors, grads), (expected_factors, expected_grads) = results
    for (a, g), (a_ref, g_ref) in zip(factors, expected_factors, strict=True):
        torch.testing.assert_close(a, a_ref, rtol=0, atol=0)
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _train_recorded(strategy: Strategy | None, data: list[tuple[Tensor, Tensor]],
                    log: list[str] | None = None, **options: object
                    ) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
    """Running factors and preconditioned gradients after one step per ``(x, y)`` group
    (micro-batches), with "backward" logged after each backward pass."""
    model = mlp()
    precond = KFACPreconditioner(model, factor_dtype="float64", inverse_dtype="float64",
                                 strategy_impl=strategy, **options)
    for step in data:
        model.zero_grad()
        for x, y in zip(*step, strict=True):
            backward(model, x, y, scale=1 / len(step[0]))
            if log is not None:
                log.append("backward")
        precond.step()
    return ([(layer.a.value, layer.g.value) for layer in precond.layers],
            [p.grad.clone() for p in model.parameters()])


def _assert_same(got: tuple, want: tuple) -> None:
    for a, b in zip(got[0] + [(g,) for g in got[1]], want[0] + [(g,) for g in want[1]],
                    strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _steps(count: int, micro: int) -> list[tuple[Tensor, Tensor]]:
    torch.manual_seed(2)
    return [(torch.randn(micro, 8, 4, dtype=torch.float64),
             torch.randn(micro, 8, 3, dtype=torch.float64)) for _ in range(count)]


@pytest.mark.parametrize("micro", [1, 2])
def test_factors_in_backward_reach_the_reduction_during_the_last_backward_pass(
        micro: int) -> None:
    """With ``factors_in_backward`` each layer (last first) is handed over from its backward
    hook after the step's last micro-batch, the reduction is finished in the step as before,
    and factors and gradients are bit-identical to building them in the step."""
    data = _steps(3, micro)
    strategy = _RecordingStrategy()
    options = {"inv_update_steps": 2, "accumulation_steps": micro}
    got = _train_recorded(strategy, data, strategy.log, factors_in_backward=True, **options)
    adds = [f"add {name}" for name in ("2", "0")]  # the Linear layers, backward order
    waits = ["backward"] * (micro - 1)
    assert strategy.log == [*waits, *adds, "backward", "finish", "complete", "gradients",
                            *waits, *adds, "backward", "finish", "gradients", "complete",
                            *waits, *adds, "backward", "finish", "complete", "gradients"]
    _assert_same(got, _train_recorded(_RecordingStrategy(), data, **options))
    _assert_same(got, _train_recorded(None, data, **options))
    _assert_same(_train_recorded(None, data, factors_in_backward=True, **options), got)


def test_factors_in_backward_refuse_more_backward_passes_than_accumulation_steps() -> None:
    model = mlp()
    KFACPreconditioner(model, factors_in_backward=True, strategy_impl=_RecordingStrategy())
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    backward(model, x, y)
    with pytest.raises(RuntimeError, match="set accumulation_steps to the number of backward"):
        backward(model, x, y)


def _micro_batches_through(buffer: Tensor | None, **options: object) -> KFACPreconditioner:
    """Two micro-batches of one step, each fed as a fresh tensor or refilled into ``buffer``."""
    model = mlp()
    precond = KFACPreconditioner(model, accumulation_steps=2, factor_dtype="float64",
                                 **options)
    torch.manual_seed(1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        backward(model, xs.clone() if buffer is None else buffer.copy_(xs), ys, 0.5)
    precond.step()
    return precond


def test_an_input_buffer_refilled_before_its_factor_is_built_is_refused() -> None:
    """K-FAC builds ``A`` from the kept input after the backward pass, when autograd no longer
    guards it: a buffer refilled in place with the next micro-batch would stand in for the data
    the gradient came from. That is refused by name, before anything is folded; building the
    factors in the backward pass (the fix the error names) gives the factors of fresh
    tensors."""
    buffer = torch.empty(4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"^0: the input K-FAC kept .* modified in place "
                                           r".*factors_in_backward=True"):
        _micro_batches_through(buffer)
    fresh = _micro_batches_through(None)
    refilled = _micro_batches_through(buffer, factors_in_backward=True)
    for ours, theirs in zip(refilled.layers, fresh.layers, strict=True):
        torch.testing.assert_close(ours.a.value, theirs.a.value, rtol=1e-14, atol=0)


def test_an_input_changed_between_backward_and_step_is_refused_before_the_step_changes_anything(
        ) -> None:
    model = mlp()
    precond = KFACPreconditioner(model, factor_dtype="float64")
    x = torch.randn(8, 4, dtype=torch.float64)
    backward(model, x, torch.randn(8, 3, dtype=torch.float64))
    raw = [p.grad.clone() for p in model.parameters()]
    x.zero_()  # a prefetch into the same buffer
    with pytest.raises(RuntimeError, match="modified in place"):
        precond.step()
    assert precond.steps == 0 and not any(layer.has_factors for layer in precond.layers)
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), raw, strict=True))


def test_factors_in_backward_overflow_completes_the_started_reduction_then_skips() -> None:
    """An AMP overflow found in the step: the collectives the backward pass started are
    completed (as on every rank), then the step's factors are dropped."""
    strategy = _RecordingStrategy()
    model = mlp()
    precond = KFACPreconditioner(model, factors_in_backward=True, strategy_impl=strategy,
                                 factor_dtype="float64")
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    backward(model, x, y)
    model[0].weight.grad[0, 0] = float("inf")
    precond.step()
    assert strategy.log == ["add 2", "add 0", "finish", "complete"]
    assert precond.skipped_overflow_steps == 1
    assert all(layer.a.value is None and layer.batch_a is None for layer in precond.layers)
    model.zero_grad()
    backward(model, x, y)  # the next step starts clean
    precond.step()
    assert strategy.log[4:] == ["add 2", "add 0", "finish", "complete", "gradients"]


def test_an_fp16_layers_preconditioned_gradient_beyond_fp16s_range_keeps_the_raw_gradient(
        ) -> None:
    """A ``P`` finite in fp32 rounds to infinities above 65,504 when written into an fp16
    parameter's ``.grad``: the finiteness check had read it before that cast, so inf was
    written and not counted. Now the layer keeps its raw gradient, with a warning and a
    count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16)).half()
    precond = KFACPreconditioner(model, damping=1e-9, kl_clip=None)
    x = torch.randn(32, 64).half()
    ((model(x).float() * torch.randn(32, 16)).sum(1).mean() * 1e-3).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="preconditioned gradient of 0 exceeds float16's range"):
        precond.step()
    for p, r in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad, r)
    assert precond.nonfinite_preconditioned == 1


def test_training_in_eval_mode_warns_once_that_nothing_was_captured() -> None:
    """In ``eval()`` mode nothing is captured, so K-FAC stayed first-order for ever without a
    word (MKOR and Eva warned). Now one warning names the layers and the cause."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    precond = KFACPreconditioner(model)
    model.eval()
    with pytest.warns(UserWarning, match=r"^0, 2: a gradient but nothing captured .*"
                                         r"model\.train\(\)") as record:
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(16, 4)).square().mean().backward()
            precond.step()
    assert len([w for w in record if "nothing captured" in str(w.message)]) == 1
    assert not any(layer.has_factors for layer in precond.layers)
    model.train()  # with capture disabled on purpose (a time breakdown) nothing is reported
    quiet = KFACPreconditioner(model, disabled_stages=["capture"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        quiet.step()


class _OwnLinear(nn.Linear):
    """A subclass whose forward might differ from nn.Linear's."""


def test_unsupported_subclasses_and_skip_rules_that_match_nothing_are_reported() -> None:
    """A subclass of nn.Linear stayed first-order silently (the docs promised a warning), and
    a KAISA-style class-name rule such as "Linear" skipped nothing, silently."""
    model = nn.Sequential(_OwnLinear(4, 4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"_OwnLinear subclasses nn\.Linear .*"
                                         r"register_helper\(_OwnLinear, LinearHelper\)"):
        precond = KFACPreconditioner(model)
    assert [layer.name for layer in precond.layers] == ["1"]
    with pytest.warns(UserWarning, match=r"skip_layers rules \['Linear'\] match no module name"):
        KFACPreconditioner(nn.Sequential(nn.Linear(4, 2)), skip_layers=["Linear"])
