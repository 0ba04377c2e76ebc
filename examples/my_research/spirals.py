"""A new task: classify 2-D points by the arm of a spiral they lie on, with its own data, model, loss and metrics.

The data is generated from a seed (no download), so every rank and every machine sees the same points; the model is a
residual MLP registered in MODELS like any architecture; the loss is cross-entropy, and validation reports accuracy
beside the loss. The task's settings are its data section (``data=SpiralsDataConfig``: data.num_arms, ...); a task
with settings of its own would add ``dataclass=`` (a TaskConfig subclass: task.*). The model's dataclass is its model
section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from shardlab.registry import MODELS, TASKS
from shardlab.task import Task


@dataclass
class SpiralsDataConfig:
    num_arms: int = 3
    """Spiral arms, one class each."""
    num_train: int = 3000
    """Training points."""
    num_valid: int = 600
    """Validation points (drawn after the training points, from the same seed)."""
    noise: float = 0.05
    """Std of the Gaussian noise added to each point."""
    seed: int = 0
    """Seed of the generated points: the same seed gives the same data on every machine."""


@dataclass
class SpiralMLPConfig:
    arch: str = "spiral_mlp"
    """A name in MODELS (set by the registration)."""
    width: int = 64
    """Hidden width."""
    num_blocks: int = 3
    """Residual blocks, each one FSDP unit."""


class Spirals(Dataset):
    """``num_points`` (point, arm) pairs: arm ``a`` is r -> r * (cos, sin)(4r + 2 pi a / num_arms), r in [0.1, 1]."""

    def __init__(self, cfg: SpiralsDataConfig, num_points: int, offset: int) -> None:
        generator = torch.Generator().manual_seed(cfg.seed)
        total = offset + num_points  # draw the training points first: validation never overlaps them
        r = 0.1 + 0.9 * torch.rand(total, generator=generator)
        arm = torch.randint(cfg.num_arms, (total,), generator=generator)
        angle = 4 * r + 2 * math.pi * arm / cfg.num_arms
        points = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)
        points = points + cfg.noise * torch.randn(total, 2, generator=generator)
        self.points, self.arms = points[offset:], arm[offset:]

    def __len__(self) -> int:
        return len(self.arms)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[i], self.arms[i]


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(self.norm(x)))


@MODELS.register("spiral_mlp", dataclass=SpiralMLPConfig)
class SpiralMLP(nn.Module):
    def __init__(self, cfg: SpiralMLPConfig, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(2, cfg.width)
        self.blocks = nn.ModuleList(ResidualBlock(cfg.width) for _ in range(cfg.num_blocks))
        self.head = nn.Linear(cfg.width, num_classes)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x = self.stem(points)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@TASKS.register("spirals", data=SpiralsDataConfig)
class SpiralsTask(Task):
    unit = "points"

    def config_errors(self) -> list[str]:
        # self.cfg is read by attribute: the composed DictConfig here, in a run the typed dataclasses (shardlab.task)
        d, m = self.cfg.data, self.cfg.model
        keys = [("data", d, k) for k in ("num_arms", "num_train", "num_valid")]
        keys += [("model", m, k) for k in ("width", "num_blocks")]
        return [f"{s}.{k} must be >= 1, got {getattr(c, k)}" for s, c, k in keys if getattr(c, k) < 1]

    def prepare_data(self) -> None:
        d = self.cfg.data
        self.train_dataset = Spirals(d, d.num_train, offset=0)
        self.valid_dataset = Spirals(d, d.num_valid, offset=d.num_train)

    def build_model(self) -> nn.Module:
        m = self.cfg.model
        return MODELS.build(m.arch, m, self.cfg.data.num_arms, key="model.arch")

    def init_tensor(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith("bias"):
            tensor.zero_()
        elif ".norm." in name:
            tensor.fill_(1.0)
        else:  # He init for the ReLU layers: std sqrt(2 / fan_in)
            tensor.normal_(0.0, math.sqrt(2.0 / tensor.shape[1]), generator=generator)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        # In forward order; the stem and head are tiny and stay in the root unit, which shardlab wraps last.
        return list(model.blocks)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # What a training batch looks like, on the meta device: the memory plan runs the loss on it to count
        # activations, allocating nothing.
        return torch.zeros(batch_size, 2, device="meta"), torch.zeros(batch_size, dtype=torch.long, device="meta")

    def loss(self, model: nn.Module, batch, device: torch.device):
        points, arms = (t.to(device, non_blocking=True) for t in batch)
        logits = model(points)
        loss = F.cross_entropy(logits.float(), arms)
        n = arms.numel()
        correct = (logits.argmax(dim=1) == arms).sum().float()
        return loss, {"loss_sum": loss.detach() * n, "correct": correct, "count": torch.tensor(float(n))}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums["count"], 1)
        return {"loss": sums["loss_sum"] / count, "accuracy": sums["correct"] / count}

    def num_units(self, batch) -> int:
        return len(batch[1])
