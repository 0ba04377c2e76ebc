"""SwAV (Caron et al., 2020): swapped prediction of Sinkhorn-Knopp codes, over the global batch, with a feature queue.

- ``sinkhorn``: the equal-partition assignment of every row (image crop) to the prototypes. Its row and total sums
  are all-reduced over the data-parallel ranks, so each rank's codes are those of the global batch: the same on any
  world size (the reference's distributed_sinkhorn, plus a global max subtracted before exp for range).
- ``swav_loss``: for each assignment crop, its codes are predicted from every other crop's prototype scores.
- ``FeatureQueue``: the embeddings of the last queue_length global samples of each assignment crop, which join the
  assignment (not the loss) once the queue is full. It is per-rank state - each rank holds the rows of its own slice
  of every past batch - saved as one tensor (crops, ages, global batch, dim) sharded over the ranks on the batch
  dimension (a DTensor), so DCP writes every rank's rows and reshards them on load: a run resumed on another world
  size finds in each rank's queue exactly the rows of the samples it reads, as if it had run on that size throughout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from shardlab_tasks.self_supervised import comm


@torch.no_grad()
def sinkhorn(scores: Tensor, epsilon: float, iterations: int) -> Tensor:
    """Codes (rows, K) for prototype scores (rows, K): rows sum to 1, each prototype gets an equal share of the
    global batch's rows."""
    scores = scores.float()
    peak = comm.all_reduce(scores.max(), "max")  # the same constant everywhere: cancels in the normalization
    q = torch.exp((scores - peak) / epsilon).t()  # K x rows
    num_prototypes = q.shape[0]
    num_rows = comm.all_reduce(torch.tensor(float(q.shape[1]), device=q.device))
    q = q / comm.all_reduce(q.sum())
    for _ in range(iterations):
        q = q / comm.all_reduce(q.sum(dim=1, keepdim=True)) / num_prototypes  # each prototype's share: 1/K
        q = q / q.sum(dim=0, keepdim=True) / num_rows  # each row's mass: 1/B
    return (q * num_rows).t()


def swav_loss(
    scores: Tensor,
    n: int,
    crops_for_assign: list[int],
    temperature: float,
    epsilon: float,
    iterations: int,
    queued_scores: list[Tensor | None],
    stats: dict[str, Tensor] | None = None,
    hard: bool = False,
) -> Tensor:
    """The swapped-prediction loss of this rank's n images. ``scores`` (crops * n, K): prototype scores, crop-major;
    ``queued_scores[i]``: scores of the queue's rows for assignment crop i (None: no queue yet). ``stats``, if given,
    receives the collapse diagnostics as means over this rank's rows (see ``collapse_stats``). ``hard``: each row's
    codes one-hot at its largest code."""
    scores = scores.float()
    num_crops = scores.shape[0] // n
    log_probs = F.log_softmax(scores.view(num_crops, n, -1) / temperature, dim=2)
    loss = scores.new_zeros(())
    all_codes = []
    for i, crop in enumerate(crops_for_assign):
        with torch.no_grad():
            assigned = scores[crop * n : (crop + 1) * n].detach()
            if queued_scores[i] is not None:
                assigned = torch.cat([queued_scores[i].float(), assigned])
            codes = sinkhorn(assigned, epsilon, iterations)[-n:]
            if hard:
                codes = F.one_hot(codes.argmax(dim=1), codes.shape[1]).to(codes.dtype)
            all_codes.append(codes)
        others = [v for v in range(num_crops) if v != crop]
        loss = loss - (codes * log_probs[others]).sum(dim=2).mean(dim=1).sum() / len(others)
    if stats is not None:
        stats.update(collapse_stats(torch.cat(all_codes), scores, log_probs.flatten(0, 1)))
    return loss / len(crops_for_assign)


@torch.no_grad()
def collapse_stats(codes: Tensor, scores: Tensor, log_probs: Tensor) -> dict[str, Tensor]:
    """What tells SwAV's collapse from learning (docs/vision.md), each a mean over rows: ``code_entropy``, the entropy
    of a row's codes (ln K: uniform codes, nothing to predict; near 0: hard assignments); ``pred_entropy``, that of
    its predicted distribution over the prototypes; ``score_spread``, the standard deviation of its prototype scores
    (near 0: every prototype equally far from the embedding)."""
    entropy = -torch.special.xlogy(codes, codes).sum(dim=1).mean()
    return {
        "code_entropy": entropy,
        "pred_entropy": -(log_probs.exp() * log_probs).sum(dim=1).mean(),
        "score_spread": scores.std(dim=1).mean(),
    }


class FeatureQueue:
    """SwAV's queue, world-size invariant and checkpointed (see the module docstring). ``local`` (crops, ages, n, dim)
    is this rank's part; age 0 is the newest batch. Filled from optimizer step ``start_step`` on; used once full."""

    def __init__(self, num_crops: int, length: int, global_batch: int, dim: int, start_step: int, train_state, device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        world = comm.data_parallel_world()
        self.ages = length // global_batch
        self.start_step, self.train_state = start_step, train_state
        self.local = torch.zeros(num_crops, self.ages, global_batch // world, dim, device=device)
        self.filled = torch.zeros((), dtype=torch.int64)
        """Batches in the queue (at most ``ages``): the same on every rank."""
        self.tensor = self.local
        if world > 1:
            mesh = init_device_mesh(device.type, (world,))
            self.tensor = DTensor.from_local(self.local, mesh, [Shard(2)], run_check=False)

    @property
    def full(self) -> bool:
        return int(self.filled) == self.ages

    def rows(self, crop_index: int) -> Tensor:
        """This rank's queued embeddings of one assignment crop (ages * n, dim)."""
        return self.local[crop_index].reshape(-1, self.local.shape[-1])

    @torch.no_grad()
    def push(self, embeddings: Tensor, crops_for_assign: list[int], n: int) -> None:
        """Enqueue this micro-batch's embeddings of the assignment crops (from start_step on)."""
        if self.train_state.step < self.start_step:
            return
        self.local[:, 1:] = self.local[:, :-1].clone()
        for i, crop in enumerate(crops_for_assign):
            self.local[i, 0] = embeddings[crop * n : (crop + 1) * n].detach().to(self.local.dtype)
        self.filled.fill_(min(int(self.filled) + 1, self.ages))

    def state_dict(self) -> dict[str, Any]:
        return {"queue": self.tensor, "filled": self.filled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        queue = state["queue"]  # DCP loads into the tensors state_dict() gave it; copying keeps other callers right
        self.local.copy_(queue.to_local() if hasattr(queue, "to_local") else queue)
        self.filled.copy_(state["filled"])
