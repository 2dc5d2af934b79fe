"""K-FAC's factor reduction when ranks do not run the same layers in the same order: a layer
that runs on some ranks only (data-dependent routing, an unused branch) is averaged with zeros
from the others instead of desynchronising the collectives, a layer no rank ran keeps no
factors, a layer first run after the first inversion is inverted as soon as every rank can
agree it has factors, and with ``factors_in_backward`` the buckets hold the same layers on every
rank whatever order the backward passes finish them in."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core import KFACPreconditioner
from core.distributed import average_gradients
from tests.distributed.helpers import run_workers


class Routed(nn.Module):
    """``fc`` then, when ``route`` says so, a residual ``branch``; ``a`` and ``b`` (same shape)
    in an order that depends on ``a_first``; a head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor, *, branch: bool, a_first: bool = True) -> Tensor:
        h = torch.tanh(self.fc(x))
        if branch:
            h = h + self.branch(h)
        h = self.b(torch.tanh(self.a(h))) if a_first else self.a(torch.tanh(self.b(h)))
        return self.head(torch.tanh(h))


def data(rank: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(20 + rank)
    return torch.randn(6, 4, generator=generator), torch.randint(0, 2, (6,), generator=generator)


def model() -> Routed:
    torch.manual_seed(0)
    return Routed()


def factors_after_steps(rank: int, world_size: int, strategy: str, branch_on: list[bool],
                        factors_in_backward: bool = False, a_first: bool = True
                        ) -> dict[str, object]:
    """Running factors after one step per entry of ``branch_on`` (whether this rank runs the
    branch that step), and the warnings raised."""
    torch.set_num_threads(1)
    net = model()
    precond = KFACPreconditioner(net, strategy=strategy, factor_decay=0.0, kl_clip=None,
                                 factors_in_backward=factors_in_backward)
    x, y = data(rank)
    for p in net.parameters():  # every rank averages every gradient (DDP would too)
        p.grad = torch.zeros_like(p)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for on in branch_on:
            net.zero_grad(set_to_none=False)
            F.cross_entropy(net(x, branch=on, a_first=a_first), y).backward()
            average_gradients(net.parameters(), precond.strategy.communicator)
            precond.step()
    return {"factors": {layer.name: (layer.a.value, layer.g.value) for layer in precond.layers},
            "warnings": [str(w.message) for w in caught]}


def branch_on_rank_zero(rank: int, world_size: int, strategy: str) -> dict[str, object]:
    return factors_after_steps(rank, world_size, strategy, [rank == 0])


def branch_nowhere_then_on_rank_zero(rank: int, world_size: int, strategy: str
                                     ) -> dict[str, object]:
    first = factors_after_steps(rank, world_size, strategy, [False])
    return {"first": first, "both": factors_after_steps(rank, world_size, strategy,
                                                        [False, rank == 0])}


def single_process_branch_a() -> Tensor:
    """The branch's ``A`` from rank 0's data alone (``A`` does not depend on the world size
    under KAISA's scaling)."""
    net = model()
    precond = KFACPreconditioner(net, factor_decay=0.0, kl_clip=None)
    x, y = data(0)
    F.cross_entropy(net(x, branch=True), y).backward()
    precond.step()
    a = next(layer for layer in precond.layers if layer.name == "branch").a.value
    assert a is not None
    return a


@pytest.mark.parametrize("strategy", ["comm-opt", "d-kfac", "osawa"])
def test_a_layer_run_on_one_rank_is_averaged_with_zeros_from_the_other(strategy: str) -> None:
    """Before, the ranks' factor collectives had different layouts: gloo aborted, or (osawa)
    both ranks hung."""
    expected = single_process_branch_a() / 2
    results = run_workers(branch_on_rank_zero, 2, strategy, timeout=120)
    holders = [r for r in results if r["factors"]["branch"][0] is not None]
    assert holders  # every rank (all-reduce) or the owner (osawa)
    for result in holders:
        torch.testing.assert_close(result["factors"]["branch"][0], expected)
    assert not any("branch" in w for w in results[0]["warnings"])
    assert any("branch: no factors captured on this rank" in w
               for w in results[1]["warnings"])


@pytest.mark.parametrize("strategy", ["comm-opt", "osawa"])
def test_a_layer_no_rank_ran_keeps_no_factors(strategy: str) -> None:
    """Zeros from every rank are no factor: the running average is not started (or pulled
    towards zero) by them, as in one process."""
    results = run_workers(branch_nowhere_then_on_rank_zero, 2, strategy, timeout=120)
    for result in results:
        assert result["first"]["factors"]["branch"] == (None, None)
    holders = [r["both"] for r in results if r["both"]["factors"]["branch"][0] is not None]
    assert holders
    for result in holders:
        torch.testing.assert_close(result["factors"]["branch"][0],
                                   single_process_branch_a() / 2)


def routed_order(rank: int, world_size: int, factors_in_backward: bool) -> dict[str, object]:
    """Rank 0 runs ``a`` before ``b``, rank 1 ``b`` before ``a``: their backward passes finish
    the two same-shaped layers in opposite orders."""
    return factors_after_steps(rank, world_size, "comm-opt", [True],
                               factors_in_backward=factors_in_backward, a_first=rank == 0)


def test_factors_in_backward_buckets_the_same_layers_whatever_order_backward_finishes_them(
        ) -> None:
    """Before, each rank handed its layers over in the order its backward pass finished them,
    so ``a``'s factors on one rank were summed with ``b``'s from the other."""
    in_model_order = run_workers(routed_order, 2, False, timeout=120)
    in_backward = run_workers(routed_order, 2, True, timeout=120)
    for reference, got in zip(in_model_order, in_backward, strict=True):
        for name in ("a", "b"):
            for side in (0, 1):
                torch.testing.assert_close(got["factors"][name][side],
                                           reference["factors"][name][side])
    for name in ("a", "b"):  # and every rank holds the same averages
        torch.testing.assert_close(in_backward[0]["factors"][name][0],
                                   in_backward[1]["factors"][name][0])


def overflow_or_skip(rank: int, world_size: int, strategy: str, how: str) -> dict[str, object]:
    """With ``factors_in_backward``, a step whose gradients overflow (or that the caller
    skips) while rank 1 did not run the branch; then a normal step."""
    torch.set_num_threads(1)
    net = model()
    precond = KFACPreconditioner(net, strategy=strategy, factor_decay=0.0, kl_clip=None,
                                 factors_in_backward=True)
    x, y = data(rank)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            net.zero_grad(set_to_none=False)
            F.cross_entropy(net(x, branch=rank == 0), y).backward()
            average_gradients(net.parameters(), precond.strategy.communicator)
            if step == 0 and how == "skip":
                precond.skip_step()
                continue
            if step == 0:
                net.fc.weight.grad[0, 0] = float("inf")
            precond.step()
    return {"skipped": precond.skipped_overflow_steps,
            "factors": {layer.name: layer.a.value for layer in precond.layers}}


@pytest.mark.parametrize("strategy", ["comm-opt", "osawa"])
@pytest.mark.parametrize("how", ["overflow", "skip"])
def test_an_overflowed_or_skipped_step_settles_the_same_collectives_on_every_rank(
        strategy: str, how: str) -> None:
    """Each rank had handed over the layers it ran; the rest are handed over before the
    reduction is completed and discarded (before, gloo aborted on mismatched sizes)."""
    results = run_workers(overflow_or_skip, 2, strategy, how, timeout=120)
    for result in results:
        assert result["skipped"] == 1
    holders = [r for r in results if r["factors"]["branch"] is not None]
    assert holders
    for result in holders:
        torch.testing.assert_close(result["factors"]["branch"], single_process_branch_a() / 2)


def handed_over_in_backward(rank: int, world_size: int, disabled: tuple[str, ...]
                            ) -> dict[str, object]:
    """Which layers the backward pass handed to the reduction, with a layer registered last
    that no forward pass runs, and the factor traffic of the step."""
    torch.set_num_threads(1)
    net = model()
    net.unused = nn.Linear(4, 4)  # registered last: first in reverse model order
    precond = KFACPreconditioner(net, strategy="comm-opt", kl_clip=None,
                                 factors_in_backward=True, disabled_stages=disabled)
    x, y = data(rank)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.cross_entropy(net(x, branch=True), y).backward()
        in_backward = sorted(precond._handed_over)
        average_gradients(net.parameters(), precond.strategy.communicator)
        precond.step()
    factor_bytes = sum(e.bytes for e in precond.strategy.communicator.ledger.entries
                       if e.stage == "factor_comm")
    return {"in_backward": in_backward, "factor_bytes": factor_bytes,
            "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("disabled", [("capture",), ("factors",)])
def test_with_capture_or_factors_disabled_no_factors_move(disabled: tuple[str, ...]) -> None:
    results = run_workers(handed_over_in_backward, 2, disabled, timeout=120)
    for result in results:
        assert result["in_backward"] == []
        assert result["factor_bytes"] == 0
        assert not any("no factors captured" in w for w in result["warnings"])


class Checkpointed(nn.Module):
    """``fc1``, then ``fc2`` and ``fc3`` inside a reentrant activation checkpoint, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 4)
        self.head = nn.Linear(4, 2)

    def segment(self, h: Tensor) -> Tensor:
        return torch.tanh(self.fc3(torch.tanh(self.fc2(h))))

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.fc1(x)).requires_grad_()
        return self.head(checkpoint(self.segment, h, use_reentrant=True))


def checkpointed_factors(rank: int, world_size: int, factors_in_backward: bool,
                         accumulation: int) -> dict[str, Tensor]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Checkpointed()
    precond = KFACPreconditioner(net, strategy="comm-opt", factor_decay=0.0, kl_clip=None,
                                 factors_in_backward=factors_in_backward,
                                 accumulation_steps=accumulation)
    x, y = data(rank)
    for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation), strict=True):
        (F.cross_entropy(net(xs), ys) / accumulation).backward()
    average_gradients(net.parameters(), precond.strategy.communicator)
    precond.step()
    return {layer.name: layer.a.value for layer in precond.layers}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_reentrant_checkpointing_keeps_factors_in_backward_exact(accumulation: int) -> None:
    """The checkpointed layers capture only in their recomputation, inside the backward pass:
    the hand-over waits for them rather than sending zeros (or part of their micro-batches)
    and staging them again."""
    reference = run_workers(checkpointed_factors, 2, False, accumulation, timeout=120)
    got = run_workers(checkpointed_factors, 2, True, accumulation, timeout=120)
    for expected, result in zip(reference, got, strict=True):
        for name, value in expected.items():
            torch.testing.assert_close(result[name], value, rtol=1e-6, atol=1e-7)


def ddp_routed(rank: int, world_size: int, factors_in_backward: bool) -> dict[str, object]:
    """Under DDP (one bucket per parameter, unused parameters found), rank 0 runs the branch
    and rank 1 does not, for three steps; factor buckets of one layer each."""
    torch.set_num_threads(1)
    net = model()
    ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1e-6,
                                              find_unused_parameters=True)
    precond = KFACPreconditioner(net, strategy="comm-opt", factor_decay=0.5, kl_clip=None,
                                 bucket_cap_mb=1e-6, factors_in_backward=factors_in_backward)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = data(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 1's zeros for the branch it did not run
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(ddp(x, branch=rank == 0), y).backward()
            precond.step()
            optimizer.step()
    return {"factors": {layer.name: (layer.a.value, layer.g.value) for layer in precond.layers},
            "weights": {name: p.detach().clone() for name, p in net.named_parameters()}}


def test_factors_in_backward_under_ddp_with_ranks_running_different_layers() -> None:
    """The factor buckets started in the backward pass and DDP's gradient buckets come in a
    different order on the two ranks (rank 1 holds back the layers after the branch it did
    not run); on one process group the collectives were matched across ranks by position,
    so they summed unrelated buffers or aborted. The library's collectives run on a group of
    their own: the same factors and weights as with factors built after the backward pass."""
    after = run_workers(ddp_routed, 2, False, timeout=120)
    during = run_workers(ddp_routed, 2, True, timeout=120)
    for reference, got in zip(after, during, strict=True):
        for name, (a, g) in reference["factors"].items():
            torch.testing.assert_close(got["factors"][name][0], a)
            torch.testing.assert_close(got["factors"][name][1], g)
        for name, weight in reference["weights"].items():
            torch.testing.assert_close(got["weights"][name], weight)
    torch.testing.assert_close(during[0]["weights"]["a.weight"], during[1]["weights"]["a.weight"])


def preconditioned_per_step(rank: int, world_size: int, strategy: str) -> dict[str, object]:
    """A branch no rank runs at step 0 and every rank runs from step 1, ``inv_update_steps=4``:
    per step, whether the branch's gradient was preconditioned, and the gradient written."""
    torch.set_num_threads(1)
    net = model()
    precond = KFACPreconditioner(net, strategy=strategy, inv_update_steps=4, kl_clip=None)
    x, y = data(rank)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    preconditioned, grads = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the branch's "nothing captured" at step 0
        for step in range(6):
            net.zero_grad(set_to_none=False)
            F.cross_entropy(net(x, branch=step > 0), y).backward()
            average_gradients(net.parameters(), precond.strategy.communicator)
            raw = net.branch.weight.grad.clone()
            precond.step()
            preconditioned.append(not torch.equal(net.branch.weight.grad, raw))
            grads.append(net.branch.weight.grad.clone())
    return {"preconditioned": preconditioned, "grads": grads}


def test_a_layer_first_run_after_the_first_inversion_is_inverted_at_once_in_one_process(
        ) -> None:
    """Before, it stayed first-order until the next multiple of ``inv_update_steps``."""
    assert preconditioned_per_step(0, 1, "comm-opt")["preconditioned"] == [
        False, True, True, True, True, True]


@pytest.mark.parametrize(("strategy", "first"), [("comm-opt", 2), ("mem-opt", 2), ("d-kfac", 2),
                                                 ("osawa", 4), ("dp-kfac", 4)])
def test_a_layer_first_run_later_is_inverted_at_the_next_step_where_every_rank_has_its_factors(
        strategy: str, first: int) -> None:
    """Where every rank holds every factor, a branch first run at step 1 is inverted at step 2
    (its factors of step 1 are averaged while step 1's gradients are preconditioned), on every
    rank alike; under ``osawa`` and ``dp-kfac``, where only its owner holds them, at the next
    inversion step (4). Every rank writes the same gradient."""
    results = run_workers(preconditioned_per_step, 2, strategy, timeout=120)
    expected = [step >= first for step in range(6)]
    for result in results:
        assert result["preconditioned"] == expected
    for ours, theirs in zip(results[0]["grads"], results[1]["grads"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("saved_before_the_key", [False, True])
def test_which_layers_were_inverted_survives_a_checkpoint(saved_before_the_key: bool) -> None:
    """A run resumed after step 0 inverts the branch first run at step 1 as the uninterrupted
    run does, also from a state saved before ``inverted_layers`` was kept (then every layer
    with factors counts as inverted)."""
    x, y = data(0)

    def run(precond: KFACPreconditioner, net: Routed, steps: range) -> list[list[Tensor]]:
        grads = []
        for step in steps:
            net.zero_grad()
            F.cross_entropy(net(x, branch=step > 0), y).backward()
            precond.step()
            grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
        return grads

    def fresh() -> tuple[Routed, KFACPreconditioner]:
        net = model()
        return net, KFACPreconditioner(net, inv_update_steps=4, kl_clip=None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the branch's "nothing captured" at step 0
        net, precond = fresh()
        uninterrupted = run(precond, net, range(3))
        net, precond = fresh()
        run(precond, net, range(1))
        state = precond.state_dict()
        assert state["inverted_layers"] == ["a", "b", "fc", "head"]
        if saved_before_the_key:
            del state["inverted_layers"]
        weights = copy.deepcopy(net.state_dict())
        net, precond = fresh()
        net.load_state_dict(weights)
        precond.load_state_dict(state)
        resumed = run(precond, net, range(1, 3))
    for ours, theirs in zip(resumed, uninterrupted[1:], strict=True):
        for mine, other in zip(ours, theirs, strict=True):
            torch.testing.assert_close(mine, other, rtol=0, atol=0)
