"""Communicator and ledger on the simulated transport (no processes): what is recorded, and
that packing, wire dtypes and bucketing put the data back where it was."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from core.distributed import Communicator, average_gradients
from core.distributed.ledger import Ledger, StageTotals
from core.distributed.transport import SimulatedTransport


def _symmetric(n: int) -> torch.Tensor:
    x = torch.randn(n, n, dtype=torch.float64)
    return (x + x.T) / 2


def test_world_of_one_is_a_no_op() -> None:
    comm = Communicator.simulated(0, 1)
    t = torch.ones(4)
    comm.all_reduce(t, stage="factor_comm", average=True)
    comm.start_broadcast([t], src=0, stage="inverse_comm").wait()
    assert torch.equal(t, torch.ones(4)) and comm.ledger.entries == []


def test_packed_all_reduce_records_the_triangle_and_restores_the_matrix() -> None:
    comm = Communicator.simulated(1, 4)
    a = _symmetric(5)
    out = comm.all_reduce(a.clone(), stage="factor_comm", average=True, pack=True)
    # Nothing moves, so the average over 4 "ranks" is this rank's quarter; mirrored exactly.
    assert torch.equal(out, a / 4)
    (entry,) = comm.ledger.entries
    assert (entry.op, entry.dtype, entry.elements, entry.bytes, entry.group_size) == \
        ("all_reduce", "float64", 15, 120, 4)
    assert entry.traffic_bytes == 2 * 3 * 15 // 4 * 8


def test_half_precision_wire_rounds_and_records_two_bytes() -> None:
    comm = Communicator.simulated(0, 2)
    t = torch.tensor([1.0, 1.0 + 2**-13, 3.0])
    comm.all_reduce(t, stage="factor_comm", dtype=torch.float16)
    assert t.dtype == torch.float32 and t[1] == 1.0  # rounded to fp16 and back
    assert comm.ledger.entries[0].dtype == "float16" and comm.ledger.entries[0].bytes == 6


def test_broadcast_sender_keeps_rounded_values_so_ranks_agree() -> None:
    comm = Communicator.simulated(0, 2)
    t = torch.tensor([1.0 + 2**-13])
    comm.start_broadcast([t], src=0, stage="inverse_comm", dtype=torch.bfloat16).wait()
    assert t[0] == 1.0
    root, = comm.ledger.entries
    assert root.traffic_bytes == 0
    receiver = Communicator.simulated(1, 2)
    receiver.start_broadcast([torch.zeros(3)], src=0, stage="inverse_comm").wait()
    assert receiver.ledger.entries[0].traffic_bytes == 12


def test_bucketing_splits_at_the_cap_and_keeps_order() -> None:
    comm = Communicator.simulated(0, 2, bucket_cap_mb=100 / 2**20)  # 100 bytes
    tensors = [torch.full((10,), float(i)) for i in range(5)]  # 40 bytes each
    comm.all_reduce_many(tensors, stage="factor_comm")
    assert [e.elements for e in comm.ledger.entries] == [20, 20, 10]
    assert all(torch.equal(t, torch.full((10,), float(i))) for i, t in enumerate(tensors))
    # Two concatenated buckets are copies; the last, single tensor travels as a view.
    assert comm.peak_buffer_bytes == 160
    # The gradient all-reduce's buffers are data-parallel training's, not the method's.
    plain = Communicator.simulated(0, 2, bucket_cap_mb=100 / 2**20)
    plain.all_reduce_many(tensors, stage="grad_allreduce")
    assert plain.peak_buffer_bytes == 0 and len(plain.ledger.entries) == 3


def test_buckets_hold_one_dtype_and_their_cap_is_in_mebibytes() -> None:
    """A float32 and a float64 tensor do not share a buffer; ``bucket_cap_mb`` is in MiB, as
    DDP's: 2²⁰ bytes hold 250,000 + 12,144 float32 values exactly (10⁶ bytes do not)."""
    comm = Communicator.simulated(0, 2, bucket_cap_mb=1.0)
    comm.all_reduce_many([torch.ones(10), torch.ones(10, dtype=torch.float64), torch.ones(2)],
                         stage="factor_comm")
    assert [(e.dtype, e.elements) for e in comm.ledger.entries] == [
        ("float32", 10), ("float64", 10), ("float32", 2)]
    comm.ledger.clear()
    comm.all_reduce_many([torch.zeros(250_000), torch.zeros(12_144)], stage="factor_comm")
    assert [e.elements for e in comm.ledger.entries] == [262_144]


def test_a_group_without_this_rank_or_the_source_is_refused() -> None:
    comm = Communicator.simulated(0, 4)
    with pytest.raises(ValueError, match=r"rank 0 is not in group \(1, 2\)"):
        comm.all_reduce(torch.ones(2), stage="factor_comm", group=[2, 1])
    with pytest.raises(ValueError, match=r"broadcast source 3 is not in group \(0, 1\)"):
        comm.start_broadcast([torch.ones(2)], src=3, stage="inverse_comm", group=[0, 1])
    assert not comm.ledger.entries


def test_uneven_reduce_scatter_and_all_gather_record_totals_and_own_share() -> None:
    comm = Communicator.simulated(1, 3)
    mats = [[_symmetric(2)], [_symmetric(3), _symmetric(4)], []]
    own = [m.clone() for m in mats[1]]
    comm.reduce_scatter_v(mats, stage="factor_comm", average=True, pack=True)
    assert all(torch.allclose(m, o / 3) for m, o in zip(mats[1], own, strict=True))
    rs = comm.ledger.entries[-1]
    assert (rs.op, rs.elements, rs.traffic_bytes) == ("reduce_scatter", 3 + 6 + 10, 3 * 8)
    comm.all_gather_v([[torch.zeros(2, 3)], [torch.ones(4)], [torch.zeros(5)]],
                      stage="grad_comm")
    ag = comm.ledger.entries[-1]
    assert (ag.op, ag.elements, ag.traffic_bytes) == ("all_gather", 15, 11 * 4)


def test_average_gradients_skips_missing_grads_and_is_recorded() -> None:
    comm = Communicator.simulated(0, 2)
    params = [SimpleNamespace(grad=torch.ones(3)), SimpleNamespace(grad=None),
              SimpleNamespace(grad=torch.ones(2, 2))]
    average_gradients(params, comm)
    (entry,) = comm.ledger.entries
    assert (entry.stage, entry.op, entry.elements) == ("grad_allreduce", "all_reduce", 7)
    assert torch.equal(params[0].grad, torch.full((3,), 0.5))


def test_rank_one_vectors_are_a_one_line_call_and_summarised() -> None:
    comm = Communicator.simulated(0, 8)
    comm.ledger.step = 3
    vectors = torch.empty(1000, device="meta")
    comm.all_reduce(vectors, stage="factor_comm", average=True, dtype=torch.float16)
    totals = comm.ledger.summary(step=3)["factor_comm"]
    assert (totals.collectives, totals.elements, totals.bytes) == (1, 1000, 2000)
    assert "factor_comm" in comm.ledger.format_summary(step=3)
    assert comm.ledger.summary(step=2) == {}


def test_which_strategies_move_preconditioned_gradients() -> None:
    """What the KL clip's early products rely on: only strategies whose ranks receive ``P``
    from others (or round their own on the wire) say they move gradients."""
    from core.config import KFACConfig
    from core.distributed.strategies import make_strategy
    from core.strategy import Strategy

    expected = {"d-kfac": False, "comm-opt": False, "mem-opt": True, "dp-kfac": True,
                "osawa": True, "hybrid-opt": True}
    for name, moves in expected.items():
        options = {"grad_worker_fraction": 0.5} if name == "hybrid-opt" else {}
        config = KFACConfig(strategy=name, **options)
        strategy = make_strategy(config, Communicator.simulated(0, 4))
        assert strategy.moves_gradients is moves, name
        assert make_strategy(config, Communicator.simulated(0, 1)).moves_gradients is False
    assert Strategy().moves_gradients is False


class _SpyTransport(SimulatedTransport):
    """A simulated transport that logs when each all-reduce starts and how big it is."""

    def __init__(self, rank: int, world_size: int, log: list[str]) -> None:
        super().__init__(rank, world_size)
        self.log = log

    def all_reduce(self, flat: torch.Tensor, op: str, group: tuple[int, ...]) -> list:
        self.log.append(f"start {flat.numel()}")
        return super().all_reduce(flat, op, group)


def test_a_streamed_all_reduce_starts_each_bucket_once_full_with_the_same_buckets() -> None:
    """Tensors of 40 bytes under a 100-byte cap: a bucket starts when the third tensor does
    not fit, before the caller has built the rest; the ledger and the results equal the
    all-at-once call's."""
    tensors = [torch.full((10,), float(i)) for i in range(5)]
    log: list[str] = []
    streamed = Communicator(_SpyTransport(0, 2, log), bucket_cap_mb=100 / 2**20)
    stream = streamed.stream_all_reduce(stage="factor_comm", average=True)
    copies = [t.clone() for t in tensors]
    for i, tensor in enumerate(copies):
        log.append(f"add {i}")
        stream.add(tensor)
    stream.finish().wait()
    assert log == ["add 0", "add 1", "add 2", "start 20", "add 3", "add 4", "start 20",
                   "start 10"]
    at_once = Communicator.simulated(0, 2, bucket_cap_mb=100 / 2**20)
    expected = [t.clone() for t in tensors]
    at_once.all_reduce_many(expected, stage="factor_comm", average=True)
    assert streamed.ledger.entries == at_once.ledger.entries
    for got, want in zip(copies, expected, strict=True):
        assert torch.equal(got, want)


def test_a_streamed_all_reduce_in_a_world_of_one_moves_and_records_nothing() -> None:
    comm = Communicator.simulated(0, 1)
    stream = comm.stream_all_reduce(stage="factor_comm", average=True)
    t = torch.ones(3)
    stream.add(t)
    stream.finish().wait()
    assert torch.equal(t, torch.ones(3)) and comm.ledger.entries == []


def test_a_single_process_strategy_has_a_world_of_one_that_moves_and_records_nothing() -> None:
    """Code written for a distributed run (docs/distributed.md) runs unchanged in one process:
    ``average_gradients`` through the strategy's communicator leaves the gradients as they are
    and the ledger stays empty."""
    from torch import nn

    from core import KFACPreconditioner

    model = nn.Linear(3, 2)
    precond = KFACPreconditioner(model)
    model(torch.randn(4, 3)).square().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    average_gradients(model.parameters(), precond.strategy.communicator)
    for p, grad in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, grad)
    precond.step()
    communicator = precond.strategy.communicator
    assert (communicator.rank, communicator.world_size) == (0, 1)
    assert communicator.ledger.entries == []
    assert isinstance(communicator.ledger.format_summary(step=precond.steps - 1), str)


def test_all_reduce_of_a_list_is_refused_in_a_world_of_one_too() -> None:
    """A list passed to ``all_reduce`` went through unchanged in one process and failed only
    under torchrun; it is refused everywhere, naming ``all_reduce_many``."""
    for comm in (Communicator.simulated(0, 1), Communicator.simulated(0, 2)):
        with pytest.raises(TypeError, match="all_reduce_many"):
            comm.all_reduce([torch.ones(2)], stage="factor_comm")  # type: ignore[arg-type]


class _SummingTransport(SimulatedTransport):
    """A simulated transport whose reduce-scatter sums as ``world_size`` ranks holding this
    rank's data would."""

    def reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor],
                       group: tuple[int, ...]) -> list:
        output.copy_(inputs[group.index(self.rank)] * len(group))
        return []


def test_an_unaveraged_reduce_scatter_writes_the_sum_into_tensors_sent_without_a_copy() -> None:
    """Without averaging, a rank's own segment of one tensor (or of views back to back in one
    buffer) goes to the wire as a view of itself; the sum arrives in a buffer of its own and
    must still be written back (it was dropped: the tensors kept this rank's own values)."""
    comm = Communicator(_SummingTransport(0, 2))
    single = torch.ones(3)
    flat = torch.ones(5)
    for mine in ([single], [flat[:2], flat[2:]]):
        comm.reduce_scatter_v([mine, [torch.ones(2)]], stage="factor_comm")
    assert torch.equal(single, torch.full((3,), 2.0))
    assert torch.equal(flat, torch.full((5,), 2.0))


class _DoublingTransport(SimulatedTransport):
    """A simulated transport whose all-reduce sums as two ranks holding this rank's data would."""

    def all_reduce(self, flat: torch.Tensor, op: str, group: tuple[int, ...]) -> list:
        flat.mul_(len(group))
        return []


def test_an_unaveraged_all_reduce_writes_the_sum_into_a_non_contiguous_tensor() -> None:
    """A single tensor goes to the wire as a flat view of itself when it has one; a transposed
    one's flat form is a copy, and the sum arriving there must be written back (a view's
    result needs no write-back, and taking the copy for a view dropped it)."""
    comm = Communicator(_DoublingTransport(0, 2))
    base = torch.arange(6.0).reshape(2, 3)
    transposed = base.t()
    comm.all_reduce(transposed, stage="factor_comm")
    assert torch.equal(base, 2 * torch.arange(6.0).reshape(2, 3))
    contiguous = torch.arange(4.0)
    comm.all_reduce(contiguous, stage="factor_comm")
    assert torch.equal(contiguous, 2 * torch.arange(4.0))


def test_a_float16_wire_warns_once_per_stage_when_values_this_rank_sends_are_lost() -> None:
    """float16 holds magnitudes from 6e-8 to 65504: a Kronecker factor's squared gradients
    (1e-9 and below on ResNet-18) become 0 on the wire, silently changing the curvature.
    Values this rank sends that arrive as 0 or infinity are counted and reported once per
    stage, naming bfloat16; receive buffers, bfloat16 wires and values in range are not."""
    comm = Communicator.simulated(0, 2)
    small = torch.tensor([1e-9, 1.0, 1e6, 0.0])
    with pytest.warns(UserWarning, match=r"factor_comm: 2 of the 4 values .*bfloat16"):
        comm.all_reduce(small.clone(), stage="factor_comm", dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comm.all_reduce(small.clone(), stage="factor_comm", dtype=torch.float16)  # reported
        comm.all_reduce(small.clone(), stage="inverse_comm", dtype=torch.bfloat16)
        comm.all_reduce(torch.tensor([1e-3, 2.0]), stage="other", dtype=torch.float16)
        receiver = Communicator.simulated(1, 2)
        receiver.start_broadcast([small.clone()], src=0, stage="inverse_comm",
                                 dtype=torch.float16).wait()
    with pytest.warns(UserWarning, match=r"inverse_comm: 1 of the 2 values"):
        comm.start_broadcast([torch.tensor([1e-9, 1.0])], src=0, stage="inverse_comm",
                             dtype=torch.float16).wait()


def test_a_ledger_keeps_the_last_steps_entries_and_the_older_ones_as_totals() -> None:
    """Every collective of a long run was kept as an entry (one list grew without bound, and
    MKOR's per-step metrics scanned it all); entries older than ``keep_steps`` steps are
    folded into totals, so the run's summary and checkpoint stay exact."""
    bounded, unbounded = Ledger(keep_steps=3), Ledger(keep_steps=None)
    for ledger in (bounded, unbounded):
        for step in range(10):
            ledger.step = step
            ledger.record(stage="factor_comm", op="all_reduce", dtype="float32",
                          elements=10 + step, itemsize=4, group_size=2, traffic_bytes=step)
            with ledger.at_step(step - 1):  # an entry of the previous step, recorded after
                ledger.record(stage="bn_factor_comm", op="all_reduce", dtype="float32",
                              elements=1, itemsize=4, group_size=2, traffic_bytes=2)
    assert bounded.steps() == [7, 8, 9] and len(unbounded.entries) == 20
    assert bounded.select(step=9) == unbounded.select(step=9)
    assert bounded.summary() == unbounded.summary()
    elements = sum(10 + s for s in range(10))
    assert bounded.summary() == {
        "factor_comm": StageTotals(10, elements, 4 * elements, sum(range(10))),
        "bn_factor_comm": StageTotals(10, 10, 40, 20)}
    assert bounded.state_dict() == unbounded.state_dict()
    assert Communicator.simulated(0, 2).ledger.keep_steps is None  # a simulation reads all


def test_a_ledger_loaded_from_a_checkpoint_counts_only_the_checkpoints_collectives() -> None:
    """A rollback to an earlier checkpoint: the collectives of the abandoned steps, recorded
    before the load, are not counted on top of the saved totals."""
    ledger = Ledger()

    def record(step: int) -> None:
        ledger.step = step
        ledger.record(stage="factor_comm", op="all_reduce", dtype="float32", elements=10,
                      itemsize=4, group_size=2, traffic_bytes=40)

    record(0)
    saved = ledger.state_dict()
    record(1)
    record(2)
    ledger.load_state_dict(saved)
    assert ledger.summary() == {"factor_comm": StageTotals(1, 10, 40, 40)}
    record(1)
    assert ledger.summary() == {"factor_comm": StageTotals(2, 20, 80, 80)}
