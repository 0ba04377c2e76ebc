"""SimCLR's NT-Xent loss (Chen et al., 2020) with the negatives of the global batch.

Each rank's embeddings of both views are gathered from every rank with their gradients, so each of the 2n local
anchors is contrasted with the 2N - 2 other views of the global batch of N images: the positive is the other view of
its own image. The columns are ordered by global sample (view 1 of all N, then view 2 of all N), so the loss of a
sample is the same on any world size; the data-parallel mean of the ranks' gradients is the gradient of the global
mean loss, because the gather's backward returns to each rank the gradient every rank's loss put on its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardlab_tasks.self_supervised import comm


def nt_xent(z: torch.Tensor, n: int, temperature: float) -> torch.Tensor:
    """Mean NT-Xent over this rank's anchors; ``z`` (2n, d) holds the L2-normalized embeddings of view 1 of the n
    local images, then of view 2."""
    z = z.float()
    views = comm.all_gather_with_grad(z.view(2, n, -1).transpose(0, 1).contiguous())  # (N, 2, d), rank-major
    total = views.shape[0]
    columns = views.transpose(0, 1).reshape(2 * total, -1)  # view 1 of all N images, then view 2
    logits = z @ columns.t() / temperature
    first = comm.data_parallel_rank() * n
    own = first + torch.arange(n, device=z.device)
    self_column = torch.cat([own, own + total])
    positive = torch.cat([own + total, own])
    is_self = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, self_column[:, None], True)
    return F.cross_entropy(logits.masked_fill(is_self, float("-inf")), positive)
