"""Image datasets: generated shapes and textures (the embedded default), an ImageFolder tree, or FakeData.

Every sample is (image tensor, label, skipped): ``skipped`` counts undecodable files passed over to produce it
(folder with data.skip_corrupt=true), so the task can report them with the other metrics.

The embedded default needs no download: 10 classes of shapes and textures in random colours, positions, sizes,
rotations, contrasts and noise, drawn from data.seed into memory in about a second. Chance is 10 %; a small RegNet
learns it to well above that in minutes on a CPU.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from shardlab.errors import DataError
from shardlab.files.regular_file import MiB, NotAFile, open_file
from shardlab_tasks.image_classification.config import ImageDataConfig

SOURCES = ("embedded", "folder", "fake")
EMBEDDED_CLASSES = ("disk", "ring", "square", "triangle", "plus", "cross", "h_stripes", "v_stripes", "checker", "dots")
EMBEDDED_SIZE = 32
EMBEDDED_MEAN, EMBEDDED_STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EVAL_CROP_RATIO = 0.875
"""Evaluation resizes to image_size / 0.875 and centre-crops image_size (the ImageNet convention: 256 -> 224)."""


def source_of(cfg: ImageDataConfig) -> str:
    return cfg.source or ("folder" if cfg.path else "embedded")


def native_size(source: str) -> int:
    return EMBEDDED_SIZE if source == "embedded" else 224


# ---- embedded: generated shapes and textures -------------------------------------------------------------------------
def generate_shapes(num: int, seed: int, size: int = EMBEDDED_SIZE) -> tuple[Tensor, Tensor]:
    """``num`` uint8 images (num, 3, size, size) and balanced labels; a function of (num, seed, size) only."""
    g = torch.Generator().manual_seed(seed)

    def u(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=g)

    labels = (torch.arange(num) % len(EMBEDDED_CLASSES))[torch.randperm(num, generator=g)]
    centre = (u(num, 2) * 2 - 1) * 0.3
    radius = 0.35 + 0.3 * u(num)
    angle = (u(num) * 2 - 1) * math.pi / 12  # +-15 degrees: a plus never turns into a cross, nor h into v stripes
    freq = 2.0 + 2.5 * u(num)  # stripe periods per image half-width
    phase = u(num) * 2 * math.pi
    # Colours: a background, and a foreground brighter or darker than it by a random contrast (some are faint).
    background = u(num, 3)
    sign = torch.where(background.mean(1, keepdim=True) < 0.5, 1.0, -1.0)
    foreground = (background + sign * (0.15 + 0.6 * u(num, 1)) * (0.6 + 0.4 * u(num, 3))).clamp(0, 1)
    images = torch.empty(num, 3, size, size, dtype=torch.uint8)
    for start in range(0, num, 1024):  # in chunks: the masks of every class are drawn for every image of a chunk
        chunk = slice(start, min(start + 1024, num))
        mask = _class_masks(labels[chunk], centre[chunk], radius[chunk], angle[chunk], freq[chunk], phase[chunk], size)
        m = mask[:, None]
        pixels = background[chunk, :, None, None] * (1 - m)  # in place from here: fewer large temporaries
        pixels += foreground[chunk, :, None, None] * m
        pixels += torch.randn(pixels.shape, generator=g).mul_(0.12)
        images[chunk] = pixels.clamp_(0, 1).mul_(255).round_()  # the copy into uint8 truncates the rounded values
    return images, labels


def _class_masks(labels, centre, radius, angle, freq, phase, size: int) -> Tensor:
    """Foreground masks (n, size, size) in [0, 1]: each image's class drawn with its own geometry."""
    grid = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 2 - 1  # pixel centres in [-1, 1]
    ys, xs = torch.meshgrid(grid, grid, indexing="ij")
    mask = torch.zeros(len(labels), size, size)
    for c, name in enumerate(EMBEDDED_CLASSES):
        chosen = (labels == c).nonzero().squeeze(1)  # each class drawn on its own images only
        if len(chosen):
            geometry = (centre[chosen], radius[chosen], angle[chosen], freq[chosen], phase[chosen])
            mask[chosen] = _shape_mask(name, xs, ys, *geometry).float()
    return mask


def _shape_mask(name: str, xs: Tensor, ys: Tensor, centre, radius, angle, freq, phase) -> Tensor:
    """The boolean masks (n, size, size) of class ``name`` for n images' geometry."""

    def col(t: Tensor) -> Tensor:
        return t[:, None, None]

    dx, dy = xs - col(centre[:, 0]), ys - col(centre[:, 1])
    cos, sin = col(angle.cos()), col(angle.sin())
    rx, ry = dx * cos + dy * sin, -dx * sin + dy * cos  # offsets in the shape's rotated frame
    r, f, ph = col(radius), col(freq), col(phase)
    width = 0.18 * r + 0.04
    if name in ("disk", "ring"):
        dist = (rx**2 + ry**2).sqrt()
        return dist < r if name == "disk" else (dist - 0.75 * r).abs() < width
    if name == "square":
        return torch.maximum(rx.abs(), ry.abs()) < 0.75 * r
    if name == "triangle":
        return (ry.abs() < 0.75 * r) & (rx.abs() < (ry + 0.75 * r) * 0.6)
    if name == "plus":
        return ((rx.abs() < width) & (ry.abs() < r)) | ((ry.abs() < width) & (rx.abs() < r))
    if name == "cross":
        ax, ay = (rx + ry) / math.sqrt(2), (rx - ry) / math.sqrt(2)
        return ((ax.abs() < width) & (ay.abs() < r)) | ((ay.abs() < width) & (ax.abs() < r))
    if name == "h_stripes":
        return torch.sin(math.pi * f * ry + ph) > 0
    wave_x = torch.sin(math.pi * f * rx + ph)
    if name == "v_stripes":
        return wave_x > 0
    wave_xy = wave_x * torch.sin(math.pi * f * ry)
    return wave_xy > 0 if name == "checker" else wave_xy > 0.5  # checker, dots


class TensorImages(Dataset):
    """Images held in memory as uint8 (N, 3, H, W). Training augmentation is the CIFAR recipe - a random crop of the
    image reflection-padded by 1/8 of its size, and a horizontal flip - done with a few tensor ops per sample
    (torchvision's per-sample v2 pipeline measured >10x slower at 32 px: longer than the small model's step)."""

    def __init__(self, images: Tensor, labels: Tensor, augment: bool) -> None:
        self.labels, self.augment = labels, augment
        self.size = images.shape[-1]
        self.pad = self.size // 8 if augment else 0
        self.images = reflect_pad(images, self.pad) if self.pad else images  # once, here, rather than per sample
        self.shift = torch.tensor(EMBEDDED_MEAN).view(3, 1, 1) * 255
        self.scale = torch.tensor(EMBEDDED_STD).view(3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int, int]:
        image = self.images[i]
        if self.augment:  # the global RNG, which the trainer reseeds from (seed, step, rank) every step
            top, left = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
            image = image[:, top : top + self.size, left : left + self.size]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return (image.float() - self.shift) / self.scale, int(self.labels[i]), 0


def reflect_pad(images: Tensor, pad: int) -> Tensor:
    """``torch.nn.functional.pad(images, [pad] * 4, mode="reflect")`` on the last two dimensions, on the uint8 bytes
    as they are (reflection padding needs float on CPU, and is slow there: every vision run paid it at start-up), by
    copying flipped edge strips (a gather through index_select is several times slower): each side mirrors the
    ``pad`` rows (columns) next to the edge, not the edge itself."""
    rows = torch.cat([images[..., 1 : pad + 1, :].flip(-2), images, images[..., -pad - 1 : -1, :].flip(-2)], dim=-2)
    return torch.cat([rows[..., 1 : pad + 1].flip(-1), rows, rows[..., -pad - 1 : -1].flip(-1)], dim=-1)


# ---- folder: an ImageFolder tree ----------------------------------------------------------------------------------
IMAGE_MAX_BYTES = 1024 * MiB
"""The largest image file read (a 16k x 16k TIFF is ~770 MB): past it, an image is refused as undecodable."""


def _open_image(path: Path, root: Path):
    """An image file of the folder, opened through the one reader: a regular file of at most IMAGE_MAX_BYTES, links
    followed while they stay inside ``root`` (a FIFO under an image's name blocked a DataLoader worker for ever).
    NotAFile or OSError otherwise, which the caller treats as an undecodable image."""
    fd, _ = open_file(path, max_bytes=IMAGE_MAX_BYTES, root=root)
    return os.fdopen(fd, "rb")


class ImageFiles(Dataset):
    """torchvision's ImageFolder with one-line errors: a file that fails to decode raises a DataError naming it, or,
    with skip_corrupt, is passed over for the next decodable file (so every batch keeps its size and every rank its
    share of a synced BN batch) and counted in the sample's ``skipped``."""

    def __init__(self, root: Path, transform, skip_corrupt: bool) -> None:
        from torchvision.datasets import ImageFolder

        try:
            self.folder = ImageFolder(str(root))
        except FileNotFoundError as e:  # "Couldn't find any class folder in ..." / "Found no valid file for ..."
            reason = str(e).strip().splitlines()[0].rstrip(".")
            raise DataError(
                f"data.path: {root} has no class folders with images ({reason}); expected {root}/<class>/<image>"
            ) from None
        self.root, self.transform, self.skip_corrupt = root, transform, skip_corrupt
        self.classes = self.folder.classes
        self._reported: set[str] = set()

    def __len__(self) -> int:
        return len(self.folder.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, int, int]:
        from PIL import Image

        n = len(self)
        for skipped in range(n):
            path, label = self.folder.samples[(i + skipped) % n]
            try:
                with _open_image(Path(path), self.root) as f:
                    image = Image.open(f).convert("RGB")
            except (NotAFile, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:  # and PIL's
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if not self.skip_corrupt:
                    raise DataError(
                        f"data: cannot decode image {path} ({reason}); delete or replace it, "
                        "or set data.skip_corrupt=true to skip undecodable images"
                    ) from None
                if path not in self._reported:
                    self._reported.add(path)
                    print(f"warning: data: skipping undecodable image {path} ({reason})", file=sys.stderr, flush=True)
                continue
            return self.transform(image), label, skipped
        raise DataError(f"data.path: no image under {self.root} could be decoded; check the files")


def folder_splits(root: Path) -> tuple[Path, Path]:
    """<root>/train and <root>/val (or valid), or a DataError saying what is missing."""
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise DataError(f"data.path: {root} {what}; give a directory with train/<class>/ and val/<class>/")
    train = root / "train"
    valid = next((root / name for name in ("val", "valid", "validation") if (root / name).is_dir()), None)
    if not train.is_dir() or valid is None:
        missing = "train/" if not train.is_dir() else "val/"
        raise DataError(
            f"data.path: {root} has no {missing} directory; expected {root}/train/<class>/<image> and "
            f"{root}/val/<class>/<image> (the ImageNet layout)"
        )
    return train, valid


def count_classes(cfg: ImageDataConfig) -> int:
    """Classes of the configured data without opening it (for building the model on meta, e.g. dry_run)."""
    source = source_of(cfg)
    if source == "embedded":
        return len(EMBEDDED_CLASSES)
    if source == "fake":
        return cfg.num_fake_classes
    train, _ = folder_splits(Path(cfg.path).expanduser())
    classes = [p for p in train.iterdir() if p.is_dir()]
    if not classes:
        raise DataError(f"data.path: {train} has no class folders; expected {train}/<class>/<image>")
    return len(classes)


def count_valid_images(cfg: ImageDataConfig) -> tuple[Path, int] | None:
    """(validation directory, images in it) of a folder source without decoding anything; None when the layout is
    wrong (open_datasets then names the problem)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    try:
        _, valid = folder_splits(Path(cfg.path).expanduser().resolve())
    except DataError:
        return None
    count = sum(1 for p in valid.glob("*/**/*") if p.suffix.lower() in IMG_EXTENSIONS and p.is_file())
    return (valid, count) if count else None  # no images in class folders: ImageFolder's error says more


# ---- transforms and assembly ---------------------------------------------------------------------------------------
def transforms(size: int, augment: bool, train: bool) -> v2.Compose:
    """For decoded files: train = random-resized crop and horizontal flip, evaluation = resize to size / 0.875 and
    centre crop; then float in [0, 1] normalized with ImageNet's channel statistics."""
    steps: list = [v2.ToImage()]
    if train and augment:
        steps += [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        steps += [v2.Resize(round(size / EVAL_CROP_RATIO), antialias=True), v2.CenterCrop(size)]
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)


class FakeImages(Dataset):
    """torchvision's FakeData (random noise, random labels: for throughput, not accuracy)."""

    def __init__(self, num: int, size: int, num_classes: int, offset: int, transform) -> None:
        from torchvision.datasets import FakeData

        self.data = FakeData(num, (3, size, size), num_classes, transform=transform, random_offset=offset)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Tensor, int, int]:
        image, label = self.data[i]
        return image, int(label), 0


# ---- the held-out test split (shardlab-evaluate) ---------------------------------------------------------------------
EVAL_SPLITS = ("valid", "test")
"""What a trunk is judged on: valid (for choosing recipes, as the training runs' validation) or test (nothing is
tuned on it; shardlab-evaluate's default)."""


def test_split_seed(seed: int) -> int:
    """The generator seed of the embedded test split: a hash of data.seed, so its images are a draw of their own, the
    same for every method, training seed and data.num_train/num_valid, and no data.seed's train draw."""
    digest = hashlib.sha256(f"shardlab embedded test split, data.seed={seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def folder_test_split(root: Path) -> Path | None:
    """<root>/test when an ImageFolder tree has one (ImageNet's test labels are not public: it has none)."""
    test = root / "test"
    return test if test.is_dir() else None


def open_test(cfg: ImageDataConfig) -> Dataset | None:
    """The test split, unaugmented: embedded, data.num_test images drawn from test_split_seed(data.seed) (the train
    and validation images stay those of the first data.num_train + data.num_valid draws); fake, the data.num_test
    samples after the validation ones; folder, data.path/test/ (None when there is none)."""
    source = source_of(cfg)
    size = cfg.image_size or native_size(source)
    if source == "embedded":
        images, labels = generate_shapes(cfg.num_test, test_split_seed(cfg.seed), size)
        return TensorImages(images, labels, augment=False)
    if source == "fake":
        tf_fake = v2.Compose(
            [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        )
        offset = cfg.seed + cfg.num_train + cfg.num_valid
        return FakeImages(cfg.num_test, size, cfg.num_fake_classes, offset, tf_fake)
    root = Path(cfg.path).expanduser().resolve()
    test_dir = folder_test_split(root)
    if test_dir is None:
        return None
    test = ImageFiles(test_dir, transforms(size, augment=False, train=False), cfg.skip_corrupt)
    train_classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    if test.classes != train_classes:  # labels are class-folder indices: another set would mislabel every image
        extra = sorted(set(test.classes) ^ set(train_classes))
        raise DataError(
            f"data.path: {root / 'train'} and {test_dir} have different class folders (e.g. {extra[:3]}); the test "
            "split needs the train split's classes"
        )
    return test


def open_datasets(cfg: ImageDataConfig) -> tuple[Dataset, Dataset, int]:
    """(train, valid, number of classes) for the configured source."""
    source = source_of(cfg)
    size = cfg.image_size or native_size(source)
    if source == "embedded":  # drawn at the configured resolution: nothing to resize
        images, labels = generate_shapes(cfg.num_train + cfg.num_valid, cfg.seed, size)
        train = TensorImages(images[: cfg.num_train], labels[: cfg.num_train], cfg.augment)
        valid = TensorImages(images[cfg.num_train :], labels[cfg.num_train :], augment=False)
        return train, valid, len(EMBEDDED_CLASSES)

    if source == "fake":  # noise at the final size: no augmentation or resize, only the tensor conversion
        tf_fake = v2.Compose(
            [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        )
        train = FakeImages(cfg.num_train, size, cfg.num_fake_classes, cfg.seed, tf_fake)
        valid = FakeImages(cfg.num_valid, size, cfg.num_fake_classes, cfg.seed + cfg.num_train, tf_fake)
        return train, valid, cfg.num_fake_classes
    train_dir, valid_dir = folder_splits(Path(cfg.path).expanduser().resolve())
    train = ImageFiles(train_dir, transforms(size, cfg.augment, train=True), cfg.skip_corrupt)
    valid = ImageFiles(valid_dir, transforms(size, cfg.augment, train=False), cfg.skip_corrupt)
    if valid.classes != train.classes:
        extra = sorted(set(valid.classes) ^ set(train.classes))
        raise DataError(
            f"data.path: {train_dir} and {valid_dir} have different class folders (e.g. {extra[:3]}); labels are "
            "class-folder indices, so both splits need the same set"
        )
    return train, valid, len(train.classes)
