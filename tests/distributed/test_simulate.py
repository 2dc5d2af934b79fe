"""Paper-scale simulation: ResNet-50 and BERT-Large facts of KFAC_MATH.md / PAPERS.md §6,
read from ledgers that the strategy code fills against the recording transport."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from core.distributed import Communicator, simulate

PHI = 153_851_562
TRIANGLES = 76_967_027
PSI = 25_503_912
RANK1 = 82_492


@pytest.fixture(scope="module")
def resnet50() -> nn.Module:
    with torch.device("meta"):
        return torchvision.models.resnet50()


def test_resnet50_totals(resnet50: nn.Module) -> None:
    totals = simulate(resnet50, "d-kfac", 64, ranks=[0]).totals()
    assert totals["layers"] == 54
    assert totals["factor_elements"] == PHI
    assert totals["triangle_elements"] == TRIANGLES
    assert totals["preconditioned_params"] == PSI
    assert totals["rank1_elements"] == RANK1
    assert round(100 * totals["largest_inversion_share"], 1) == 21.6


def test_resnet50_factor_all_reduce_volumes(resnet50: nn.Module) -> None:
    full = simulate(resnet50, "d-kfac", 64, ranks=[0])
    assert full.per_worker(stage="factor_comm", op="all_reduce", field="elements") == [PHI]
    packed = simulate(resnet50, "comm-opt", 64, ranks=[5], symmetry_aware=True)
    assert packed.per_worker(stage="factor_comm", field="elements") == [TRIANGLES]
    assert packed.per_worker(stage="factor_comm", field="bytes") == [4 * TRIANGLES]


def test_resnet50_gradient_broadcast_and_dp_kfac_memory(resnet50: nn.Module) -> None:
    report = simulate(resnet50, "dp-kfac", 64, average_grads=False)
    assert "factor_comm" not in report.stages()
    assert report.per_worker(stage="grad_comm", field="elements") == [PSI] * 64
    traffic = report.per_worker(stage="grad_comm")
    assert sum(traffic) / 64 == pytest.approx(63 / 64 * 4 * PSI)
    assert sum(report.memory("factors")) == 4 * PHI  # each layer's factors on its owner only
    assert sum(report.memory("captured")) == 4 * PHI


def test_resnet50_mkor_rank1_vectors_through_the_communicator(resnet50: nn.Module) -> None:
    rank1 = int(simulate(resnet50, "d-kfac", 64, ranks=[0]).totals()["rank1_elements"])
    comm = Communicator.simulated(0, 64)
    comm.all_reduce(torch.empty(rank1, device="meta"), stage="factor_comm", average=True,
                    dtype=torch.float16)
    (entry,) = comm.ledger.entries
    assert (entry.elements, entry.bytes) == (RANK1, 2 * RANK1)


def test_bert_large_encoder_totals() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24,
                                     num_attention_heads=16, intermediate_size=4096)
    with torch.device("meta"):
        bert = transformers.BertModel(config, add_pooling_layer=False)
    report = simulate(bert, "d-kfac", 64, ranks=[0], average_grads=False)
    totals = report.totals()
    assert totals["layers"] == 144
    assert totals["factor_elements"] == 1_057_407_120
    assert totals["rank1_elements"] == 442_512
    assert report.per_worker(stage="factor_comm", field="elements") == [1_057_407_120]


def test_resnet50_per_rank_work(resnet50: nn.Module) -> None:
    """Who captures, inverts and preconditions what, per simulated rank."""
    d_kfac = simulate(resnet50, "d-kfac", 64, ranks=[3], average_grads=False).ranks[0]
    assert (len(d_kfac.captured), len(d_kfac.inverted), len(d_kfac.preconditioned)) == (54, 108,
                                                                                       54)
    report = simulate(resnet50, "dp-kfac", 64, average_grads=False, assignment="round-robin")
    for rank in report.ranks:
        owned = tuple(w.name for i, w in enumerate(report.layers) if i % 64 == rank.rank)
        assert rank.captured == rank.preconditioned == owned
        assert rank.inverted == tuple((name, side) for name in owned for side in "ag")


def test_received_gradients_are_held_once_not_again_in_a_flat_copy() -> None:
    """DP-KFAC on 2 ranks, each owning 2 of 4 identical layers (9 x 8 = 72 elements): a rank
    holds the other's two preconditioned gradients once (576 B), received straight into their
    tensors, plus the flat copy of its own two that it sends (576 B). Receiving into a separate
    flat buffer held the other's a second time (1,728 B, as the reference code's per-layer
    in-place broadcasts never do)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    report = simulate(model, "dp-kfac", 2, average_grads=False)
    assert report.memory("buffers") == [2 * 2 * 72 * 4] * 2
