"""The one cross-entropy of the LM losses (pretraining, fine-tuning's answer tokens, DPO's log-probabilities, a
mixture's validation): on whole logits, or on logits split over the vocabulary by tensor parallelism
(distributed.loss_parallel: shardlab_tasks/lm/models/tensor_parallel.py's vocabulary_split_logits).

Split logits are DTensors, and F.cross_entropy on them, inside torch's loss_parallel context (which the trainer holds
around forward and backward: shardlab.distributed.tensor_parallel.split_vocabulary_loss), computes each token's
log-sum-exp from every rank's slice with two small all-reduces, and picks each target's logit from the rank that holds
it. Its result is the same on every tensor-parallel rank (Replicate), so it is handed on as a plain tensor and every
loss built on it (means, masks, DPO's pair sums) stays the one-process code."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.cross_entropy of ``logits`` (..., vocabulary) against ``targets`` (...), flattened, in fp32; ``kwargs`` are
    F.cross_entropy's (ignore_index, reduction). Logits split over the vocabulary give the same value as a plain
    tensor, its gradient flowing back into the split logits."""
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), **kwargs)
    return loss.to_local() if isinstance(loss, DTensor) else loss
