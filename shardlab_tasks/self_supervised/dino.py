"""DINO (Caron et al., 2021): self-distillation with no labels. A student network learns to match, on every crop, the
output distribution a teacher gives the other global crops of the same image; the teacher is the student's moving
average (optimization.ema: momentum 0.996 -> 1 on a cosine schedule), and its outputs are centred (a momentum mean
over the global batch, all-reduced) and sharpened (a low temperature, warmed up) so that neither one dimension nor the
uniform distribution wins (collapse).

The teacher is the student's own modules with the average swapped into their shards (WeightAverage.swapped_into: each
rank copies its own shards in and out, nothing gathered), run without gradients on the global crops only. BatchNorm
in the teacher normalizes with its batch's (synced) statistics, as DINO's teacher does; the running statistics the
teacher's forward would move are put back, so the trunk's are the student's. The center is the task's training
state (saved with the checkpoint, the same on every rank). Compared with facebookresearch/dino's main_dino.py: the
head is its DINOHead (an MLP, the bottleneck L2-normalized, the last layer weight-normalized with the gain fixed at
1, i.e. norm_last_layer=True) and the loss its DINOLoss; its weight-decay schedule (0.04 -> 0.4) is not reproduced
(optimizer.weight_decay is constant).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardlab_tasks.self_supervised import comm


class WeightNormLinear(nn.Linear):
    """DINO's last layer: each output row of the weight normalized to unit length in the forward (weight_norm with its
    gain fixed at 1). A plain parameter, so FSDP2 shards it by rows and the normalization runs on the gathered
    weight; initialized as any head Linear (its length does not matter)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, F.normalize(self.weight, dim=1))


def dino_loss(
    student: Tensor, teacher: Tensor, center: Tensor, num_global: int, student_temperature: float, temperature: float
) -> Tensor:
    """Mean over this rank's images and over the (teacher crop, other student crop) pairs of the cross-entropy
    -sum q log p, with q = softmax((teacher - center) / temperature) of each global crop and p = softmax(student /
    student_temperature) of every crop but that one. ``student`` (crops * n, K) and ``teacher`` (num_global * n, K)
    are crop-major: rows [i * n, (i + 1) * n) are crop i."""
    crops = student.shape[0] * num_global // teacher.shape[0]
    log_p = F.log_softmax(student.float() / student_temperature, dim=-1).chunk(crops)
    q = F.softmax((teacher.float() - center) / temperature, dim=-1).detach().chunk(num_global)
    total, terms = student.new_zeros((), dtype=torch.float32), 0
    for i, target in enumerate(q):
        for v, prediction in enumerate(log_p):
            if v != i:
                total = total + (-(target * prediction).sum(dim=-1)).mean()
                terms += 1
    return total / terms


@torch.no_grad()
def collapse_stats(teacher: Tensor, center: Tensor, temperature: float, z: Tensor) -> dict[str, Tensor]:
    """What tells DINO's two collapses apart (docs/vision.md#dino), over this rank's rows of the teacher's global crops:
    ``teacher_entropy``, the mean entropy of a row's target softmax((teacher - center) / temperature) (ln K: uniform
    targets, the centering won; near 0: sharp ones); ``batch_entropy``, that of the targets' mean over the rows (near 0:
    one output dimension for every image, the sharpening won); ``z_std``, the standard deviation over the rows of the
    teacher's L2-normalized bottleneck, averaged over its dimensions (0: one embedding for every image; about
    1/sqrt(dim) for spread ones)."""
    q = F.softmax((teacher.float() - center) / temperature, dim=-1)
    mean = q.mean(dim=0)
    return {
        "teacher_entropy": -torch.special.xlogy(q, q).sum(dim=1).mean(),
        "batch_entropy": -torch.special.xlogy(mean, mean).sum(),
        "z_std": z.float().std(dim=0).mean(),
    }


def linear_warmup(start: float, end: float, steps: int, step: int) -> float:
    """``start`` at optimizer step 0, linear to ``end`` at step ``steps``, then ``end`` (DINO's teacher temperature,
    SwAV's task.warmup_temperature)."""
    return end if step >= steps else start + (end - start) * step / steps


def teacher_temperature(t: Any, step: int) -> float:
    """The teacher's temperature at optimizer step ``step`` (0-based): linear from task.warmup_teacher_temperature to
    task.teacher_temperature over task.warmup_teacher_temperature_steps, then constant (DINO's warm-up)."""
    return linear_warmup(t.warmup_teacher_temperature, t.teacher_temperature, t.warmup_teacher_temperature_steps, step)


class Center:
    """The momentum mean of the teacher's outputs over the global batch (DINO's center): the same on every rank,
    updated once per micro-batch from an all-reduced sum, saved with the checkpoint (as ``task.center``)."""

    def __init__(self, dim: int, momentum: float, device: torch.device) -> None:
        self.momentum = momentum
        self.center = torch.zeros(1, dim, device=device)

    @torch.no_grad()
    def update(self, teacher: Tensor) -> None:
        """Fold in this micro-batch's teacher outputs (this rank's rows; the sum spans every rank's)."""
        total = comm.all_reduce(teacher.float().sum(dim=0, keepdim=True))
        mean = total / (teacher.shape[0] * comm.data_parallel_world())
        self.center.mul_(self.momentum).add_(mean, alpha=1 - self.momentum)

    def state_dict(self) -> dict[str, Tensor]:
        return {"center": self.center}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state["center"] is not self.center:
            self.center.copy_(state["center"])


@contextlib.contextmanager
def teacher_weights(model: nn.Module, average) -> Iterator[None]:
    """``model`` as the teacher inside: the average in its parameters (``average`` None: the model's own weights, as
    on the meta device, where the memory plan traces the teacher's forward), and its BatchNorm running statistics
    put back after, so the teacher's batches do not move the student's."""
    buffers = [b for b in model.buffers() if b.device.type != "meta"]
    kept = [b.clone() for b in buffers]
    swapped = average.swapped_into(model) if average is not None else contextlib.nullcontext()
    try:
        with swapped, torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for b, k in zip(buffers, kept, strict=True):
                b.copy_(k)
