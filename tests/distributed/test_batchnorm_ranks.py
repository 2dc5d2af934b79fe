"""The BatchNorm Fisher blocks in a distributed run: each layer's batch blocks are averaged over
the ranks that captured it, and a layer one rank did not run (here in ``eval()`` there) still
gets the other ranks' blocks, matching the single-process blocks of each rank's data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.batchnorm import BatchNormPreconditioner
from tests.distributed.helpers import run_workers


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3),
                         nn.BatchNorm1d(3))


def data(rank: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def fisher_after_one_step(rank: int, idle_last: bool
                          ) -> tuple[list[Tensor | None], list[tuple[str, int, int]]]:
    """Each BatchNorm's Fisher blocks after one step on ``rank``'s data (the last BatchNorm in
    ``eval()`` when ``idle_last``), and the ledger's (stage, elements, traffic bytes)."""
    net = model()
    if idle_last:
        net[4].eval()
    precond = BatchNormPreconditioner(net, mode="diagonal", factor_decay=0.0)
    x, y = data(rank)
    F.cross_entropy(net(x), y).backward()
    precond.step()
    ledger = [(e.stage, e.elements, e.traffic_bytes) for e in precond.communicator.ledger.entries]
    return [block.fisher.value for block in precond.blocks], ledger


def worker(rank: int, world_size: int
           ) -> tuple[list[Tensor | None], list[tuple[str, int, int]]]:
    torch.set_num_threads(1)
    return fisher_after_one_step(rank, idle_last=rank == 1)


def test_each_layer_averages_the_ranks_that_ran_it_in_one_recorded_all_reduce() -> None:
    alone = [fisher_after_one_step(rank, idle_last=rank == 1)[0] for rank in (0, 1)]
    assert alone[1][1] is None  # in one process the idle layer keeps no blocks
    results = run_workers(worker, 2)
    assert all(r[0] is not None and r[1] is not None for r, _ in results)
    for got, ledger in results:
        torch.testing.assert_close(got[0], (alone[0][0] + alone[1][0]) / 2)
        torch.testing.assert_close(got[1], alone[0][1])  # only rank 0 ran it
        # Diagonal blocks (2C, 1, 1) of C = 6 and 3 channels, and one "captured" flag per
        # layer; an all-reduce over p = 2 receives 2(p − 1)/p of the fp32 payload.
        elements = 2 * 6 + 2 * 3 + 2
        assert ledger == [("bn_factor_comm", elements, 4 * elements)]


def no_batchnorm_step(rank: int, world_size: int) -> int:
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 3))
    precond = BatchNormPreconditioner(net)
    x, y = data(rank)
    F.cross_entropy(net(x), y).backward()
    precond.step()
    return precond.last_preconditioned


def test_a_model_without_batchnorm_steps_on_every_rank() -> None:
    assert run_workers(no_batchnorm_step, 2) == [0, 0]


def build_with_sync_batchnorm(rank: int, world_size: int) -> str:
    """The error building the preconditioner on a model with a SyncBatchNorm across ranks."""
    torch.set_num_threads(1)
    from core.layers import UnsupportedLayerError

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.SyncBatchNorm(2))
    try:
        BatchNormPreconditioner(net)
    except UnsupportedLayerError as err:
        return str(err)
    return "built"


def test_a_sync_batchnorm_across_ranks_is_refused_naming_it() -> None:
    """SyncBatchNorm normalises with every rank's statistics, the Fisher blocks were built from
    this rank's alone (27% off one process's on shifted data, with a CPU stand-in for its
    forward); in one process it is a BatchNorm, and accepted."""
    for message in run_workers(build_with_sync_batchnorm, 2, timeout=120):
        assert message.startswith("1: SyncBatchNorm normalises with the statistics of every rank")
        assert "skip_layers" in message
    assert len(BatchNormPreconditioner(nn.Sequential(nn.SyncBatchNorm(2))).blocks) == 1
