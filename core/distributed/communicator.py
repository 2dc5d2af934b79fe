"""A thin communicator: bucketing, packed triangles, wire dtype, async, and the ledger.

Every collective goes through here and is recorded in :attr:`Communicator.ledger`, whatever
moves it (``torch.distributed`` or, for paper-scale simulation, nothing). Collectives over one
rank are no-ops and are not recorded. Other preconditioners record through the same call, e.g.
MKOR's rank-1 vectors::

    communicator.all_reduce(vectors, stage="factor_comm", average=True, dtype=torch.float16)

Averaging divides by the group size once, before the sum (so half-precision sums do not
overflow). ``symmetric`` tensors travel as packed upper triangles when ``pack=True``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from core.distributed.ledger import Ledger
from core.distributed.transport import Group, SimulatedTransport, TorchTransport, Transport, Work


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _TriangleIndex:
    """Cached flat indices of the upper triangle of ``n × n`` matrices and of its mirror."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def __call__(self, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (n, device)
        if key not in self._cache:
            rows, cols = torch.triu_indices(n, n)
            self._cache[key] = ((rows * n + cols).to(device), (cols * n + rows).to(device))
        return self._cache[key]


_triangle = _TriangleIndex()


def _wire_view(tensor: Tensor, pack: bool) -> Tensor:
    """``tensor`` flattened (a copy where its elements are not back to back: a collective
    reads and writes ``numel`` consecutive elements), or its packed upper triangle."""
    if not pack:
        return tensor.reshape(-1).contiguous()
    upper, _ = _triangle(tensor.shape[0], tensor.device)
    return tensor.reshape(-1).index_select(0, upper)


def _span(parts: Sequence[Tensor]) -> Tensor | None:
    """One flat view over 1-D ``parts`` that lie back to back in one storage, in order; None
    where they do not."""
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for part in parts:
        if (part.untyped_storage().data_ptr() != storage or part.dtype != first.dtype
                or part.storage_offset() != offset or (part.numel() > 1 and part.stride(0) != 1)):
            return None
        offset += part.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def _lost_in_cast(source: Tensor, wire: Tensor) -> Tensor:
    """How many nonzero finite entries of ``source`` became 0 or infinite in ``wire`` (its
    narrower-range cast), as a 0-d tensor."""
    flushed = (wire == 0) & (source != 0)
    overflowed = wire.isinf() & source.isfinite()
    return (flushed | overflowed).sum()


def _store(tensor: Tensor, segment: Tensor, pack: bool) -> None:
    """Write a received (possibly packed) segment into ``tensor``."""
    segment = segment.to(tensor.dtype)
    if not pack:
        tensor.copy_(segment.view_as(tensor))
        return
    upper, lower = _triangle(tensor.shape[0], tensor.device)
    contiguous = tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else tensor.new_empty(tensor.numel())
    flat.index_copy_(0, upper, segment)
    flat.index_copy_(0, lower, segment)
    if not contiguous:  # a transposed or strided matrix: filled aside, written back
        tensor.copy_(flat.view_as(tensor))


@dataclass
class _Payload:
    """Tensors travelling in one flat buffer, and how to put results back.

    Attributes:
        tensors: The tensors, in buffer order.
        packed: Per tensor, whether it travels as its upper triangle.
        like: Gives dtype and device when ``tensors`` is empty (an uneven collective's
            empty segment).
    """

    tensors: list[Tensor]
    packed: list[bool]
    like: Tensor | None = None
    flat: Tensor = field(init=False)
    borrowed: bool = field(init=False, default=False)
    #: How many nonzero values of this rank's data the float16 cast lost (0-d, not yet read);
    #: None where nothing was counted.
    lost: Tensor | None = field(init=False, default=None)

    def build(self, dtype: torch.dtype | None, scale: float | None, *,
              count_lost: bool = False) -> Tensor:
        """Concatenate (and pre-scale, and cast) the wire form of the tensors; with
        ``count_lost`` (they hold this rank's data, not receive buffers, and no loss was
        reported yet), a cast to float16 counts the values it loses (:attr:`lost`).

        A single unpacked tensor is sent through a view of itself, without a copy, unless it
        is scaled or cast or its layout needs a copy to flatten; so are unpacked tensors that
        lie back to back in one buffer, in order (receive buffers carved from one allocation).
        """
        parts = [_wire_view(t, p) for t, p in zip(self.tensors, self.packed, strict=True)]
        if not parts:
            assert self.like is not None
            flat = self.like.new_empty(0)
        elif len(parts) == 1:
            flat = parts[0] if scale is None else parts[0] / scale
            # a non-contiguous tensor's flat form is a copy, whose result must be written back
            self.borrowed = (scale is None and not self.packed[0]
                             and flat.data_ptr() == self.tensors[0].data_ptr())
        elif scale is None and not any(self.packed) and (span := _span(parts)) is not None:
            flat, self.borrowed = span, True
        else:
            flat = torch.cat(parts)
            if scale is not None:
                flat.div_(scale)
        self.flat = flat if dtype is None else flat.to(dtype)
        self.borrowed = self.borrowed and self.flat.dtype == self.tensors[0].dtype
        if (count_lost and self.flat.dtype == torch.float16 and flat.dtype != torch.float16
                and not flat.is_meta):  # a simulation's meta tensors hold no values
            self.lost = _lost_in_cast(flat, self.flat)
        return self.flat

    @property
    def rounded(self) -> bool:
        """Whether the wire dtype differs from the tensors' (so the sender must adopt the
        rounded values too, or ranks would hold different data)."""
        return bool(self.tensors) and self.flat.dtype != self.tensors[0].dtype

    def unpack(self) -> None:
        """Copy the flat buffer back into the tensors (nothing to do where it is their memory)."""
        if self.borrowed:
            return
        offset = 0
        for tensor, pack in zip(self.tensors, self.packed, strict=True):
            n = tensor.shape[0] * (tensor.shape[0] + 1) // 2 if pack else tensor.numel()
            _store(tensor, self.flat[offset:offset + n], pack)
            offset += n


class _Bucketer:
    """Groups tensors, in the order given, into buffers of consecutive tensors of one dtype up
    to ``cap_bytes`` each (a tensor larger than the cap travels alone)."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._open: _Payload | None = None
        self._size = 0

    def add(self, tensor: Tensor, pack: bool) -> _Payload | None:
        """Add ``tensor``; returns the bucket it closed (it did not fit there), if any."""
        nbytes = tensor.numel() * tensor.element_size()
        closed = None
        if self._open is not None and (self._open.tensors[0].dtype != tensor.dtype
                                       or self._size + nbytes > self.cap_bytes):
            closed = self.close()
        if self._open is None:
            self._open, self._size = _Payload([], []), 0
        self._open.tensors.append(tensor)
        self._open.packed.append(pack)
        self._size += nbytes
        return closed

    def close(self) -> _Payload | None:
        """The open bucket, if any, now closed."""
        closed, self._open = self._open, None
        return closed


class Pending:
    """Started collectives; :meth:`wait` completes them and writes the results back."""

    def __init__(self, works: list[Work], finish: Callable[[], None],
                 release: Callable[[], None]) -> None:
        self._works = works
        self._finish = finish
        self._release = release

    @classmethod
    def done(cls) -> Pending:
        """A collective with nothing to do (a group of one, or no tensors)."""
        return cls([], lambda: None, lambda: None)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._finish()
        self._release()


class HasGrad(Protocol):
    """Anything with a ``.grad`` (a parameter)."""

    grad: Tensor | None


#: Stages whose buffers :attr:`Communicator.peak_buffer_bytes` leaves out: the gradient
#: all-reduce belongs to data-parallel training itself, not to the second-order method.
UNCOUNTED_STAGES = ("grad_allreduce",)


class Communicator:
    """Collectives with bucketing, packing, wire dtype and a ledger, over a transport.

    Args:
        transport: What moves the buffers (:class:`TorchTransport` or :class:`SimulatedTransport`).
        bucket_cap_mb: Largest flat buffer of one bucketed collective, in MB.
        ledger: Where collectives are recorded (a fresh one by default).

    Attributes:
        ledger: The :class:`~core.distributed.ledger.Ledger` of this rank.
        peak_buffer_bytes: Most bytes of flat buffers alive at once so far (copies made for
            the wire; a tensor sent through a view of itself costs nothing), the second-order
            method's: not those of the gradient all-reduce, which plain data-parallel training
            holds as well (:data:`UNCOUNTED_STAGES`).
    """

    def __init__(self, transport: Transport, *, bucket_cap_mb: float = 25.0,
                 ledger: Ledger | None = None) -> None:
        self.transport = transport
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.ledger = ledger if ledger is not None else Ledger(rank=transport.rank)
        self.peak_buffer_bytes = 0
        self._live_bytes = 0
        self._range_reported: set[str] = set()

    @classmethod
    def from_torch(cls, **options: Any) -> Communicator:
        """Over the ranks of the initialised default process group, on groups of its own
        (:class:`TorchTransport`; a no-op world of one if there is none). Collective: every
        rank calls it."""
        if dist.is_available() and dist.is_initialized():
            return cls(TorchTransport(), **options)
        return cls(SimulatedTransport(0, 1), **options)

    @classmethod
    def simulated(cls, rank: int, world_size: int, **options: Any) -> Communicator:
        """Rank ``rank`` of a simulated ``world_size``-rank job: records, moves nothing, and
        keeps every entry of its ledger (a simulation's steps are few, and read entry by
        entry)."""
        options.setdefault("ledger", Ledger(rank=rank, keep_steps=None))
        return cls(SimulatedTransport(rank, world_size), **options)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def device(self) -> torch.device:
        """Device for small control tensors (the backend's: CUDA for NCCL)."""
        return self.transport.device

    @property
    def world(self) -> Group:
        return tuple(range(self.world_size))

    def register_groups(self, groups: Iterable[Sequence[int]]) -> None:
        """Declare the sub-groups later calls use; call on every rank in the same order."""
        self.transport.register_groups([tuple(sorted(g)) for g in groups])

    # Bookkeeping ------------------------------------------------------------------------------
    def _group(self, group: Sequence[int] | None) -> Group:
        members = self.world if group is None else tuple(sorted(group))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not in group {members}")
        return members

    def _buckets(self, tensors: Sequence[Tensor], packed: Sequence[bool]) -> list[_Payload]:
        """Consecutive tensors of one dtype, up to the bucket cap per buffer."""
        bucketer = _Bucketer(self.bucket_cap_bytes)
        full = [b for t, p in zip(tensors, packed, strict=True) if (b := bucketer.add(t, p))]
        last = bucketer.close()
        return full + ([last] if last else [])

    def _pending(self, works: list[Work], payloads: Sequence[_Payload],
                 finish: Callable[[], None], stage: str, extra: Sequence[Tensor] = ()
                 ) -> Pending:
        """Wrap started work, counting its own flat buffers (not views of the caller's tensors)
        towards :attr:`peak_buffer_bytes` until it is waited on, except those of the training
        loop's gradient all-reduce (:data:`UNCOUNTED_STAGES`)."""
        self._report_range_losses(payloads, stage)
        buffers = [p.flat for p in payloads if not p.borrowed] + list(extra)
        nbytes = 0 if stage in UNCOUNTED_STAGES else sum(
            b.numel() * b.element_size() for b in buffers)
        self._live_bytes += nbytes
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._live_bytes)

        def release() -> None:
            self._live_bytes -= nbytes

        return Pending(works, finish, release)

    def _report_range_losses(self, payloads: Sequence[_Payload], stage: str) -> None:
        """Warn, once per stage, when a float16 wire lost values this rank sent: float16 holds
        magnitudes from 6e-8 to 65504 only, and Kronecker factors and rank-1 statistics of
        small gradients lie below that (every entry of ResNet-18's ``G`` factors at batch 16,
        docs/concepts/distribution.md). Reads the counts from the device (a synchronisation
        per collective, on float16 wires only)."""
        counted = [(p.lost, p.flat.numel()) for p in payloads if p.lost is not None]
        lost = sum(int(count) for count, _ in counted)
        if lost == 0:
            return
        self._range_reported.add(stage)
        sent = sum(n for _, n in counted)
        warnings.warn(f"{stage}: {lost:,} of the {sent:,} values this rank sent in float16 "
                      "fell outside its range (6e-8 to 65504) and arrived as 0 or infinity, so "
                      "the curvature they carry is lost; send bfloat16 instead "
                      "(comm_dtype='bfloat16': float32's range in the same two bytes). "
                      "Reported once per stage.", stacklevel=3)

    def _counts_losses(self, stage: str) -> bool:
        """Whether this stage's float16 casts still count what they lose (until a loss is
        reported: the counting costs passes and a synchronisation per collective)."""
        return stage not in self._range_reported

    def _record(self, stage: str, op: str, like: Tensor, elements: int, group: Group,
                traffic_elements: int) -> None:
        """Record a collective of ``elements`` of ``like``'s dtype."""
        itemsize = like.element_size()
        self.ledger.record(stage=stage, op=op, dtype=_dtype_name(like.dtype), elements=elements,
                           itemsize=itemsize, group_size=len(group),
                           traffic_bytes=traffic_elements * itemsize)

    @staticmethod
    def _flags(value: bool | Sequence[bool], n: int) -> list[bool]:
        return [value] * n if isinstance(value, bool) else list(value)

    # All-reduce ------------------------------------------------------------------------------
    def start_all_reduce(self, tensors: Sequence[Tensor], *, stage: str, average: bool = False,
                         op: str = "sum", group: Sequence[int] | None = None,
                         dtype: torch.dtype | None = None, pack: bool | Sequence[bool] = False
                         ) -> Pending:
        """Start a bucketed all-reduce of ``tensors`` (in place once waited on).

        Args:
            tensors: Tensors to reduce; results overwrite them.
            stage: Ledger stage name.
            average: Divide by the group size (``op="sum"`` only).
            op: ``"sum"``, ``"min"`` or ``"max"``.
            group: Ranks taking part (all by default).
            dtype: Wire dtype for floating tensors (their own dtype by default).
            pack: Per tensor (or for all), send the upper triangle of a symmetric matrix.
        """
        stream = self.stream_all_reduce(stage=stage, average=average, op=op, group=group,
                                        dtype=dtype)
        for tensor, packed in zip(tensors, self._flags(pack, len(tensors)), strict=True):
            stream.add(tensor, pack=packed)
        return stream.finish()

    def stream_all_reduce(self, *, stage: str, average: bool = False, op: str = "sum",
                          group: Sequence[int] | None = None, dtype: torch.dtype | None = None
                          ) -> AllReduceStream:
        """A bucketed all-reduce fed one tensor at a time (:class:`AllReduceStream`): each
        bucket starts as soon as it is full, while the caller still computes the next
        tensors. Same buckets, collectives and ledger as :meth:`start_all_reduce` of the same
        tensors; options as there."""
        members = self._group(group)
        if average and op != "sum":
            raise ValueError(f"average=True needs op='sum', not {op!r}")
        return AllReduceStream(self, members, stage=stage, average=average, op=op, dtype=dtype)

    def _start_bucket(self, payload: _Payload, members: Group, *, stage: str, average: bool,
                      op: str, dtype: torch.dtype | None) -> list[Work]:
        """Build one bucket's buffer, record it and start its all-reduce."""
        p = len(members)
        wire = dtype if dtype is not None and payload.tensors[0].is_floating_point() else None
        flat = payload.build(wire, float(p) if average else None,
                             count_lost=self._counts_losses(stage))
        n = flat.numel()
        self._record(stage, "all_reduce", flat, n, members, 2 * (p - 1) * n // p)
        return self.transport.all_reduce(flat, op, members)

    def all_reduce_many(self, tensors: Sequence[Tensor], **options: Any) -> None:
        """:meth:`start_all_reduce` with ``options``, and wait."""
        self.start_all_reduce(tensors, **options).wait()

    def all_reduce(self, tensor: Tensor, *, stage: str, average: bool = False, op: str = "sum",
                   group: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                   pack: bool = False) -> Tensor:
        """All-reduce one tensor in place and return it (see :meth:`start_all_reduce`).

        Raises:
            TypeError: for anything but a tensor (a list goes to :meth:`all_reduce_many`), in
                a world of one too, where nothing would move and the mistake would wait for
                the first distributed run.
        """
        if not isinstance(tensor, Tensor):
            raise TypeError(f"all_reduce takes one tensor, not a {type(tensor).__name__}; "
                            "all-reduce several with all_reduce_many")
        self.start_all_reduce([tensor], stage=stage, average=average, op=op, group=group,
                              dtype=dtype, pack=pack).wait()
        return tensor

    # Broadcast -------------------------------------------------------------------------------
    def start_broadcast(self, tensors: Sequence[Tensor], *, src: int, stage: str,
                        group: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                        pack: bool | Sequence[bool] = False) -> Pending:
        """Start a bucketed broadcast of ``tensors`` from ``src`` (a global rank) to ``group``.

        On ``src`` the tensors are sent; elsewhere they are overwritten once waited on. With a
        lower-precision wire ``dtype``, ``src`` keeps the rounded values as well, so every rank
        ends with identical tensors.
        """
        members = self._group(group)
        if len(members) == 1 or not tensors:
            return Pending.done()
        if src not in members:
            raise ValueError(f"broadcast source {src} is not in group {members}")
        payloads = self._buckets(tensors, self._flags(pack, len(tensors)))
        works: list[Work] = []
        for payload in payloads:
            wire = dtype if dtype is not None and payload.tensors[0].is_floating_point() else None
            flat = payload.build(wire, None,
                                 count_lost=src == self.rank and self._counts_losses(stage))
            n = flat.numel()
            self._record(stage, "broadcast", flat, n, members, 0 if src == self.rank else n)
            works += self.transport.broadcast(flat, src, members)

        def finish() -> None:
            for payload in payloads:
                if src != self.rank or payload.rounded:
                    payload.unpack()

        return self._pending(works, payloads, finish, stage)

    # Uneven reduce-scatter and all-gather ----------------------------------------------------
    def _segments(self, segments: Sequence[Sequence[Tensor]], members: Group,
                  pack: bool) -> list[_Payload]:
        if len(segments) != len(members):
            raise ValueError(f"{len(segments)} segments for a group of {len(members)}")
        tensors = [t for seg in segments for t in seg]
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError("one dtype per uneven collective, got "
                             f"{sorted({str(t.dtype) for t in tensors})}")
        like = tensors[0] if tensors else None
        return [_Payload(list(seg), [pack] * len(seg), like) for seg in segments]

    def reduce_scatter_v(self, segments: Sequence[Sequence[Tensor]], *, stage: str,
                         average: bool = False, group: Sequence[int] | None = None,
                         dtype: torch.dtype | None = None, pack: bool = False) -> None:
        """Sum ``segments[i]`` over the group into group member ``i``'s tensors.

        Every rank passes the same structure (tensors of the same shapes); afterwards this
        rank's own segment holds the (averaged) sum. Segments may differ in size. One
        collective, not bucketed.
        """
        members = self._group(group)
        if len(members) == 1 or not any(segments):
            return
        payloads = self._segments(segments, members, pack)
        scale = float(len(members)) if average else None
        inputs = [payload.build(dtype, scale, count_lost=self._counts_losses(stage))
                  for payload in payloads]
        mine = members.index(self.rank)
        total = sum(x.numel() for x in inputs)
        self._record(stage, "reduce_scatter", inputs[mine], total, members,
                     total - inputs[mine].numel())
        output = torch.empty_like(inputs[mine])
        works = self.transport.reduce_scatter(output, inputs, members)

        def finish() -> None:
            # the sum arrives in a buffer of its own, never in the tensors' memory
            payloads[mine].flat, payloads[mine].borrowed = output, False
            payloads[mine].unpack()

        self._pending(works, payloads, finish, stage, extra=[output]).wait()

    def all_gather_v(self, segments: Sequence[Sequence[Tensor]], *, stage: str,
                     group: Sequence[int] | None = None, dtype: torch.dtype | None = None
                     ) -> None:
        """Give every group member every member's tensors; ``segments[i]`` are member ``i``'s.

        This rank's own segment holds its data; the others are receive buffers of the right
        shapes, filled in place. Segments may differ in size. One collective, not bucketed.
        With a lower-precision wire ``dtype`` the own segment is rounded like the others.
        """
        members = self._group(group)
        if len(members) == 1 or not any(segments):
            return
        payloads = self._segments(segments, members, False)
        mine = members.index(self.rank)
        buffers = [payload.build(dtype, None,
                                 count_lost=i == mine and self._counts_losses(stage))
                   for i, payload in enumerate(payloads)]
        total = sum(b.numel() for b in buffers)
        self._record(stage, "all_gather", buffers[mine], total, members,
                     total - buffers[mine].numel())
        works = self.transport.all_gather(buffers, members)

        def finish() -> None:
            for i, payload in enumerate(payloads):
                if i != mine or payload.rounded:
                    payload.unpack()

        self._pending(works, payloads, finish, stage).wait()


class AllReduceStream:
    """An all-reduce whose tensors arrive one at a time (from
    :meth:`Communicator.stream_all_reduce`).

    Tensors are bucketed exactly as :meth:`Communicator.start_all_reduce` buckets them; a
    bucket's collective starts when the next tensor no longer fits in it, so with an
    asynchronous backend (NCCL on its own stream, gloo's threads) the first buckets travel
    while the caller computes the next tensors. A tensor must not change after it is added.
    """

    def __init__(self, communicator: Communicator, members: Group, *, stage: str,
                 average: bool, op: str, dtype: torch.dtype | None) -> None:
        self._communicator = communicator
        self._members = members
        self._options: dict[str, Any] = {"stage": stage, "average": average, "op": op,
                                         "dtype": dtype}
        self._bucketer = _Bucketer(communicator.bucket_cap_bytes)
        self._payloads: list[_Payload] = []
        self._works: list[Work] = []

    def add(self, tensor: Tensor, *, pack: bool = False) -> None:
        """Queue ``tensor`` (its upper triangle with ``pack``), starting the bucket it closes."""
        if len(self._members) == 1:
            return
        self._start(self._bucketer.add(tensor, pack))

    def _start(self, payload: _Payload | None) -> None:
        if payload is None:
            return
        self._works += self._communicator._start_bucket(payload, self._members,
                                                        **self._options)
        self._payloads.append(payload)

    def finish(self) -> Pending:
        """Start the last bucket; the returned :class:`Pending` completes them all."""
        self._start(self._bucketer.close())
        if not self._payloads:
            return Pending.done()
        payloads = self._payloads

        def finish() -> None:
            for payload in payloads:
                payload.unpack()

        return self._communicator._pending(self._works, payloads, finish,
                                           self._options["stage"])


def average_gradients(parameters: Iterable[HasGrad], communicator: Communicator, *,
                      stage: str = "grad_allreduce") -> None:
    """Average ``.grad`` over all ranks, for training without ``DistributedDataParallel``.

    Parameters without a gradient are skipped; which parameters have one must agree across
    ranks (it does when every rank runs the same model code). Bucketed like DDP and recorded
    in ``communicator.ledger`` under ``stage``.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    communicator.all_reduce_many(grads, stage=stage, average=True)
