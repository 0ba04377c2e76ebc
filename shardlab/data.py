"""Data order addressed by a global sample offset, so a run resumes on any world size where it stopped.

Step s of a run reads global samples [s * B, (s + 1) * B) of an endless, epoch-shuffled stream (B = the global
micro-batch); data-parallel rank r of R reads its contiguous 1/R of each global micro-batch. Changing R changes who
reads a sample, never which samples form a step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset


class GlobalOrder:
    """Sample indices of an endless stream of epochs, each a seeded permutation (or the identity)."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perm = torch.randperm(self.num_samples, generator=g)
            else:
                self._perm = torch.arange(self.num_samples)
            self._epoch = epoch
        return self._perm

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
        offset, produced = self.start, 0
        while self.num_batches is None or produced < self.num_batches:
            first = offset + self.dp_rank * self.local
            yield self.order.indices(first, self.local)
            offset += self.global_batch
            produced += 1

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("endless sampler")
        return self.num_batches


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
    sampler = RankBatchSampler(order, start, global_batch, dp_rank, dp_world, num_batches)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        persistent_workers=num_workers > 0,
    )
