"""The LM's training data: fixed-length blocks of a preprocessed corpus (tasks/lm/cache.py), read through np.memmap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from shardlab.errors import DataError
from tasks.lm.cache import prepare_corpus, read_corpus_meta

__all__ = ["TokenBlocks", "open_split", "open_splits", "prepare_corpus"]


class TokenBlocks(Dataset):
    """Sample i = tokens [i * seq_len, (i + 1) * seq_len + 1): input is the first seq_len, target the last.

    The tokens stay in a read-only memory map: a corpus of any size costs only the pages being read."""

    def __init__(self, bin_file: Path, seq_len: int, dtype: str = "uint16") -> None:
        num_tokens = bin_file.stat().st_size // np.dtype(dtype).itemsize
        self.seq_len = seq_len
        self.num_samples = (num_tokens - 1) // seq_len
        if self.num_samples < 1:
            more = "a larger data.valid_percent, " if bin_file.stem == "valid" else ""
            raise DataError(
                f"{bin_file} has {num_tokens} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
                f"use more text, {more}or a smaller data.seq_len"
            )
        self.tokens = np.memmap(bin_file, dtype=dtype, mode="r")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


def open_split(corpus: Path, split: str, seq_len: int) -> TokenBlocks:
    """The blocks of one split (train or valid) of a preprocessed corpus, in the token dtype its meta.json records."""
    return TokenBlocks(corpus / f"{split}.bin", seq_len, read_corpus_meta(corpus)["dtype"])


def open_splits(corpus: Path, seq_len: int) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, valid) blocks of a preprocessed corpus."""
    return open_split(corpus, "train", seq_len), open_split(corpus, "valid", seq_len)
