"""Multi-crop views of the vision task's images (embedded, folder, fake), on torchvision's v2 transforms.

Every sample is (crops, label, skipped): the global crops then the local ones, each a float tensor (3, size, size),
normalized like the source's classification inputs; label and skipped as in shardlab_tasks/image_classification/data.py
(the methods ignore the label). The random draws come from torch's global RNG, which shardlab.data.SeededSamples seeds
from (seed, the sample's global offset) in whichever process reads it: the crops of a sample are the same on any world
size, with any number of DataLoader workers, and after a resume.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from shardlab_tasks.image_classification.data import (
    EMBEDDED_CLASSES,
    EMBEDDED_MEAN,
    EMBEDDED_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    FakeImages,
    ImageFiles,
    folder_splits,
    generate_shapes,
    native_size,
    source_of,
)
from shardlab_tasks.self_supervised.config import MultiCropDataConfig


def global_size(cfg: MultiCropDataConfig) -> int:
    return cfg.image_size or native_size(source_of(cfg))


def local_size(cfg: MultiCropDataConfig) -> int:
    """data.local_crop_size, or 3/7 of the global size rounded up to a multiple of 8 (SwAV's 96 for 224)."""
    return cfg.local_crop_size or 8 * math.ceil(global_size(cfg) * 3 / 7 / 8)


def crop_sizes(cfg: MultiCropDataConfig) -> list[int]:
    """The size of every crop of a sample, in order: global crops first."""
    return [global_size(cfg)] * cfg.num_global_crops + [local_size(cfg)] * cfg.num_local_crops


def crop_transform(cfg: MultiCropDataConfig, size: int, scale: list[float], mean, std) -> v2.Compose:
    """One crop of an image (a uint8 tensor or a PIL image): random-resized crop, flip and colour distortion with the
    configured probabilities (transforms that never fire are left out), then float normalized with ``mean``/``std``.
    With data.augment=false: the whole image resized (every crop alike)."""
    steps: list = [v2.ToImage()]
    if not cfg.augment:
        steps.append(v2.Resize((size, size), antialias=True))
    else:
        steps += [v2.RandomResizedCrop(size, scale=tuple(scale), antialias=True), v2.RandomHorizontalFlip()]
        s = cfg.color_jitter
        if s > 0 and cfg.color_jitter_prob > 0:
            jitter = v2.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, min(0.2 * s, 0.5))
            steps.append(v2.RandomApply([jitter], p=cfg.color_jitter_prob))
        if cfg.grayscale_prob > 0:
            steps.append(v2.RandomGrayscale(p=cfg.grayscale_prob))
        if cfg.blur_prob > 0:
            kernel = max(3, size // 10 * 2 + 1)  # odd, ~1/10 of the crop (SimCLR's 23 px for 224)
            steps.append(v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=cfg.blur_prob))
        if cfg.solarize_prob > 0:
            steps.append(v2.RandomSolarize(threshold=128, p=cfg.solarize_prob))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)


class MultiCrop:
    """Image -> list of crops: num_global_crops global, then num_local_crops local ones (a picklable callable, so
    DataLoader workers started by spawn can hold it)."""

    def __init__(self, cfg: MultiCropDataConfig, mean, std) -> None:
        glob = crop_transform(cfg, global_size(cfg), cfg.global_crop_scale, mean, std)
        loc = crop_transform(cfg, local_size(cfg), cfg.local_crop_scale, mean, std)
        self.transforms = [glob] * cfg.num_global_crops + [loc] * cfg.num_local_crops

    def __call__(self, image) -> list[Tensor]:
        return [t(image) for t in self.transforms]


class TensorMultiCrops(Dataset):
    """In-memory uint8 images (N, 3, H, W) read as multi-crop views."""

    def __init__(self, images: Tensor, labels: Tensor, transform: MultiCrop) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[list[Tensor], int, int]:
        return self.transform(self.images[i]), int(self.labels[i]), 0


def open_datasets(cfg: MultiCropDataConfig) -> tuple[Dataset, Dataset, int]:
    """(train, valid, number of classes) of the configured source, both read as multi-crop views (validation crops
    are seeded from their offsets too, so every validation sees the same views)."""
    from pathlib import Path

    source = source_of(cfg)
    if source == "embedded":  # drawn at the global crop size, as the classification task draws them
        transform = MultiCrop(cfg, EMBEDDED_MEAN, EMBEDDED_STD)
        images, labels = generate_shapes(cfg.num_train + cfg.num_valid, cfg.seed, global_size(cfg))
        n = cfg.num_train
        return (
            TensorMultiCrops(images[:n], labels[:n], transform),
            TensorMultiCrops(images[n:], labels[n:], transform),
            len(EMBEDDED_CLASSES),
        )
    transform = MultiCrop(cfg, IMAGENET_MEAN, IMAGENET_STD)
    if source == "fake":
        size = global_size(cfg)
        train = FakeImages(cfg.num_train, size, cfg.num_fake_classes, cfg.seed, transform)
        valid = FakeImages(cfg.num_valid, size, cfg.num_fake_classes, cfg.seed + cfg.num_train, transform)
        return train, valid, cfg.num_fake_classes
    train_dir, valid_dir = folder_splits(Path(cfg.path).expanduser().resolve())
    train = ImageFiles(train_dir, transform, cfg.skip_corrupt)
    valid = ImageFiles(valid_dir, transform, cfg.skip_corrupt)
    return train, valid, len(train.classes)
