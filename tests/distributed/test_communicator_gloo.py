"""The communicator on two gloo processes, for layouts the simulated transport cannot tell
apart: gloo reads and writes a buffer's ``numel`` consecutive elements from its first, so a
tensor whose elements are not back to back must travel as a copy and be written back."""

from __future__ import annotations

import torch
from torch import Tensor

from core.distributed import Communicator
from tests.distributed.helpers import run_workers


def _symmetric(rank: int) -> Tensor:
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 4, generator=generator, dtype=torch.float64)
    return x + x.T


def strided_collectives(rank: int, world_size: int) -> dict[str, Tensor]:
    """A column all-reduced and broadcast into; a transposed symmetric matrix all-reduced
    packed, and a block of a larger matrix broadcast into packed."""
    torch.set_num_threads(1)
    comm = Communicator.from_torch()
    column = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    comm.all_reduce(column[:, 1], stage="factor_comm")
    received = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    comm.start_broadcast([received[:, 2:3]], src=0, stage="inverse_comm").wait()
    transposed = _symmetric(rank).t()
    comm.all_reduce(transposed, stage="factor_comm", average=True, pack=True)
    block = torch.zeros(6, 6, dtype=torch.float64)
    block[:4, :4] = _symmetric(rank)
    comm.start_broadcast([block[:4, :4]], src=0, stage="inverse_comm", pack=True).wait()
    return {"column": column, "received": received, "transposed": transposed, "block": block}


def test_strided_and_transposed_tensors_travel_whole_and_leave_their_neighbours_alone(
        ) -> None:
    """Before, a column went to gloo as its first ``numel`` elements (rows of the matrix it
    lies in were summed, and the column's own entries left out), and a packed transposed or
    block matrix raised after its collective had run."""
    results = run_workers(strided_collectives, 2, timeout=120)
    base = torch.arange(12.0).reshape(3, 4)
    for rank, result in enumerate(results):
        column = base * (rank + 1)
        column[:, 1] = 3 * base[:, 1]
        torch.testing.assert_close(result["column"], column, rtol=0, atol=0)
        received = base * (rank + 1)
        received[:, 2] = base[:, 2]
        torch.testing.assert_close(result["received"], received, rtol=0, atol=0)
        mean = (_symmetric(0) + _symmetric(1)) / 2
        torch.testing.assert_close(result["transposed"], mean, rtol=1e-15, atol=0)
        block = torch.zeros(6, 6, dtype=torch.float64)
        block[:4, :4] = _symmetric(0)
        torch.testing.assert_close(result["block"], block, rtol=0, atol=0)


def gathered_segments(rank: int, world_size: int) -> dict[str, list[float]]:
    """Each rank's own segment holds ``rank + 1``; the others are receive buffers holding −7.
    Equal segment sizes go through one ``all_gather``; unequal ones through broadcasts."""
    torch.set_num_threads(1)
    comm = Communicator.from_torch()
    result = {}
    for label, shapes in (("equal", [(2, 2), (2, 2)]), ("unequal", [(2, 2), (3,)])):
        segments = [[torch.full(shape, float(r + 1) if r == rank else -7.0)]
                    for r, shape in enumerate(shapes)]
        comm.all_gather_v(segments, stage="grad_comm")
        result[label] = [float(v) for segment in segments for v in segment[0].flatten()]
    return result


def test_all_gather_v_gives_every_rank_every_rank_s_segment() -> None:
    """The simulated transport cannot tell which buffer a rank sends; gloo can."""
    results = run_workers(gathered_segments, 2, timeout=120)
    for result in results:
        assert result["equal"] == [1.0] * 4 + [2.0] * 4
        assert result["unequal"] == [1.0] * 4 + [2.0] * 3
