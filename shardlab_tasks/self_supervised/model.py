"""A RegNet trunk with a projection head and, for SwAV, prototypes (for DINO, its weight-normalized last layer).

The trunk is the vision task's RegNet (shardlab_tasks/image_classification/model.py: any torchvision flavor or
regnet_cifar) with its classifier replaced by an identity, held as the submodule ``trunk``: a checkpoint's
``trunk.<name>`` is the supervised model's ``<name>`` (no ``fc.*``), so a trunk moves between the tasks by dropping the
prefix.

Multi-crop (SwAV's MultiCropWrapper): consecutive crops of one size go through the trunk as one batch, so the global
crops run together and the local ones together; BatchNorm normalizes each such batch with its own (synced) statistics.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardlab.registry import MODELS
from shardlab.task import setting
from shardlab_tasks.image_classification import model as regnet
from shardlab_tasks.self_supervised.dino import WeightNormLinear

TRUNK_PREFIX = "trunk."
"""What a self-supervised checkpoint's trunk weights are prefixed with, against the supervised model's names."""


def projection_head(
    in_dim: int, dims: list[int], batch_norm: bool, activation: str = "relu", last_batch_norm: bool = False
) -> nn.Sequential:
    """Linear layers of widths ``dims``, with (BatchNorm1d and) ReLU or GELU between them; the last layer is the
    embedding, followed by a BatchNorm1d of its own when ``last_batch_norm`` (SimCLR v2's and lightly's head; that
    layer then has no bias, which the BatchNorm's mean would cancel)."""
    layers: list[nn.Module] = []
    for i, out_dim in enumerate(dims):
        last = i == len(dims) - 1
        layers.append(nn.Linear(in_dim, out_dim, bias=not (last and last_batch_norm)))
        if not last:
            if batch_norm:
                layers.append(nn.BatchNorm1d(out_dim, eps=1e-5, momentum=0.1))  # the trunk's BN settings
            layers.append(nn.GELU() if activation == "gelu" else nn.ReLU(inplace=True))
        elif last_batch_norm:
            layers.append(nn.BatchNorm1d(out_dim, eps=1e-5, momentum=0.1))
        in_dim = out_dim
    return nn.Sequential(*layers)


class SelfSupervisedModel(nn.Module):
    def __init__(
        self,
        trunk: nn.Module,
        feature_dim: int,
        dims: list[int],
        batch_norm: bool,
        prototypes: int,
        activation: str = "relu",
        normalized_prototypes: bool = False,
        last_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.trunk = trunk
        self.projection = projection_head(feature_dim, dims, batch_norm, activation, last_batch_norm)
        self.prototypes = None
        if prototypes:  # SwAV's prototypes, or DINO's last layer (weight-normalized rows)
            self.prototypes = (
                WeightNormLinear(dims[-1], prototypes)
                if normalized_prototypes
                else nn.Linear(dims[-1], prototypes, bias=False)
            )

    def features(self, images: Tensor) -> Tensor:
        """The trunk's pooled features (N, feature_dim)."""
        return self.trunk(images)

    def forward(
        self, crops: list[Tensor], queued: Tensor | None = None, features_only: bool = False
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(embeddings, prototype scores, scores of ``queued`` embeddings) of all crops, crop-major: rows
        [i * n, (i + 1) * n) belong to crop i of the n images. ``queued`` embeddings are scored without gradients.
        ``features_only``: the trunk features of ``crops[0]`` alone, as (features, None, None) (evaluation goes through
        the root module, so FSDP's hooks run as in training)."""
        if features_only:
            return self.features(crops[0]), None, None
        features, start = [], 0
        while start < len(crops):  # consecutive crops of one size form one trunk batch
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            features.append(self.trunk(torch.cat(crops[start:end])))
            start = end
        z = F.normalize(self.projection(torch.cat(features)), dim=1)
        if self.prototypes is None:
            return z, None, None
        queued_scores = None
        if queued is not None:
            with torch.no_grad():
                queued_scores = self.prototypes(queued.to(z.dtype))
        return z, self.prototypes(z), queued_scores


def build(cfg_model, task_cfg) -> SelfSupervisedModel:
    """The RegNet of ``cfg_model`` (model.arch, via the vision task's MODELS) without its classifier, and the
    method's heads (``task_cfg``: projection_dims, projection_bn, projection_last_bn, num_prototypes for SwAV)."""
    trunk = MODELS.build(cfg_model.arch, cfg_model, 1, key="model.arch")
    feature_dim = trunk.fc.in_features
    trunk.fc = nn.Identity()
    prototypes = setting(task_cfg, "num_prototypes", 0)
    return SelfSupervisedModel(
        trunk,
        feature_dim,
        list(task_cfg.projection_dims),
        task_cfg.projection_bn,
        prototypes,
        activation=setting(task_cfg, "projection_activation", "relu"),
        normalized_prototypes=task_cfg.name == "dino",
        last_batch_norm=setting(task_cfg, "projection_last_bn", False),  # absent from checkpoints before the key
    )


def fsdp_units(model: SelfSupervisedModel) -> list[nn.Module]:
    """The trunk's per-block units (stem, every block) and the projection head; the prototypes stay in the root."""
    trunk = model.trunk
    return [trunk.stem, *(block for stage in trunk.trunk_output for block in stage), model.projection]


def _default_linear_init(bound: float, t: Tensor, g: torch.Generator) -> None:
    t.uniform_(-bound, bound, generator=g)


def init_plan(model: SelfSupervisedModel) -> dict:
    """The trunk as torchvision initialises a RegNet (regnet.init_plan); the heads' linear layers with PyTorch's default
    U(+-1/sqrt(fan_in)) for weight and bias, as SwAV and SimCLR leave them (the prototypes are normalized anyway)."""
    plan = regnet.init_plan(model)
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Linear) and not prefix.startswith(TRUNK_PREFIX):
            bound = 1 / math.sqrt(module.in_features)
            plan[f"{prefix}.weight"] = partial(_default_linear_init, bound)
            if module.bias is not None:
                plan[f"{prefix}.bias"] = partial(_default_linear_init, bound)
    return plan
