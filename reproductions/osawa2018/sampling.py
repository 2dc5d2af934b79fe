"""The example stream: shuffled epochs back to back, cut into global batches and micro-batches.

Chainer's iterator, which the paper's runs used, lets a mini-batch straddle two epochs, so a run of
``E`` epochs at batch ``B`` takes exactly ``ceil(N·E/B)`` updates and sees every example ``E``
times (up to the last partial batch). :class:`StreamBatchSampler` does the same: positions
``0, 1, 2, …`` of an endless stream map to ``perm_e[p mod N]`` with ``e = p div N`` and one seeded
permutation per epoch. Global batch ``k`` is positions ``[kB, (k+1)B)``; rank ``r`` of ``P`` takes
the ``r``-th of ``P`` equal slices and cuts it into micro-batches. So one process accumulating ``P``
micro-batches sees the same examples, in the same micro-batches, as ``P`` processes with one each,
and a resumed run continues the stream exactly from its step.

Each example comes with its stream position, and :class:`StreamExamples` seeds the example's
random transforms (crop, flip) from the run's seed and that position. torchvision's transforms
draw from torch's global generator, which in ``DataLoader`` worker processes is seeded per worker
and never checkpointed, and which worker reads a batch depends on how many batches the loader has
made: after a resume the workers' draws would start over and fall to other examples. Seeded by the
position, an example is augmented alike in any worker, with any number of workers or processes,
and before and after a resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


def example_seed(seed: int, position: int) -> int:
    """The seed of the random transforms of the example at stream ``position``.

    The ``position``-th child of the run seed's ``numpy`` seed sequence: well mixed over all 64
    bits (torch's CPU generator uses the low 32), independent of the per-epoch permutations'.
    """
    sequence = np.random.SeedSequence(seed, spawn_key=(position,))
    return int(sequence.generate_state(1, np.uint64)[0])


class StreamExamples(Dataset):
    """A data set read at ``(index, stream position)`` pairs, each example's random transforms
    seeded by its position (see the module docstring).

    Args:
        dataset: The examples, read by index; its transforms draw from torch's global generator.
        seed: The run's seed; None when the transforms draw nothing (then nothing is seeded).
    """

    def __init__(self, dataset: Dataset, seed: int | None = None) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        """The example at dataset index ``item[0]``, transformed with the draws of stream position
        ``item[1]``; torch's global generator is left as it was (a run with ``num_workers=0``
        reads examples in the main process, whose generator is checkpointed)."""
        index, position = item
        if self.seed is None:
            return self.dataset[index]
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(example_seed(self.seed, position))
        try:
            return self.dataset[index]
        finally:
            generator.set_state(state)


class StreamBatchSampler(Sampler[list[tuple[int, int]]]):
    """Endless micro-batches of ``(dataset index, stream position)`` pairs for one rank, for
    :class:`StreamExamples` (see the module docstring).

    Args:
        dataset_size: ``N``.
        batch_size: Global batch ``B`` per update.
        micro_batch_size: Examples per micro-batch on one rank; ``B`` must be a multiple of
            ``world_size × micro_batch_size``.
        rank: This process's rank.
        world_size: ``P``.
        seed: Seed of the per-epoch permutations (the same on every rank).
        start_step: First global batch to produce (a resumed run's step).
    """

    def __init__(self, dataset_size: int, batch_size: int, micro_batch_size: int, *,
                 rank: int = 0, world_size: int = 1, seed: int = 0, start_step: int = 0) -> None:
        if batch_size % (world_size * micro_batch_size):
            raise ValueError(f"batch {batch_size} is not a multiple of world_size × micro-batch "
                             f"= {world_size} × {micro_batch_size}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.start_step = start_step
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch`` (the two most recent are cached)."""
        if epoch not in self._cache:
            if len(self._cache) >= 2:
                del self._cache[min(self._cache)]
            rng = np.random.default_rng((self.seed, epoch))
            self._cache[epoch] = rng.permutation(self.dataset_size)
        return self._cache[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at stream positions ``start … start+count-1``."""
        positions = np.arange(start, start + count)
        epochs, offsets = np.divmod(positions, self.dataset_size)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.permutation(int(epoch))[offsets[chosen]]
        return out.tolist()

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        local = self.batch_size // self.world_size
        step = self.start_step
        while True:
            first = step * self.batch_size + self.rank * local
            for micro in range(first, first + local, self.micro_batch_size):
                positions = range(micro, micro + self.micro_batch_size)
                yield list(zip(self.indices(micro, self.micro_batch_size), positions,
                               strict=True))
            step += 1
