"""The image-classification task and its RegNet architectures: their config schemas and registrations. Light on
purpose: imported at start-up for every run, so torchvision is imported only by the task, model and data modules
(the LM path never loads it)."""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.config import choice, registry_name
from shardlab.registry import MODELS, TASKS


@dataclass
class RegNetConfig:
    arch: str = registry_name("regnet_cifar", "MODELS")
    """A name in MODELS: regnet (a torchvision flavor, by model.flavor) or regnet_cifar (a small RegNet for 32 px
    images, shaped by the design-space fields below)."""
    flavor: str | None = registry_name(None, "torchvision RegNet builders")
    """arch=regnet: torchvision's builder name, e.g. regnet_y_400mf, regnet_y_16gf, regnet_x_8gf."""
    num_classes: int | None = None
    """Classifier outputs; null = the number of classes in the data."""
    sync_bn: bool = True
    """On more than one rank, normalize with the statistics of the whole global batch (torch's SyncBatchNorm on
    CUDA, shardlab's on CPU/gloo), so the run does not depend on the world size."""
    dropout: float = 0.0
    """Dropout on the pooled features before the classifier, in [0, 1) (torchvision's RegNets have none: 0)."""
    sync_bn_group_size: int = 0
    """Ranks whose batches share BN statistics: 0 = all; k = groups of k consecutive ranks (must divide the world)."""
    depth: int = 6
    """regnet_cifar: blocks in all stages together (RegNet's d)."""
    w_0: int = 24
    """regnet_cifar: width of the first block, a multiple of 8 (RegNet's w_0)."""
    w_a: float = 24.0
    """regnet_cifar: slope of the linear width ramp over the blocks (RegNet's w_a, >= 0)."""
    w_m: float = 2.0
    """regnet_cifar: width multiplier between stages; the ramp is quantized to its powers (RegNet's w_m, > 1)."""
    group_width: int = 8
    """regnet_cifar: channels per group of the 3x3 grouped convolutions."""
    bottleneck_multiplier: float = 1.0
    """regnet_cifar: bottleneck width as a multiple of the block width (1.0 for RegNetX/Y)."""
    se_ratio: float | None = 0.25
    """regnet_cifar: squeeze-excitation width as a fraction of the block input (RegNetY); null = none (RegNetX)."""
    stem_width: int = 16
    """regnet_cifar: channels of the 3x3 stem, which keeps the input resolution (stride 1, unlike ImageNet's 2)."""
    pretrained: str | None = None
    """torchvision RegNet weights to start the trunk from: a state-dict file, torch.save(model.state_dict()) as
    torchvision publishes them; the head is new (docs/vision.md#starting-from-torchvisions-weights)."""


@dataclass
class ImageDataConfig:
    source: str | None = choice(None, ("embedded", "folder", "fake"))
    """embedded (generated shapes and textures), folder (an ImageFolder tree at data.path) or fake (torchvision
    FakeData, for throughput runs); null = folder when data.path is set, else embedded."""
    path: str | None = None
    """folder: a directory holding train/<class>/<image> and val/<class>/<image> (the ImageNet layout)."""
    image_size: int | None = None
    """Train crop and evaluation resolution in pixels; null = the source's own (32 embedded, 224 folder and fake)."""
    augment: bool = True
    """Random crop and horizontal flip of training images (false gives every rank layout the same inputs)."""
    label_smoothing: float = 0.1
    """Cross-entropy label smoothing, in [0, 1)."""
    skip_corrupt: bool = False
    """folder: skip an image that fails to decode (counted and logged) instead of stopping with an error."""
    num_workers: int = 0
    """DataLoader worker processes per rank for decoding (folder, fake); read by the trainer via Task.num_workers."""
    num_train: int = 5000
    """embedded and fake: training images."""
    num_valid: int = 1000
    """embedded and fake: validation images (for choosing recipes; shardlab-evaluate --split valid)."""
    num_test: int = 1000
    """embedded and fake: test images, drawn apart from train and validation and read only by shardlab-evaluate (its
    default split), so nothing is tuned on them; folder: data.path/test/ if present."""
    num_fake_classes: int = 1000
    """fake: number of classes."""
    seed: int = 0
    """embedded and fake: seed of the generated images (the same seed gives the same dataset on every machine)."""


TASKS.register_lazy(
    "image_classification", "shardlab_tasks.image_classification.task:ImageClassificationTask", data=ImageDataConfig
)
MODELS.register_lazy("regnet", "shardlab_tasks.image_classification.model:regnet", dataclass=RegNetConfig)
MODELS.register_lazy("regnet_cifar", "shardlab_tasks.image_classification.model:regnet_cifar", dataclass=RegNetConfig)
