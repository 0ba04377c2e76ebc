"""torchvision RegNets with random weights, saved as torchvision saves its own (``torch.save(model.state_dict())``), for
the model.pretrained tests: the real regnet_y_400mf, and torchvision's RegNet class in tests/ssl_configs.py's
TINY_REGNET shape (shardlab's regnet_cifar: a 3x3 stem at stride 1).

Every tensor is random, BatchNorm's affine and running statistics too (torchvision's init leaves those at 1, 0, 0, 1,
which a seeded init would give as well: a load that skipped them would pass unnoticed)."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from torch import Tensor, nn
from torchvision.models.regnet import BlockParams, RegNet

from shardlab_tasks.image_classification.model import CifarStem


def tiny_regnet() -> RegNet:
    """torchvision's RegNet with TINY_REGNET's design (depth 2, w_0 8, w_a 8, w_m 2, group width 8, SE 0.25, stem 8)."""
    params = BlockParams.from_init_params(depth=2, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return RegNet(params, num_classes=1000, stem_width=8, stem_type=CifarStem)


@torch.no_grad()
def randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with BatchNorm weights, biases and running statistics drawn at random and a tracked-batch count, in
    eval mode (its features use the running statistics)."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.weight.copy_(torch.rand(module.weight.shape, generator=g) + 0.5)
            module.bias.normal_(0, 0.1, generator=g)
            module.running_mean.normal_(0, 0.1, generator=g)
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=g) + 0.5)
            module.num_batches_tracked.fill_(7)
    return model.eval()


def saved(model: nn.Module, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path


def regnet_y_400mf_file(path: Path) -> tuple[RegNet, Path]:
    model = randomized(torchvision.models.regnet_y_400mf(weights=None))
    return model, saved(model, path)


def tiny_file(path: Path) -> tuple[RegNet, Path]:
    model = randomized(tiny_regnet())
    return model, saved(model, path)


def features(model: RegNet, images: Tensor) -> Tensor:
    """torchvision's RegNet up to its classifier: the pooled output of the last stage."""
    with torch.no_grad():
        return model.avgpool(model.trunk_output(model.stem(images))).flatten(1)


def images(n: int, size: int, seed: int = 1) -> Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))
