"""Data order addressed by a global sample offset, so a run resumes on any world size where it stopped.

Step s of a run reads global samples [s * B, (s + 1) * B) of an endless, epoch-shuffled stream (B = the global
micro-batch); data-parallel rank r of R reads its contiguous 1/R of each global micro-batch. Changing R changes who
reads a sample, never which samples form a step.

Randomness follows the same address: each sample is read with torch's RNG seeded from (seed, its global offset), in
whichever process reads it (the rank, or a DataLoader worker), so augmentation depends on neither the world size, the
number of workers, nor where a run was resumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset


class GlobalOrder:
    """Sample indices of an endless stream of epochs, each a seeded permutation (or the identity)."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, torch.Tensor] = {}
        """The permutations the current global batch reads: one epoch's, two across a boundary (a batch spanning more
        epochs, of a tiny dataset, draws the others again, which costs nothing at that size)."""

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                perm = torch.randperm(self.num_samples, generator=g)
            else:
                perm = torch.arange(self.num_samples)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return self._perms[epoch]

    def draw(self, start: int, count: int) -> None:
        """Draw the permutations of the epochs samples [start, start + count) touch. Called for the whole global batch
        on every rank, so a new epoch's shuffle (seconds for a corpus of 10^8 blocks) is drawn in the same step on
        all of them, not a step early by the rank whose slice reaches it first while the others wait in a collective."""
        epochs = range(start // self.num_samples, (start + count - 1) // self.num_samples + 1)
        for epoch in epochs:
            self._permutation(epoch)
        self._perms = {e: p for e, p in self._perms.items() if e in epochs}  # an epoch behind: its memory freed

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for offset in range(start, start + count):
            epoch, pos = divmod(offset, self.num_samples)
            out.append(int(self._permutation(epoch)[pos]))
        return out


class RankBatchSampler:
    """This rank's slice of each global micro-batch, starting at a global sample offset."""

    def __init__(
        self,
        order: GlobalOrder,
        start: int,
        global_batch: int,
        dp_rank: int,
        dp_world: int,
        num_batches: int | None = None,
    ) -> None:
        assert global_batch % dp_world == 0, "validated in config: batch size divisible by data-parallel ranks"
        self.order, self.start, self.global_batch = order, start, global_batch
        self.local = global_batch // dp_world
        self.dp_rank = dp_rank
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[list[int]]:
        for _, indices in self.batches():
            yield indices

    def batches(self) -> Iterator[tuple[int, list[int]]]:
        """(global offset of this rank's first sample, dataset indices) of each of this rank's batches."""
        offset, produced = self.start, 0
        while self.num_batches is None or produced < self.num_batches:
            self.order.draw(offset, self.global_batch)
            first = offset + self.dp_rank * self.local
            yield first, self.order.indices(first, self.local)
            offset += self.global_batch
            produced += 1

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("endless sampler")
        return self.num_batches


def sample_seed(seed: int, offset: int) -> int:
    """The RNG seed for global sample ``offset`` of a run seeded ``seed`` (distinct runs, distinct streams)."""
    return (seed * 0x9E3779B97F4A7C15 + offset) % 2**63


class SeededSamples(Dataset):
    """Reads ``dataset[index]`` with torch's RNG seeded from the sample's global offset (torchvision's transforms and
    shardlab's augmentations draw from it), then restores the reader's RNG state."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        offset, index = item
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only, the one fork_rng restores: torch.manual_seed would also seed (and leave seeded)
            # every accelerator's, and costs ~100x more per sample.
            torch.default_generator.manual_seed(sample_seed(self.seed, offset))
            return self.dataset[index]


class OffsetBatchSampler(RankBatchSampler):
    """RankBatchSampler yielding (global offset, index) pairs, for SeededSamples."""

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for first, indices in self.batches():
            yield list(enumerate(indices, start=first))


def rank_loader(
    dataset: Dataset,
    order: GlobalOrder,
    start: int,
    global_batch: int,
    dp_rank: int,
    dp_world: int,
    num_batches: int | None = None,
    num_workers: int = 0,
    collate_fn=None,
) -> DataLoader:
    """This rank's batches from global sample ``start`` on, each sample read with its own seeded RNG (SeededSamples).
    Worker processes get base seeds from ``order.seed`` too; batches are pinned on CUDA machines, so the tasks'
    non-blocking copies to the GPU are asynchronous."""
    sampler = OffsetBatchSampler(order, start, global_batch, dp_rank, dp_world, num_batches)
    return DataLoader(
        SeededSamples(dataset, order.seed),
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(order.seed),
        pin_memory=torch.cuda.is_available(),
    )


def weighted_micro_batches(
    loader: Iterator[Any],
    update_freq: int,
    loss_count: Callable[[Any], int | None],
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    dp_world_size: int,
    device: torch.device,
) -> Iterator[tuple[Any, torch.Tensor | None]]:
    """A step's ``update_freq`` micro-batches from ``loader``, each with the weight of its mean loss. None (the mean
    divided by update_freq) where every micro-batch holds as many loss terms (``loss_count``: Task.loss_count gives
    None); else its count times the data-parallel ranks over the step's count on all ranks (the backends average
    gradients over the ranks), so the step's gradient is that of the mean over all its terms, however they are split
    over ranks and micro-batches. Counted ones are read ahead for the sum (token ids: kilobytes); the weights stay on
    the device, so nothing waits."""
    from torch.profiler import record_function

    with record_function("shardlab.data"):
        first = next(loader)
    if loss_count(first) is None:
        yield first, None
        for _ in range(update_freq - 1):
            with record_function("shardlab.data"):
                batch = next(loader)
            yield batch, None
        return
    with record_function("shardlab.data"):
        batches = [first, *(next(loader) for _ in range(update_freq - 1))]
    counts = [loss_count(batch) for batch in batches]
    local = torch.tensor(sum(counts), dtype=torch.float64, device=device)
    per_term = dp_world_size / all_reduce_sum(local).clamp(min=1)
    for batch, count in zip(batches, counts, strict=True):
        yield batch, (per_term * count).float()
