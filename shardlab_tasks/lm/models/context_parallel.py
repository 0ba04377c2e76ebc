"""Context parallelism for the LM (distributed.context_parallel_degree > 1): a pretraining micro-batch as the
sequence tensors torch's context_parallel shards (shardlab.distributed.context_parallel), and what the LM cannot
split that way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlab.task import SequenceShards, setting


@dataclass(frozen=True)
class SequenceBatch:
    """A block's input tokens, next tokens and each position's index in the whole sequence, (batch, length) twice and
    (length,): under context parallelism each rank holds its load-balanced slice of all three, so the model embeds
    and rotates each token at its true position."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor


def sequence_shards(batch: torch.Tensor, device: torch.device) -> SequenceShards:
    """A block of data.seq_len + 1 tokens as (inputs, targets, positions), each its own storage (torch resizes them in
    place), the sequence along dimension 1, 1 and 0."""
    batch = batch.to(device, non_blocking=True)
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=device)
    return SequenceShards(SequenceBatch(inputs, targets, positions), (inputs, targets, positions), (1, 1, 0))


def context_parallel_errors(cfg, degree: int, preference: bool, takes_positions: bool) -> list[str]:
    """What the LM's runs cannot split over ``degree`` context ranks, one line each naming the key. ``preference``:
    the task has a loss of its own (DPO's); ``takes_positions``: model.arch's forward takes ``positions``."""
    m, d = cfg.model, cfg.data
    key = f"distributed.context_parallel_degree ({degree})"
    data_format, dropout = setting(d, "format", "text"), setting(m, "dropout", 0.0)
    refusals = (
        (d.seq_len % (2 * degree) != 0, f"{key}: data.seq_len ({d.seq_len}) must be a multiple of 2 x {degree} = "
         f"{2 * degree}: torch's load balancer gives each rank a head and a tail chunk of equal length"),
        (data_format != "text", f"{key}: data.format={data_format}: fine-tuning rows (per-sample "
         "masks, lengths cut per micro-batch) cannot split over the ring, which attends causally over whole rows; "
         "set it to 1"),
        (preference, f"{key}: the preference loss compares whole chosen and rejected rows; set it to 1"),
        (bool(setting(d, "sources")), f"{key}: data.sources: a mixture's per-source validation does not split over "
         "context ranks yet; train on one corpus or set it to 1"),
        (not takes_positions, f"{key}: model.arch={m.arch}'s forward takes no positions (each rank holds a "
         "load-balanced slice of every sequence, not positions 0..n); set it to 1"),
        (dropout > 0, f"{key}: model.dropout ({dropout}) inside the ring's attention would "
         "draw other masks than one process does; set model.dropout=0"),
    )  # fmt: skip
    return [message for refused, message in refusals if refused]
