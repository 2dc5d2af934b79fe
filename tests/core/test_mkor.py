"""MKOR: inverse-update rules, stabiliser, rescale, rank-1 statistics, averaging, training."""

from __future__ import annotations

import gzip
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from core import ConfigError, MKORConfig, MKORPreconditioner
from core import mkor as mkor_module
from core.inverse import inverse_product
from core.layer_base import squared_norm
from core.mkor import (
    apply_update,
    gradient_norm_scale,
    stabiliser_fires,
    trusted_scales,
    update_inverse,
    update_terms,
)

torch.set_num_threads(1)
F64 = torch.float64


def _random_vectors(n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=gen, dtype=F64) for _ in range(n)]


# Inverse-update rules ------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.5, 0.95])
def test_exact_rule_is_inverse_of_the_recursion(gamma: float) -> None:
    d = 6
    factor = torch.eye(d, dtype=F64)
    inverse = torch.eye(d, dtype=F64)
    for v in _random_vectors(8, d):
        factor = gamma * factor + (1 - gamma) * torch.outer(v, v)
        inverse = update_inverse(inverse, v, gamma, "exact")
        torch.testing.assert_close(inverse, torch.linalg.inv(factor), rtol=1e-10, atol=1e-10)


def test_paper_rule_is_the_printed_formula_and_differs_from_exact() -> None:
    gamma, d = 0.9, 5
    start = torch.linalg.inv(torch.eye(d, dtype=F64) + 0.3 * torch.ones(d, d, dtype=F64))
    v = _random_vectors(1, d, seed=1)[0]
    col = v.reshape(-1, 1)
    quad = (col.T @ start @ col).item()
    printed = gamma * start + (1 - gamma) / (gamma**2 * (1 + gamma * (1 - gamma) * quad)) * (
        start @ col @ col.T @ start)
    result = update_inverse(start, v, gamma, "paper")
    torch.testing.assert_close(result, printed, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(result, update_inverse(start, v, gamma, "exact"))


def test_official_rule_blends_the_inverse_then_adds_an_unweighted_rank_one_term() -> None:
    gamma, d = 0.95, 5
    start = torch.linalg.inv(torch.eye(d, dtype=F64) + 0.3 * torch.ones(d, d, dtype=F64))
    v = _random_vectors(1, d, seed=2)[0]
    blended = gamma * start + (1 - gamma) * torch.eye(d, dtype=F64)
    # Sherman–Morrison of the code: (M⁻¹ + v vᵀ)⁻¹ with M the blended inverse.
    expected = torch.linalg.inv(torch.linalg.inv(blended) + torch.outer(v, v))
    torch.testing.assert_close(update_inverse(start, v, gamma, "official"), expected,
                               rtol=1e-10, atol=1e-10)


# Stabiliser and rescale ----------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["exact", "paper", "official"])
def test_stabiliser_blends_towards_identity_above_epsilon_only(rule: str) -> None:
    inverse = torch.tensor([[3.0, 1.0], [1.0, 0.5]], dtype=F64)
    assert stabiliser_fires(inverse, epsilon=2.0)
    assert not stabiliser_fires(inverse, epsilon=3.0)  # max |entry| = 3 is not > 3
    v = torch.tensor([0.3, -1.2], dtype=F64)
    blended = 0.9 * inverse + 0.1 * torch.eye(2, dtype=F64)  # blends, never resets to I
    torch.testing.assert_close(update_inverse(inverse, v, 0.8, rule, blend=0.9),
                               update_inverse(blended, v, 0.8, rule), rtol=1e-12, atol=1e-12)


def test_rescale_takes_the_gradient_norm() -> None:
    p = torch.tensor([[3.0, 4.0]], dtype=F64)
    grad = torch.tensor([[0.0, 10.0]], dtype=F64)
    scale, g_square = gradient_norm_scale(p, grad)
    torch.testing.assert_close(scale, torch.tensor(2.0, dtype=F64))  # ‖∇W̄‖ / ‖P‖ = 10 / 5
    zero, zero_square = gradient_norm_scale(torch.zeros_like(p), torch.zeros_like(grad))
    assert zero.item() == 0.0  # a zero P (a zero gradient) stays zero
    # ‖P‖² under- and overflows fp32 for ordinary P: those scales are not trusted
    tiny, big = (gradient_norm_scale(torch.full((2, 2), size), torch.ones(2, 2))
                 for size in (1e-25, 1e25))
    assert trusted_scales([scale, zero, tiny[0], big[0]],
                          [g_square, zero_square, tiny[1], big[1]]) == [True, True, False, False]
    big = torch.randn(70, 33, dtype=torch.float32)
    torch.testing.assert_close(squared_norm(big), big.double().square().sum().float())


# Rank-1 statistics ---------------------------------------------------------------------------
def _explicit_conv_patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """im2col by loops: (B, L, c_in·k_h·k_w [+1]) rows in channel-major order."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (conv.kernel_size, conv.stride, conv.padding,
                                              conv.dilation)
    padded = F.pad(x, (pw, pw, ph, ph))
    b, _, h, w = padded.shape
    out_h = (h - dh * (kh - 1) - 1) // sh + 1
    out_w = (w - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for n in range(b):
        per_example = []
        for i in range(out_h):
            for j in range(out_w):
                patch = padded[n, :, i * sh:i * sh + dh * (kh - 1) + 1:dh,
                               j * sw:j * sw + dw * (kw - 1) + 1:dw]
                row = patch.reshape(-1)
                if conv.bias is not None:
                    row = torch.cat([row, row.new_ones(1)])
                per_example.append(row)
        rows.append(torch.stack(per_example))
    return torch.stack(rows)


def _statistics_after_one_step(layer: nn.Module, x: torch.Tensor
                               ) -> tuple[MKORPreconditioner, torch.Tensor]:
    """Run one captured step on ``layer`` alone; return MKOR and the output gradient."""
    model = nn.Sequential(layer).to(F64)
    mkor = MKORPreconditioner(model, inv_update_steps=1, dtype="float64", epsilon=math.inf)
    y = model(x)
    y.retain_grad()
    (y.sin().sum(dim=tuple(range(1, y.dim()))) ** 2).mean().backward()
    mkor.step()
    assert y.grad is not None
    return mkor, y.grad


def test_statistics_linear_2d() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 4, dtype=F64)
    mkor, gy = _statistics_after_one_step(nn.Linear(4, 3), x)
    layer = mkor.layers[0]
    torch.testing.assert_close(layer.a_vec, torch.cat([x.mean(0), torch.ones(1, dtype=F64)]))
    torch.testing.assert_close(layer.g_vec, (7 * gy).mean(0))  # mean over rows of R·g


def test_statistics_linear_3d() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 5, 4, dtype=F64)
    mkor, gy = _statistics_after_one_step(nn.Linear(4, 2, bias=False), x)
    layer = mkor.layers[0]
    torch.testing.assert_close(layer.a_vec, x.reshape(15, 4).mean(0))
    torch.testing.assert_close(layer.g_vec, (15 * gy.reshape(15, 2)).mean(0))


def test_statistics_conv2d_with_stride_padding_dilation_and_bias() -> None:
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1))
    x = torch.randn(4, 2, 7, 6, dtype=F64)
    mkor, gy = _statistics_after_one_step(conv, x)
    layer = mkor.layers[0]
    patches = _explicit_conv_patches(x, conv.to(F64))
    b, locations = patches.shape[:2]
    # ā: each example's spatial mean of its patches, then the batch mean.
    torch.testing.assert_close(layer.a_vec, patches.mean(dim=1).mean(dim=0))
    # ḡ: per example B·Σ_t g_t / L, then the batch mean.
    per_example = b * gy.flatten(2).sum(dim=2) / locations
    torch.testing.assert_close(layer.g_vec, per_example.mean(dim=0))


def test_gradient_accumulation_gives_the_full_batch_statistics() -> None:
    torch.manual_seed(3)
    x = torch.randn(8, 5, dtype=F64)
    target = torch.randn(8, 2, dtype=F64)
    vectors = []
    for micro in (1, 2):
        torch.manual_seed(4)
        model = nn.Linear(5, 2).to(F64)
        mkor = MKORPreconditioner(model, inv_update_steps=1, dtype="float64",
                                  accumulation_steps=micro)
        for xb, tb in zip(x.chunk(micro), target.chunk(micro), strict=True):
            (F.mse_loss(model(xb), tb) / micro).backward()
        mkor.step()
        vectors.append(torch.cat([mkor.layers[0].a_vec, mkor.layers[0].g_vec]))
    torch.testing.assert_close(vectors[0], vectors[1])


# The step --------------------------------------------------------------------------------
def test_first_step_preconditions_with_the_updated_inverses_and_rescales() -> None:
    torch.manual_seed(5)
    model = nn.Linear(4, 3).to(F64)
    gamma = 0.8
    mkor = MKORPreconditioner(model, inv_update_steps=1, stat_decay=gamma, dtype="float64")
    x = torch.randn(6, 4, dtype=F64)
    F.mse_loss(model(x), torch.randn(6, 3, dtype=F64)).backward()
    raw = torch.cat([model.weight.grad, model.bias.grad.reshape(-1, 1)], dim=1).clone()
    mkor.step()
    layer = mkor.layers[0]
    a, g = layer.a_vec, layer.g_vec
    left = torch.linalg.inv(gamma * torch.eye(3, dtype=F64) + (1 - gamma) * torch.outer(g, g))
    right = torch.linalg.inv(gamma * torch.eye(5, dtype=F64) + (1 - gamma) * torch.outer(a, a))
    p = left @ raw @ right
    expected = p * raw.norm() / p.norm()
    torch.testing.assert_close(model.weight.grad, expected[:, :4])
    torch.testing.assert_close(model.bias.grad, expected[:, 4])


@pytest.mark.parametrize("rule", ["exact", "paper", "official"])
def test_the_step_applies_the_chosen_rule_over_several_updates(rule: str) -> None:
    torch.manual_seed(12)
    model = nn.Linear(3, 2).to(F64)
    gamma = 0.7
    mkor = MKORPreconditioner(model, inv_update_steps=1, stat_decay=gamma, update_rule=rule,
                              dtype="float64", epsilon=math.inf)
    left, right = torch.eye(2, dtype=F64), torch.eye(4, dtype=F64)
    for _ in range(4):
        model.zero_grad()
        F.mse_loss(model(torch.randn(5, 3, dtype=F64)), torch.randn(5, 2, dtype=F64)).backward()
        mkor.step()
        layer = mkor.layers[0]
        left = update_inverse(left, layer.g_vec, gamma, rule)
        right = update_inverse(right, layer.a_vec, gamma, rule)
        torch.testing.assert_close(layer.g_inv, left)
        torch.testing.assert_close(layer.a_inv, right)


def test_inverses_change_only_on_update_steps_but_every_step_is_preconditioned() -> None:
    torch.manual_seed(6)
    model = nn.Linear(3, 2)
    mkor = MKORPreconditioner(model, inv_update_steps=3)
    snapshots = []
    for step in range(4):
        model.zero_grad()
        F.mse_loss(model(torch.randn(5, 3)), torch.randn(5, 2)).backward()
        raw = model.weight.grad.clone()
        mkor.step()
        snapshots.append(mkor.layers[0].a_inv.clone())
        if step > 0:
            assert not torch.allclose(model.weight.grad, raw)
    assert not torch.equal(snapshots[0], torch.eye(4))  # step 0 updates
    assert torch.equal(snapshots[1], snapshots[0]) and torch.equal(snapshots[2], snapshots[0])
    assert not torch.equal(snapshots[3], snapshots[0])  # step 3 updates


def test_metrics_report_the_stat_decay_the_last_step_used() -> None:
    """With a scheduled ``γ`` the logged value is the one the step just taken used (it was the
    next step's, beside that step's stage times), and logging after a schedule's last step
    does not read past it."""
    torch.manual_seed(6)
    model = nn.Linear(3, 2)
    schedule = {0: 0.9, 1: 0.5}
    mkor = MKORPreconditioner(model, stat_decay=lambda step: schedule[step])
    for step in range(2):
        model.zero_grad()
        F.mse_loss(model(torch.randn(5, 3)), torch.randn(5, 2)).backward()
        mkor.step()
        assert mkor.metrics()["stat_decay"] == schedule[step]


def test_half_precision_inverse_storage() -> None:
    torch.manual_seed(7)
    results = {}
    for storage in (None, "float16"):
        torch.manual_seed(8)
        model = nn.Linear(6, 4)
        mkor = MKORPreconditioner(model, inv_update_steps=1, inverse_dtype=storage)
        F.mse_loss(model(torch.randn(10, 6)), torch.randn(10, 4)).backward()
        mkor.step()
        results[storage] = (model.weight.grad.clone(), mkor.memory_usage()["inverses"],
                            mkor.layers[0].a_inv.dtype)
    assert results["float16"][2] == torch.float16
    assert results["float16"][1] * 2 == results[None][1]
    torch.testing.assert_close(results["float16"][0], results[None][0], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16, torch.float64])
def test_an_inverse_kept_in_another_dtype_is_updated_by_blocks_as_by_one_whole_cast(
        storage: torch.dtype, in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An inverse kept in another dtype than the fp32 arithmetic is read and updated a block
    of rows at a time (here 3 rows of 10: four blocks, the last of one row, with the shift on
    each block's part of the diagonal), bit for bit what casting the whole matrix, updating
    it and casting it back gives; out of place, the kept matrix is untouched."""
    monkeypatch.setattr(mkor_module, "CAST_BLOCK_ENTRIES", 30)
    gen = torch.Generator().manual_seed(5)
    root = torch.randn(10, 10, generator=gen)
    kept = (root @ root.T / 10 + torch.eye(10)).inverse().to(storage)
    before = kept.clone()
    v = torch.randn(10, generator=gen)
    terms = update_terms(kept, v, 0.9, "exact", blend=0.8)  # ζ < 1: a diagonal shift
    assert terms.shift != 0
    whole = before.float()
    torch.testing.assert_close(terms.u, (whole @ v).mul_(0.8).add_(v, alpha=0.2), rtol=0, atol=0)
    expected = torch.addr(whole, terms.u, terms.u, beta=terms.scale, alpha=terms.coeff)
    expected.diagonal().add_(terms.shift)
    new = apply_update(kept, terms, in_place=in_place)
    assert new.dtype == storage and (new is kept) == in_place
    assert torch.equal(new, expected.to(storage))
    if not in_place:
        assert torch.equal(kept, before)


def test_inverses_are_cast_by_blocks_of_rows_on_the_cpu_only() -> None:
    """A 3,000-square inverse: blocks of 349 rows (2²⁰ entries) on the CPU, the last one of
    the 208 left, so each row is cast once and no buffer is larger than the matrix; one block
    for a matrix within 2²⁰ entries, and elsewhere (a meta tensor stands in for a GPU's)."""
    blocks = mkor_module.row_blocks(torch.empty(3000, 3000, dtype=torch.bfloat16))
    assert blocks == [slice(s, min(s + 349, 3000)) for s in range(0, 3000, 349)]
    assert blocks[-1] == slice(2792, 3000)
    assert mkor_module.row_blocks(torch.empty(257, 257)) == [slice(0, 257)]
    assert mkor_module.row_blocks(torch.empty(3000, 3000, device="meta")) == [slice(0, 3000)]


@pytest.mark.parametrize("storage", [None, "bfloat16"])
def test_bf16_products_apply_the_inverses_in_bf16_close_to_the_exact_product(
        storage: str | None) -> None:
    """``precondition_dtype="bfloat16"`` writes ``L⁻¹ ∇W̄ R⁻¹`` of bf16 operands (the stored
    inverses as they are when kept in bf16; a cast of fp32 ones otherwise), in the gradient's
    fp32, within bf16's rounding of the float64 product. The wider input side goes first as
    a transposed product, which applies ``R⁻¹ᵀ``: the updates keep the inverses symmetric to
    within fp32 rounding, far below bf16's."""
    torch.manual_seed(21)
    model = nn.Linear(24, 6)  # a_dim 25 > g_dim 6: the transposed orientation
    mkor = MKORPreconditioner(model, inv_update_steps=1, inverse_dtype=storage,
                              precondition_dtype="bfloat16", rescale=False)
    layer = mkor.layers[0]
    for _ in range(4):  # the inverses are updated on each step, then applied
        model.zero_grad()
        F.mse_loss(model(torch.randn(16, 24)), torch.randn(16, 6)).backward()
        raw = layer.helper.grad_matrix().clone()
        mkor.step()
    for inverse in (layer.a_inv, layer.g_inv):
        wide = inverse.double()
        assert (wide - wide.T).abs().max() <= 1e-6 * wide.abs().max()
    g_inv, a_inv = layer.g_inv.to(torch.bfloat16), layer.a_inv.to(torch.bfloat16)
    written = layer.helper.grad_matrix()
    assert written.dtype == torch.float32
    torch.testing.assert_close(written, inverse_product(raw, g_inv, a_inv).float(),
                               rtol=0, atol=0)
    exact = layer.g_inv.double() @ raw.double() @ layer.a_inv.double()
    error = (written.double() - exact).norm() / exact.norm()
    assert 1e-6 < error < 2e-2  # rounded to bf16, and no more than that


def test_an_update_out_of_range_for_the_storage_dtype_is_skipped_and_counted() -> None:
    torch.manual_seed(13)
    model = nn.Linear(3, 2)
    # γ = 0.01 and no stabiliser: unexcited directions of R⁻¹ grow 100-fold per update, past
    # fp16's range (65504) on the third update.
    mkor = MKORPreconditioner(model, inv_update_steps=1, stat_decay=0.01, epsilon=math.inf,
                              inverse_dtype="float16")
    for _ in range(3):
        model.zero_grad()
        F.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 2)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mkor.step()
    assert mkor.metrics()["update_failures"] >= 1
    assert all(torch.isfinite(t).all() for t in (mkor.layers[0].a_inv, mkor.layers[0].g_inv))
    assert torch.isfinite(model.weight.grad).all()


def test_a_rescale_out_of_the_arithmetic_range_is_done_again_in_float64() -> None:
    """Inverses far from unit size (the paper's rule shrinks ``L⁻¹`` by about ``γ`` per
    update) make ``‖P‖²`` underflow fp32 while ``P`` is an ordinary number: the rescale read
    inf and the written gradient was inf, with no warning. Now the layer is done again in
    float64 and gets the float64 closed form; an exact zero gradient stays zero."""
    torch.manual_seed(14)
    model = nn.Linear(4, 3)
    mkor = MKORPreconditioner(model, inv_update_steps=1)
    layer = mkor.layers[0]
    F.mse_loss(model(torch.randn(6, 4)), torch.randn(6, 3)).backward()
    mkor.step()  # one update, so that the statistics exist
    layer.g_inv = layer.g_inv * 1e-20
    layer.a_inv = layer.a_inv * 1e-20
    model.zero_grad()
    F.mse_loss(model(torch.randn(6, 4)), torch.randn(6, 3)).backward()
    raw = torch.cat([model.weight.grad, model.bias.grad.reshape(-1, 1)], dim=1).double()
    mkor._capturing = False  # precondition with these inverses, no update
    mkor.layers[0].discard_pending()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mkor.step()
    p = layer.g_inv.double() @ raw @ layer.a_inv.double()
    expected = (p * raw.norm() / p.norm()).float()
    torch.testing.assert_close(model.weight.grad, expected[:, :4])
    torch.testing.assert_close(model.bias.grad, expected[:, 4])
    assert mkor.metrics()["wide_rescales"] == 1 and mkor.metrics()["nonfinite_preconditioned"] == 0
    model.weight.grad.zero_()
    model.bias.grad.zero_()
    mkor._capturing = False
    mkor.step()
    assert not model.weight.grad.any() and mkor.metrics()["wide_rescales"] == 1


def test_a_preconditioned_gradient_beyond_the_range_keeps_the_raw_gradient_and_warns() -> None:
    """Inverses so large that ``P`` itself overflows fp32 (no stabiliser, no rescale): the
    layer keeps its raw gradient, with a warning and a count that a checkpoint keeps."""
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(4, 3, bias=False))
    mkor = MKORPreconditioner(model, inv_update_steps=1, rescale=False)
    layer = mkor.layers[0]
    layer.g_inv = torch.eye(3) * 1e30
    layer.a_inv = torch.eye(4) * 1e30
    mkor._capturing = False
    F.mse_loss(model(torch.randn(6, 4)), torch.randn(6, 3)).backward()
    raw = model[0].weight.grad.clone()
    with pytest.warns(UserWarning, match="non-finite preconditioned gradient in 0;"):
        mkor.step()
    torch.testing.assert_close(model[0].weight.grad, raw)
    assert mkor.metrics()["nonfinite_preconditioned"] == 1
    fresh = MKORPreconditioner(nn.Sequential(nn.Linear(4, 3, bias=False)), rescale=False)
    fresh.load_state_dict(mkor.state_dict())
    assert fresh.metrics()["nonfinite_preconditioned"] == 1


class _TiedMixedBias(nn.Module):
    """One weight used by a layer with a bias and, after it, by one without."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_a_weight_tied_to_a_later_layer_without_bias_is_preconditioned_from_the_raw_gradient(
        ) -> None:
    """The first layer wrote its ``P`` into the shared ``.grad`` in place, and the second,
    whose gradient is a view of that ``.grad``, preconditioned ``P`` again; now it starts from
    the raw gradient, and (the last layer written) sets the shared ``.grad``."""
    torch.manual_seed(16)
    model = _TiedMixedBias().double()
    mkor = MKORPreconditioner(model, inv_update_steps=1, dtype="float64")
    F.mse_loss(model(torch.randn(5, 4, dtype=F64)), torch.randn(5, 4, dtype=F64)).backward()
    raw = model.first.weight.grad.clone()
    mkor.step()
    second = next(layer for layer in mkor.layers if layer.name == "second")
    p = second.g_inv @ raw @ second.a_inv
    torch.testing.assert_close(model.second.weight.grad, p * raw.norm() / p.norm())


class _TinyBert(nn.Module):
    """Named like HF's BertForPreTraining where it matters: ``cls.predictions.decoder``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.cls = nn.Module()
        self.cls.predictions = nn.Module()
        self.cls.predictions.decoder = nn.Linear(4, 50)
        self.head = nn.Linear(4, 40)


def test_bert_decoder_skipped_by_default_and_vocab_threshold() -> None:
    names = [layer.name for layer in MKORPreconditioner(_TinyBert()).layers]
    assert names == ["encoder", "head"]
    names = [layer.name for layer in
             MKORPreconditioner(_TinyBert(), vocab_size_threshold=40).layers]
    assert names == ["encoder"]
    names = [layer.name for layer in MKORPreconditioner(_TinyBert(), skip_layers=()).layers]
    assert names == ["encoder", "cls.predictions.decoder", "head"]


def test_hf_bert_decoder_is_skipped_by_default_and_the_rest_steps() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16)
    torch.manual_seed(14)
    model = transformers.BertForPreTraining(config)
    mkor = MKORPreconditioner(model, inv_update_steps=1)
    names = [layer.name for layer in mkor.layers]
    assert "cls.predictions.decoder" not in names
    assert "bert.encoder.layer.0.attention.self.query" in names  # 3-D Linear inputs
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids, next_sentence_label=torch.tensor([0, 1])).loss.backward()
    mkor.step()
    assert mkor.metrics()["update_failures"] == 0


@pytest.mark.parametrize(("options", "field"), [
    ({"update_rule": "approx"}, "update_rule"),
    ({"stat_decay": 1.0}, "stat_decay"),
    ({"inv_update_steps": 0}, "inv_update_steps"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"zeta": 1.5}, "zeta"),
    ({"inverse_dtype": "int8"}, "inverse_dtype"),
    ({"precondition_dtype": "float16"}, "precondition_dtype"),
    ({"comm_dtype": "float8"}, "comm_dtype"),
    ({"vocab_size_threshold": 0}, "vocab_size_threshold"),
    ({"damping": 0.1}, "damping"),
])
def test_config_errors_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        MKORPreconditioner(nn.Linear(2, 2), **options)
    assert err.value.field_name == field


@pytest.mark.parametrize(("options", "warns"), [
    ({"stat_decay": 0.9, "zeta": 0.9}, True),
    ({"stat_decay": 0.8}, True),
    ({"stat_decay": 0.8, "epsilon": math.inf}, False),  # no stabiliser
    ({"stat_decay": 0.8, "update_rule": "official"}, False),  # bounded by its own blend
    ({"stat_decay": lambda step: 0.8}, False),  # a schedule is not judged
    ({}, False),
])
def test_a_stabiliser_that_cannot_bound_the_exact_inverse_is_reported(options: dict,
                                                                       warns: bool) -> None:
    """Under the exact rule a direction the statistics do not excite grows by ``ζ/γ`` per
    update where the stabiliser fires: ``ζ ≥ γ`` never bounds it (the docs said the blend
    kept the inverse bounded), and an unexcited ``R⁻¹`` entry grows past 10 within 100
    updates at ``γ = ζ = 0.9`` while it stays near ``(1 − ζ)/(γ − ζ) = 2`` at the defaults."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MKORConfig(**options)
    assert any("cannot bound" in str(w.message) for w in caught) == warns


@pytest.mark.parametrize(("gamma", "bounded"), [(0.95, True), (0.9, False)])
def test_the_stabiliser_bounds_an_unexcited_direction_only_below_gamma(gamma: float,
                                                                       bounded: bool) -> None:
    """The rank-1 statistics excite one input direction only; the other's entry of ``R⁻¹``
    grows by ``1/γ`` per update and is blended back by ``ζ = 0.9`` when it passes ``ε``."""
    layer = nn.Linear(2, 1, bias=False).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mkor = MKORPreconditioner(layer, inv_update_steps=1, stat_decay=gamma, dtype="float64")
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    for _ in range(100):
        layer.zero_grad()
        layer(x).sum().backward()
        mkor.step()
    unexcited = mkor.layers[0].a_inv[1, 1].item()
    assert (unexcited < 2.5) == bounded, unexcited


@pytest.mark.parametrize(("rule", "epsilon"), [("exact", 1.5), ("paper", 1.5), ("official", 0.9)])
def test_the_cached_stabiliser_trigger_is_the_largest_entry_of_each_inverse(
        rule: str, epsilon: float) -> None:
    """Each update keeps ``max |·|`` of the new inverse for the next stabiliser decision,
    taken from its diagonal where the result is certainly finite (the inverses stay
    symmetric positive definite): it must equal the largest entry in magnitude of the whole
    matrix, here over updates that grow the inverses past ``ε`` and fire the stabiliser (the
    official rule blends towards ``I`` and keeps entries below 1, so its ``ε`` is lower)."""
    torch.manual_seed(3)
    model = nn.Linear(6, 5)
    mkor = MKORPreconditioner(model, inv_update_steps=1, update_rule=rule, epsilon=epsilon)
    layer = mkor.layers[0]
    for _ in range(25):
        model.zero_grad()
        model(torch.randn(4, 6) * 3).pow(2).mean().backward()
        mkor.step()
        for peak, inverse in ((layer._a_peak, layer.a_inv), (layer._g_peak, layer.g_inv)):
            assert peak == pytest.approx(inverse.abs().max().item(), rel=1e-6)
    assert mkor.metrics()["stabilisations"] > 0
    assert mkor.metrics()["update_failures"] == 0


@pytest.mark.parametrize("rule", ["exact", "official"])
def test_a_zero_sherman_morrison_denominator_is_a_counted_failure(rule: str) -> None:
    """An inverse gone indefinite (here one given to the layer) can make the update's
    denominator exactly zero: the update is skipped and counted, not raised."""
    mkor = MKORPreconditioner(nn.Linear(2, 1, bias=False), inv_update_steps=1,
                              stat_decay=0.5, update_rule=rule, epsilon=math.inf)
    layer = mkor.layers[0]
    # exact: 1 + ((1 − γ)/γ)·vᵀMv = 1 + m11; official: 1 + vᵀ(γM + (1 − γ)I)v = 1.5 + m11/2
    start = torch.diag(torch.tensor([-1.0 if rule == "exact" else -3.0, 1.0]))
    layer.a_inv = start.clone()
    with pytest.warns(UserWarning, match="not finite"):
        layer.update(torch.tensor([1.0, 0.0]), torch.tensor([0.5]), gamma=0.5, rule=rule,
                     epsilon=math.inf, zeta=0.9)
    assert layer.update_failures == 1
    assert torch.equal(layer.a_inv, start)


def test_an_update_with_a_negative_denominator_takes_the_peak_of_the_whole_matrix() -> None:
    """An indefinite inverse (one given to the layer) whose Sherman–Morrison denominator is
    negative: the result is not definite, so its largest entry need not lie on the diagonal
    (here it does not), and the cached stabiliser trigger must be the whole matrix's."""
    mkor = MKORPreconditioner(nn.Linear(2, 1, bias=False), inv_update_steps=1,
                              dtype="float64")
    layer = mkor.layers[0]
    layer.a_inv = torch.tensor([[-7.43, 3.69], [3.69, -5.78]], dtype=torch.float64)
    layer.update(torch.tensor([1.68, -1.74], dtype=torch.float64),
                 torch.tensor([0.5], dtype=torch.float64), gamma=0.95, rule="exact",
                 epsilon=2.0, zeta=0.9)
    largest = layer.a_inv.abs().max().item()
    assert largest > 1.5 * layer.a_inv.diagonal().abs().max().item()
    assert layer._a_peak == largest


def test_state_dict_round_trip_gives_the_same_next_step() -> None:
    torch.manual_seed(9)
    data = [(torch.randn(6, 3, 5, 5), torch.randint(0, 4, (6,))) for _ in range(4)]

    def make() -> nn.Module:
        torch.manual_seed(10)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 4))

    def run(model: nn.Module, mkor: MKORPreconditioner, batches: list) -> torch.Tensor:
        for x, y in batches:
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            mkor.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    first = make()
    mkor = MKORPreconditioner(first, inv_update_steps=2, config=None)
    run(first, mkor, data[:3])
    saved = mkor.state_dict()
    second = make()
    second.load_state_dict(first.state_dict())
    resumed = MKORPreconditioner(second, config=MKORConfig(inv_update_steps=2))
    resumed.load_state_dict(saved)
    torch.testing.assert_close(run(second, resumed, data[3:]), run(first, mkor, data[3:]))
    saved["layers"]["9"] = saved["layers"].pop("3")  # a state of another model
    with pytest.raises(ValueError, match=r"missing \['3'\], unexpected \['9'\]"):
        resumed.load_state_dict(saved)
    layer = resumed.layers[0]
    wrong = dict(layer.state_dict(), a_inv=torch.eye(layer.a_dim + 1))
    with pytest.raises(ValueError, match=f"{layer.name}: saved a_inv has shape"):
        layer.load_state_dict(wrong)


# Averaging across ranks (2 gloo processes) -----------------------------------------------
def _distributed_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(11)
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
        mkor = MKORPreconditioner(model, inv_update_steps=1, comm_dtype="float16")
        x, target = _rank_batch(rank)
        F.mse_loss(model(x), target).backward()
        mkor.step()
        entries = [entry.as_tuple() for entry in mkor.communicator.ledger.entries]
        torch.save({"vectors": [(layer.a_vec, layer.g_vec) for layer in mkor.layers],
                    "ledger": entries, "metrics": mkor.metrics()},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 2, 4, 4, generator=gen), torch.randn(4, 2, generator=gen)


@pytest.mark.distributed
def test_all_reduce_averages_dividing_by_the_world_size_once(tmp_path: Path) -> None:
    world = 2
    mp.spawn(_distributed_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
             nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    # Reference: each rank's local statistics, computed in this process, then averaged once.
    local = []
    for rank in range(world):
        torch.manual_seed(11)
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
        mkor = MKORPreconditioner(model, inv_update_steps=1)
        x, target = _rank_batch(rank)
        F.mse_loss(model(x), target).backward()
        mkor.step()
        local.append([(layer.a_vec, layer.g_vec) for layer in mkor.layers])
    for i in range(2):
        for j in range(2):
            expected = (local[0][i][j] + local[1][i][j]) / world
            for result in results:  # fp16 on the wire
                torch.testing.assert_close(result["vectors"][i][j], expected,
                                           rtol=2e-3, atol=2e-3)
    elements = (18 + 1 + 3) + (12 + 1 + 2)  # Σ (a_dim + g_dim), biases included
    for result in results:
        (entry,) = result["ledger"]
        step, stage, op, dtype, recorded_elements, nbytes, group = entry[:7]
        assert (step, stage, op, dtype) == (0, "factor_comm", "all_reduce", "float16")
        assert (recorded_elements, nbytes, group) == (elements, 2 * elements, world)
        assert result["metrics"]["comm/bytes"] == 2 * elements


# Training ------------------------------------------------------------------------------
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _fashion_mnist(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` training examples, parsed from the IDX files (images scaled to [0, 1])."""
    with gzip.open(FASHION_MNIST / "train-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(16 + n * 784)[16:], dtype=np.uint8)
    with gzip.open(FASHION_MNIST / "train-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(8 + n)[8:], dtype=np.uint8)
    x = torch.from_numpy(images.astype(np.float32) / 255.0).reshape(n, 1, 28, 28)
    return x, torch.from_numpy(labels.astype(np.int64))


@pytest.mark.integration
@pytest.mark.skipif(not FASHION_MNIST.exists(), reason="Fashion-MNIST is not installed")
def test_mkor_with_sgd_lowers_the_loss_on_fashion_mnist() -> None:
    torch.manual_seed(0)
    x, y = _fashion_mnist(512)
    model = nn.Sequential(nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 12 * 12, 10))
    mkor = MKORPreconditioner(model, inv_update_steps=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(40):
        idx = torch.arange(step * 64, (step + 1) * 64) % 512
        sgd.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        mkor.step()
        sgd.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8
    assert mkor.metrics()["update_failures"] == 0


def test_the_stabiliser_blends_the_layers_inverses_when_they_grow_past_epsilon() -> None:
    """Through the preconditioner (every other step test disables it or starts from I, which
    the blend leaves as it is): each update whose inverse's largest entry exceeded ε blends it
    towards I with weight ζ, and is counted."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    mkor = MKORPreconditioner(model, inv_update_steps=1, dtype="float64", epsilon=1.02,
                              zeta=0.9)
    expected = torch.eye(4, dtype=torch.float64)
    fired = 0
    for _ in range(3):
        model.zero_grad()
        F.mse_loss(model(torch.randn(5, 3, dtype=torch.float64)),
                   torch.randn(5, 2, dtype=torch.float64)).backward()
        mkor.step()
        layer = mkor.layers[0]
        blend = 0.9 if stabiliser_fires(expected, epsilon=1.02) else 1.0
        fired += blend != 1.0
        expected = update_inverse(expected, layer.a_vec, 0.95, "exact", blend=blend)
        torch.testing.assert_close(layer.a_inv, expected)
    assert fired >= 1
    assert mkor.metrics()["stabilisations"] >= fired


@pytest.mark.parametrize("size", [1.0, 1e6])
@pytest.mark.parametrize("rule", ["exact", "paper", "official"])
def test_a_statistic_whose_quadratic_form_overflows_float32_updates_as_in_float64(
        rule: str, size: float) -> None:
    """``vᵀL⁻¹v`` of a statistic near 3e19 (a diverging step's) overflowed float32: the
    Sherman–Morrison coefficient became 0 and every rule kept ``scale·L⁻¹ + shift·I``, a
    finite inverse, wrong and uncounted. The form is taken in float64, and a coefficient
    below float32's normal range (from 3e25) is applied as ``(√|c|·u)(√|c|·u)ᵀ``: the float32
    update is the float64 one."""
    v = torch.tensor([3e19, 1e19, 0.0]) * size
    got = update_inverse(torch.eye(3), v, 0.95, rule)
    want = update_inverse(torch.eye(3, dtype=F64), v.double(), 0.95, rule)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got.double(), got[2, 2].double() * torch.eye(3, dtype=F64))


def test_a_float64_statistic_beyond_the_square_root_of_its_range_raises_nothing() -> None:
    """``max|u|²`` was a Python float power, which raises ``OverflowError`` (where a product
    gives inf) once ``u`` passes 1.3e154: a float64 MKOR step crashed instead of leaving the
    layer first-order, counted."""
    layer = nn.Linear(4, 3).double()
    mkor = MKORPreconditioner(layer, dtype="float64")
    layer(torch.full((8, 4), 1e155, dtype=F64)).sum().backward()
    raw = layer.weight.grad.clone()
    with pytest.warns(UserWarning, match="left first-order"):
        mkor.step()
    assert torch.equal(layer.weight.grad, raw) and mkor.metrics()["nonfinite_preconditioned"] == 1
