"""Fine-tuning samples packed into rows of data.seq_len positions, and what the models make of a packed row.

A row is a (3, seq_len) long tensor: the input tokens, the target of each position (IGNORE where no loss is taken:
prompt tokens, padding), and the segment of each position (0, 1, ... for the samples in the row, PAD_SEGMENT for the
padding, so the tokens a row really holds are counted without knowing its samples: real_positions). From the segments
the models take per-sample positions (RoPE angles, GPT-2's position table restart at 0 for each sample) and a
block-diagonal causal mask (no position attends to another sample's), so a packed row computes what the same samples
compute each in a row of its own; the models need only that neighbouring samples' ids differ (DPO's packed rows
number answers across the micro-batch: shardlab_tasks/lm/finetuning/preference.py). Light on purpose: the models import
it.
"""

from __future__ import annotations

import torch

IGNORE = -100
"""The target of a position that carries no loss (F.cross_entropy's ignore_index)."""
PAD_SEGMENT = -1
"""The segment of padding positions (a segment of its own: no sample attends to it)."""


def real_positions(rows: torch.Tensor) -> torch.Tensor:
    """(batch,) the positions of each (batch, 3, length) row that hold a sample's token, not padding."""
    return (rows[:, 2] != PAD_SEGMENT).sum(-1)


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """(batch, length) positions that restart at 0 where the segment id changes (segments are contiguous runs)."""
    index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """(batch, 1, length, length) boolean mask for scaled_dot_product_attention, True where a query may attend: keys
    of its own segment at or before it. Every query sees itself, so no row of the softmax is empty."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def pack(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row, filled in order (next fit): a sample that does not fit in the current row starts the
    next one. Deterministic from the lengths alone, so every rank and every world size packs the same rows."""
    rows: list[list[int]] = []
    used = seq_len
    for i, n in enumerate(lengths):
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def packed_row(samples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int) -> torch.Tensor:
    """The (3, seq_len) row of ``samples`` (token ids, and whether each token is an answer token), each sample
    contributing len(ids) - 1 positions: inputs ids[:-1], targets ids[1:] where the target is an answer token."""
    inputs, targets, segments = [], [], []
    for segment, (ids, answer) in enumerate(samples):
        inputs += ids[:-1]
        targets += [t if keep else IGNORE for t, keep in zip(ids[1:], answer[1:], strict=True)]
        segments += [segment] * (len(ids) - 1)
    assert len(inputs) <= seq_len, "pack() keeps each row within data.seq_len"
    pad = seq_len - len(inputs)
    row = [inputs + [pad_id] * pad, targets + [IGNORE] * pad, segments + [PAD_SEGMENT] * pad]
    return torch.tensor(row, dtype=torch.long)


def rounded_up(length: int, multiple: int) -> int:
    """``length`` (at least 1) rounded up to a multiple of ``multiple``: the row length sequence-parallel tensor
    parallelism splits evenly (the task passes distributed.tensor_parallel_degree)."""
    return -(-max(length, 1) // multiple) * multiple
