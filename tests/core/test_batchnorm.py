"""BatchNorm Fisher preconditioning against naive float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.batchnorm import (
    BN_FISHER_MODES,
    BatchNormPreconditioner,
    arrange,
    damped_block_inverse,
    normalised,
    split,
)
from core.config import ConfigError


def make_model(inplace: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(inplace=inplace),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4),
        nn.ReLU(inplace=inplace), nn.Linear(4, 3),
    )
    for bn in (model[1], model[6]):  # non-trivial scale and shift
        nn.init.normal_(bn.weight, 1.0, 0.3)
        nn.init.normal_(bn.bias, 0.0, 0.3)
    return model


def reference_per_example(model: nn.Module, x: Tensor, y: Tensor) -> dict[int, Tensor]:
    """``u_n`` of each BatchNorm (index in the Sequential), ``(N, C, 2)``, by explicit autograd.

    ``x̂`` comes from ``F.batch_norm`` with unit scale and zero shift; ``gy`` from retaining the
    gradient of each BatchNorm output in a float64 copy without in-place ops.
    """
    ref = make_model(inplace=False).double()
    ref.load_state_dict(model.state_dict())
    h, kept = x.double(), {}
    for index, layer in enumerate(ref):
        if isinstance(layer, nn.BatchNorm1d | nn.BatchNorm2d):
            x_hat = F.batch_norm(h, None, None, training=True, eps=layer.eps).detach()
            h = layer(h)
            h.retain_grad()
            kept[index] = (x_hat, h)
        else:
            h = layer(h)
    F.cross_entropy(h, y).backward()
    out = {}
    n = x.shape[0]
    for index, (x_hat, out_h) in kept.items():
        rows = []
        for example in range(n):
            c = out_h.shape[1]
            gy = (n * out_h.grad[example]).reshape(c, -1)
            xh = x_hat[example].reshape(c, -1)
            rows.append(torch.stack([(gy * xh).sum(1), gy.sum(1)], dim=-1))
        out[index] = torch.stack(rows)
    return out


def reference_fisher(u: Tensor, mode: str) -> Tensor:
    """The dense ``2C×2C`` Fisher ``(1/N) Σ v vᵀ`` (``v = [γ…, β…]``) masked to ``mode``'s shape."""
    n, c = u.shape[0], u.shape[1]
    v = torch.cat([u[..., 0], u[..., 1]], dim=1)
    dense = sum(torch.outer(row, row) for row in v) / n
    if mode == "full":
        return dense
    mask = torch.eye(2 * c, dtype=torch.bool)
    if mode == "unit":
        mask = mask | torch.eye(2 * c, dtype=torch.bool).roll(c, 1) | torch.eye(
            2 * c, dtype=torch.bool).roll(-c, 1)
    return dense * mask


def dense_from_blocks(blocks: Tensor, mode: str, c: int) -> Tensor:
    """Expand stored ``(K, m, m)`` blocks into the dense ``2C×2C`` matrix in ``[γ…, β…]`` order."""
    dense = torch.zeros(2 * c, 2 * c, dtype=blocks.dtype)
    if mode == "full":
        return blocks[0]
    if mode == "diagonal":
        return torch.diag(blocks.flatten())
    for ch in range(c):
        for i in range(2):
            for j in range(2):
                dense[ch + i * c, ch + j * c] = blocks[ch, i, j]
    return dense


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(6, 2, 5, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)


@pytest.mark.parametrize("mode", BN_FISHER_MODES)
def test_fisher_blocks_and_preconditioned_grads_match_dense_reference(mode: str) -> None:
    model = make_model()
    x, y = batch()
    reference_u = reference_per_example(model, x, y)
    precond = BatchNormPreconditioner(model, mode=mode, damping=0.1)
    F.cross_entropy(model(x), y).backward()
    raw = {i: torch.cat([model[i].weight.grad, model[i].bias.grad]).double() for i in (1, 6)}
    precond.step()
    for block, index in zip(precond.blocks, (1, 6), strict=True):
        u = reference_u[index]
        # the mean of the per-example gradients is autograd's gradient
        assert torch.allclose(u.mean(0).mT.flatten(), raw[index], atol=1e-5)
        expected = reference_fisher(u, mode)
        got = dense_from_blocks(block.fisher.value.double(), mode, u.shape[1])
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
        damped = expected + 0.1 * torch.eye(expected.shape[0], dtype=torch.float64)
        want = torch.linalg.solve(damped, raw[index])
        bn = model[index]
        got_p = torch.cat([bn.weight.grad, bn.bias.grad]).double()
        assert torch.allclose(got_p, want, rtol=1e-3, atol=1e-4)


def test_a_call_whose_output_gets_no_gradient_is_not_paired_with_another_calls_gradient(
        ) -> None:
    """Inputs were kept on a stack that each gradient popped: a forward call whose output got
    no gradient (a monitoring pass in training mode, here after the trained one) left its
    input on top, the trained call's gradient was paired with it (Fisher off by 97%), and the
    stack was never emptied. Each gradient now meets its own call's input."""
    model = make_model()
    x, y = batch()
    reference_u = reference_per_example(model, x, y)
    precond = BatchNormPreconditioner(model, mode="full", damping=0.1)
    loss = F.cross_entropy(model(x), y)
    model(torch.randn_like(x))  # its output gets no gradient
    loss.backward()
    precond.step()
    for block, index in zip(precond.blocks, (1, 6), strict=True):
        expected = reference_fisher(reference_u[index], "full")
        got = dense_from_blocks(block.fisher.value.double(), "full", 3 if index == 1 else 4)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", BN_FISHER_MODES)
def test_arrange_and_split_are_inverse(mode: str) -> None:
    gamma, beta = torch.arange(4.0), torch.arange(4.0) + 10
    blocks = arrange(gamma, beta, mode)
    assert blocks.shape == {"unit": (4, 2), "diagonal": (8, 1), "full": (1, 8)}[mode]
    back = split(blocks, mode)
    assert torch.equal(back[0], gamma) and torch.equal(back[1], beta)


def test_accumulation_averages_micro_batch_blocks() -> None:
    x, y = batch()
    whole = make_model()
    one = BatchNormPreconditioner(whole, mode="unit", damping=0.1)
    per_half = []
    for half in (slice(0, 3), slice(3, 6)):
        m = make_model()
        p = BatchNormPreconditioner(m, mode="unit", damping=0.1)
        F.cross_entropy(m(x[half]), y[half]).backward()
        p.step()
        per_half.append([b.fisher.value for b in p.blocks])
    acc = BatchNormPreconditioner(whole, mode="unit", damping=0.1, accumulation_steps=2)
    one.remove_hooks()
    for half in (slice(0, 3), slice(3, 6)):
        (F.cross_entropy(whole(x[half]), y[half]) / 2).backward()
    acc.step()
    for block, a, b in zip(acc.blocks, *per_half, strict=True):
        assert torch.allclose(block.fisher.value, (a + b) / 2, atol=1e-5)


def test_update_interval_running_average_and_state_round_trip() -> None:
    model = make_model()
    x, y = batch()
    precond = BatchNormPreconditioner(model, mode="diagonal", damping=0.1, factor_decay=0.3,
                                      update_steps=2)
    values = []
    for step in range(3):
        model.zero_grad()
        F.cross_entropy(model(x + step), y).backward()
        precond.step()
        values.append(precond.blocks[0].fisher.value.clone())
    assert torch.equal(values[0], values[1])  # step 1 is not an update step
    # Step 2 blends its batch's blocks in with weight 1 - 0.3 (a decay of 0.5 could not tell
    # the two weights apart); the batch's own blocks from a preconditioner that keeps no
    # average, on the same weights and input.
    alone = BatchNormPreconditioner(model, mode="diagonal", damping=0.1, factor_decay=0.0)
    precond.remove_hooks()
    model.zero_grad()
    F.cross_entropy(model(x + 2), y).backward()
    alone.step()
    torch.testing.assert_close(values[2],
                               0.3 * values[1] + 0.7 * alone.blocks[0].fisher.value)
    fresh = BatchNormPreconditioner(make_model(), mode="diagonal", damping=0.1, update_steps=2)
    fresh.load_state_dict(precond.state_dict())
    assert fresh.steps == 3 and torch.equal(fresh.blocks[0].fisher.value, values[2])
    with pytest.raises(ValueError, match="mode"):
        BatchNormPreconditioner(make_model(), mode="unit").load_state_dict(precond.state_dict())


def test_evaluation_passes_are_not_captured_and_bad_options_are_rejected() -> None:
    model = make_model()
    precond = BatchNormPreconditioner(model, mode="unit")
    model.eval()
    with torch.no_grad():
        model(batch()[0])
    assert all(b.fisher.pending is None for b in precond.blocks)
    with pytest.raises(ConfigError, match="mode"):
        BatchNormPreconditioner(model, mode="kron")
    with pytest.raises(ConfigError, match="damping"):
        BatchNormPreconditioner(model, damping=0.0)
    assert len(BatchNormPreconditioner(model, skip_layers=[r"^6$"]).blocks) == 1


def test_skip_layers_take_classes_and_refuse_a_bare_string() -> None:
    """A class skips its instances; a plain string was split into one-character regexes (each
    matching far more layers than meant), and a class raised a bare TypeError from ``re``."""
    model = make_model()
    assert [b.name for b in BatchNormPreconditioner(model, skip_layers=[nn.BatchNorm1d]).blocks
            ] == ["1"]
    for bad in ("14", [3]):
        with pytest.raises(ConfigError, match="skip_layers"):
            BatchNormPreconditioner(model, skip_layers=bad)  # type: ignore[arg-type]


class _ConstantScaler:
    """The part of an AMP ``GradScaler`` the preconditioners read."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


def test_the_amp_loss_scale_is_divided_out_of_the_fisher_blocks() -> None:
    """With the loss multiplied by an AMP scale S and the gradients unscaled before ``step()``
    (as ``GradScaler`` does), the Fisher blocks were S² too large and the preconditioned
    gradients S² too small; given the scaler, both equal the unscaled run's."""
    x, y = batch()
    results = []
    for scale in (1.0, 2.0**16):
        model = make_model()
        precond = BatchNormPreconditioner(model, mode="full", damping=1e-3,
                                          grad_scaler=_ConstantScaler(scale))
        (F.cross_entropy(model(x), y) * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        precond.step()
        results.append(([b.fisher.value for b in precond.blocks],
                         [model[i].weight.grad.clone() for i in (1, 6)]))
    for plain, scaled in zip(*results, strict=True):
        for a, b in zip(plain, scaled, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (3, 3, 4, 5)])
def test_normalised_input_equals_dense_mean_and_variance(shape: tuple[int, ...]) -> None:
    """``x̂`` from the fused kernel equals ``(x − mean) / sqrt(var + eps)`` over all
    non-channel dimensions (biased variance), and a NaN poisons only its own channel."""
    torch.manual_seed(7)
    x = 3.0 + 2.0 * torch.randn(shape, dtype=torch.float64)
    dims = (0, *range(2, x.dim()))
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, unbiased=False, keepdim=True)
    dense = (x - mean) / torch.sqrt(var + 1e-5)
    torch.testing.assert_close(normalised(x.float(), 1e-5).double(), dense, rtol=1e-5, atol=1e-5)
    x[(0, 1) + (0,) * (x.dim() - 2)] = float("nan")
    x_hat = normalised(x.float(), 1e-5)
    assert x_hat[:, 1].isnan().all() and x_hat[:, [0, 2]].isfinite().all()


def test_a_layer_with_gamma_or_beta_frozen_is_left_first_order_with_a_warning() -> None:
    """Its Fisher block couples γ and β: with one of them frozen it was captured, averaged and
    inverted every step but never applied, silently."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(18, 2),
                        nn.BatchNorm1d(2))
    net[1].bias.requires_grad_(False)
    net[4].weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"BatchNorm layers 1, 4: one of γ and β is frozen"):
        bn = BatchNormPreconditioner(net)
    assert bn.blocks == []
    F.cross_entropy(net(torch.randn(8, 1, 5, 5)), torch.randint(0, 2, (8,))).backward()
    raw = net[1].weight.grad.clone()
    bn.step()
    assert torch.equal(net[1].weight.grad, raw)


def test_layers_are_inverted_together_and_a_failing_one_alone_keeps_its_last_inverse() -> None:
    """Every updated layer's blocks are inverted in one batch (three host reads per layer
    stalled a GPU before); each inverse is still its own layer's ``(F + λI)⁻¹``, and a layer
    whose blocks cannot be inverted keeps its last inverse, counted and named, while the
    others are inverted."""
    model = make_model()
    x, y = batch()
    precond = BatchNormPreconditioner(model, mode="unit", damping=0.1, factor_decay=0.99)
    F.cross_entropy(model(x), y).backward()
    precond.step()
    first, second = precond.blocks
    for block in (first, second):
        fisher = block.fisher.value.double()
        eye = torch.eye(fisher.shape[-1], dtype=torch.float64)
        torch.testing.assert_close(block.inverse.double(), torch.linalg.inv(fisher + 0.1 * eye),
                                   rtol=1e-5, atol=1e-6)
    kept = first.inverse.clone()
    first.fisher.value = -100 * torch.eye(2).expand_as(first.fisher.value).clone()
    model.zero_grad()
    F.cross_entropy(model(x + 1), y).backward()
    with pytest.warns(UserWarning, match=f"{first.name}: cholesky failed.*keeping the last"):
        precond.step()
    assert torch.equal(first.inverse, kept) and (first.failures, second.failures) == (1, 0)
    fisher = second.fisher.value.double()
    torch.testing.assert_close(second.inverse.double(),
                               torch.linalg.inv(fisher + 0.1 * torch.eye(2, dtype=torch.float64)),
                               rtol=1e-5, atol=1e-6)


def test_a_float16_layers_result_beyond_its_range_leaves_its_gradient_raw() -> None:
    """The check ran in float32 and the result was then cast into the float16 gradient:
    ``inf`` was written (a damping near 1e-12 makes the inverse that large)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(2).half()
    precond = BatchNormPreconditioner(bn, damping=1e-12, mode="unit")
    (bn(torch.randn(4, 2, 3, 3).half()).float() * 3e-7).sum().backward()
    raw = [bn.weight.grad.clone(), bn.bias.grad.clone()]
    precond.step()
    assert torch.equal(bn.weight.grad, raw[0]) and torch.equal(bn.bias.grad, raw[1])
    assert precond.metrics()["bn/preconditioned_layers"] == 0.0


def test_a_layer_that_needs_the_fp64_retry_leaves_the_others_fp32_results() -> None:
    """Inverted together, one layer whose blocks fail in fp32 had every layer of its group
    retried in fp64: different bits from inverting each alone. The group is retried layer by
    layer instead, and only the failing layer takes the fp64 result."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(8), nn.BatchNorm2d(8))
    precond = BatchNormPreconditioner(model, mode="unit", damping=1e-3, factor_decay=0.0)
    u = torch.randn(8, 16, 2)
    good = torch.einsum("kni,knj->kij", u, u) / 16
    bad = good.clone()
    bad[0] = 1e8 * torch.ones(2, 2)  # singular at fp32's precision: its Cholesky fails there
    for block, fisher in zip(precond.blocks, (good, bad), strict=True):
        block.fisher.accumulate(fisher)
    F.mse_loss(model(torch.randn(4, 8, 3, 3)), torch.randn(4, 8, 3, 3)).backward()
    precond.step()
    assert torch.equal(precond.blocks[0].inverse, damped_block_inverse(
        precond.blocks[0].fisher.value, 1e-3, torch.float32))
    assert precond.blocks[1].failures == 0 and torch.isfinite(precond.blocks[1].inverse).all()
