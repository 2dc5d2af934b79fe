"""What actually moves flat buffers: ``torch.distributed``, or nothing (simulation).

The :class:`~core.distributed.communicator.Communicator` does everything above the wire
(bucketing, packing, dtype, averaging, the ledger) and hands flat buffers to a transport, so a
simulated run goes through exactly the code of a real one up to this layer. Groups are tuples of
global ranks, ascending; collectives are started asynchronously and return handles to wait on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

Group = tuple[int, ...]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class Work(Protocol):
    """A started collective."""

    def wait(self) -> object: ...


class Transport(Protocol):
    """Moves flat buffers between ranks; every method starts the collective and returns."""

    rank: int
    world_size: int
    device: torch.device

    def register_groups(self, groups: Sequence[Group]) -> None:
        """Create the sub-groups that later calls name (collectively, on every rank)."""

    def all_reduce(self, flat: Tensor, op: str, group: Group) -> list[Work]: ...

    def broadcast(self, flat: Tensor, src: int, group: Group) -> list[Work]: ...

    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], group: Group
                       ) -> list[Work]: ...

    def all_gather(self, buffers: list[Tensor], group: Group) -> list[Work]:
        """Fill ``buffers[i]`` from group member ``i`` (this rank's entry already holds its
        data); sizes may differ between members."""


class SimulatedTransport:
    """Moves nothing: a stand-in rank of a ``world_size``-rank job, for the ledger and memory.

    Buffers keep this rank's own data; tensors may live on the ``meta`` device.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")

    def register_groups(self, groups: Sequence[Group]) -> None:
        del groups

    def all_reduce(self, flat: Tensor, op: str, group: Group) -> list[Work]:
        return []

    def broadcast(self, flat: Tensor, src: int, group: Group) -> list[Work]:
        return []

    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], group: Group) -> list[Work]:
        output.copy_(inputs[group.index(self.rank)])
        return []

    def all_gather(self, buffers: list[Tensor], group: Group) -> list[Work]:
        return []


class TorchTransport:
    """``torch.distributed`` collectives on process groups of the library's own: one of every
    rank, made beside the default group when this transport is, and the sub-groups
    registered later.

    Never on the default group itself: the training loop's collectives run there (DDP's
    gradient buckets, started from autograd hooks), and collectives of one group are matched
    across ranks by the order they start in. Factors built in the backward pass start their
    all-reduce among DDP's buckets, in an order that differs between ranks that run
    different layers; on a group of their own each sequence keeps its order.

    Works on gloo (CPU tensors) and NCCL (CUDA tensors). Uneven all-gathers are done as one
    broadcast per member (what NCCL itself does for them; gloo has no uneven all-gather).
    Constructing one is collective: every rank does, in the same order as its other
    ``new_group`` calls.
    """

    def __init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call "
                               "init_process_group first (torchrun sets up the environment)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        backend = dist.get_backend()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))
        # new_group gives the ranks outside a group GroupMember.NON_GROUP_MEMBER (-100).
        self._groups: dict[Group, dist.ProcessGroup | int] = {}
        self._world: dist.ProcessGroup | int | None = (
            dist.new_group(list(range(self.world_size))) if self.world_size > 1 else None)

    def register_groups(self, groups: Sequence[Group]) -> None:
        for group in groups:
            if 1 < len(group) < self.world_size and group not in self._groups:
                self._groups[group] = dist.new_group(list(group))

    def _pg(self, group: Group) -> dist.ProcessGroup | None:
        if len(group) == self.world_size:
            pg = self._world
        else:
            try:
                pg = self._groups[group]
            except KeyError:
                raise RuntimeError(f"process group {group} was not registered") from None
        # Collectives start only on groups that hold this rank (Communicator._group checks),
        # where new_group returned a real group.
        assert pg is None or isinstance(pg, dist.ProcessGroup)
        return pg

    def all_reduce(self, flat: Tensor, op: str, group: Group) -> list[Work]:
        return [dist.all_reduce(flat, op=_REDUCE_OPS[op], group=self._pg(group), async_op=True)]

    def broadcast(self, flat: Tensor, src: int, group: Group) -> list[Work]:
        return [_started(dist.broadcast(flat, src, group=self._pg(group), async_op=True))]

    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], group: Group) -> list[Work]:
        return [dist.reduce_scatter(output, inputs, group=self._pg(group), async_op=True)]

    def all_gather(self, buffers: list[Tensor], group: Group) -> list[Work]:
        pg = self._pg(group)
        if len({b.numel() for b in buffers}) == 1:
            mine = buffers[group.index(self.rank)].clone()
            return [dist.all_gather(buffers, mine, group=pg, async_op=True)]
        return [_started(dist.broadcast(buffer, src, group=pg, async_op=True))
                for src, buffer in zip(group, buffers, strict=True)]


def _started(work: dist.Work | None) -> Work:
    """The handle of a collective started with ``async_op=True`` on a group holding this rank,
    which torch returns there (None only on a rank outside the group); ``dist.broadcast`` is
    annotated without the ``async_op=True`` overload that ``dist.all_reduce`` has."""
    assert work is not None
    return work
