"""The LM's training data: fixed-length blocks of a preprocessed corpus (shardlab_tasks/lm/corpus/cache.py: one
train.bin, or shards through a manifest), read through np.memmap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus.cache import prepare_corpus, read_corpus_meta
from shardlab_tasks.lm.corpus.shards import shard_files

__all__ = ["TokenBlocks", "open_split", "open_splits", "prepare_corpus"]


class TokenBlocks(Dataset):
    """Sample i = tokens [i * seq_len, (i + 1) * seq_len + 1) of the split's stream: input is the first seq_len, target
    the last.

    The stream is one token file or the shards of a manifest end to end (shardlab_tasks/lm/corpus/shards.py): the sample
    order is the same either way, so a run resumes on a cache built by 1 task or by 64. A sample that crosses a shard
    boundary is put together from the two; nothing else is copied. The tokens stay in read-only memory maps, opened when
    first read: a corpus of any size costs only the pages being read."""

    def __init__(self, bin_files: Path | list[Path], seq_len: int, dtype: str = "uint16") -> None:
        files = [bin_files] if isinstance(bin_files, Path) else list(bin_files)
        counts = [f.stat().st_size // np.dtype(dtype).itemsize for f in files]
        num_tokens = sum(counts)
        self.seq_len, self.dtype = seq_len, dtype
        self.num_samples = max(0, (num_tokens - 1) // seq_len)
        held_none = files[0].stem == "valid" and num_tokens == 0  # data.valid_percent=0: Task.data_errors decides
        if self.num_samples < 1 and not held_none:
            more = "a larger data.valid_percent, " if files[0].stem == "valid" else ""
            where = files[0] if len(files) == 1 else f"{files[0].parents[2]} ({len(files)} shards of {files[0].name})"
            raise DataError(
                f"{where} has {num_tokens} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                f"use more text, {more}or a smaller data.seq_len"
            )
        self.files = [f for f, n in zip(files, counts, strict=True) if n]  # an empty shard holds nothing to map
        self.starts = np.cumsum([0] + [n for n in counts if n])  # starts[j]: the stream offset of files[j]
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        end = start + self.seq_len + 1
        j = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < end:  # one piece, unless the sample runs past the end of file j into the next
            stop = min(end, int(self.starts[j + 1]))
            pieces.append(self._tokens(j)[start - self.starts[j] : stop - self.starts[j]])
            start, j = stop, j + 1
        return torch.from_numpy((pieces[0] if len(pieces) == 1 else np.concatenate(pieces)).astype(np.int64))

    def _tokens(self, j: int) -> np.memmap:
        if j not in self._maps:
            self._maps[j] = np.memmap(self.files[j], dtype=self.dtype, mode="r")
        return self._maps[j]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}  # a DataLoader worker maps the files itself


def open_split(corpus: Path, split: str, seq_len: int) -> TokenBlocks:
    """The blocks of one split (train or valid) of a preprocessed corpus, in the token dtype its meta.json records:
    its train.bin / valid.bin, or the shards its manifest lists, in order."""
    meta = read_corpus_meta(corpus)
    return TokenBlocks(shard_files(corpus, meta, split), seq_len, meta["dtype"])


def open_splits(corpus: Path, seq_len: int) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, valid) blocks of a preprocessed corpus."""
    return open_split(corpus, "train", seq_len), open_split(corpus, "valid", seq_len)
