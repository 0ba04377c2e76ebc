"""Config schemas of the self-supervised vision methods (task=swav, task=simclr, task=dino) and their multi-crop data
(the ``multicrop`` data option). Light on purpose, like shardlab_tasks/image_classification/config.py: imported at
start-up for every run, so torchvision is imported only by the task, model and data modules.

The method's own keys live in the task section (``task.temperature=0.2``), the trunk is any RegNet of the vision
task's model options (``model=regnet_cifar``, ``model=regnet_y_400mf``), the crops in the data section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlab.config import TaskConfig, choice
from shardlab.registry import TASKS
from shardlab_tasks.image_classification.config import ImageDataConfig


@dataclass
class SelfSupervisedConfig(TaskConfig):
    projection_dims: list[int] = field(default_factory=lambda: [512, 128])
    """Widths of the projection head's linear layers after the trunk's pooled features; the last is the embedding
    (SwAV and SimCLR on ImageNet: [2048, 128])."""
    projection_bn: bool = True
    """BatchNorm (synced like the trunk's) and ReLU between the head's linear layers (SwAV, SimCLR v2); false = ReLU
    only (SimCLR v1)."""
    projection_last_bn: bool = False
    """A BatchNorm (synced, with its affine) on the embedding itself, its linear layer without bias: SimCLR v2's and
    lightly's head. Compared over 3 seeds in docs/vision.md#the-projection-head."""
    temperature: float = 0.1
    """Softmax temperature of the loss (SwAV: on the prototype scores; SimCLR: on the cosine similarities)."""


@dataclass
class SwAVConfig(SelfSupervisedConfig):
    num_prototypes: int = 3000
    """Prototypes (cluster centres) the codes assign each crop to."""
    sinkhorn_iterations: int = 3
    """Sinkhorn-Knopp iterations of the equal-partition assignment."""
    epsilon: float = 0.05
    """Entropy regularisation of the assignment (smaller = sharper codes)."""
    crops_for_assign: list[int] = field(default_factory=lambda: [0, 1])
    """Indices of the crops (global crops first) whose codes the other crops predict."""
    freeze_prototypes_steps: int = 0
    """Optimizer steps at the start whose prototype gradients are dropped (no update, weight decay or momentum)."""
    queue_length: int = 0
    """Projections of this many past global samples (a multiple of optimization.batch_size) join every Sinkhorn
    assignment once the queue is full; 0 = no queue (useful when the global batch is small against num_prototypes)."""
    queue_start_step: int = 0
    """The optimizer step from which the queue fills (SwAV starts it after some epochs, once features settle)."""
    hard_codes_steps: int = 0
    """Optimizer steps at the start whose codes are one-hot (each row's largest Sinkhorn code): unlike soft codes,
    they stay sharp when the prototype scores flatten, so flat predictions are no resting point (docs/vision.md)."""
    warmup_temperature: float | None = None
    """The temperature at step 0, moving linearly to ``temperature`` over warmup_temperature_steps (null: none). An
    untrained network's predictions at 0.1 are confidently wrong and flatten; begun at 0.5 they start at ln K."""
    warmup_temperature_steps: int = 0
    """Steps of the temperature's warm-up (from warmup_temperature to temperature)."""


@dataclass
class SimCLRConfig(SelfSupervisedConfig):
    temperature: float = 0.5
    """Softmax temperature of NT-Xent over cosine similarities (0.5 for CIFAR-sized images, 0.1 for ImageNet)."""


@dataclass
class DINOConfig(SelfSupervisedConfig):
    projection_dims: list[int] = field(default_factory=lambda: [2048, 2048, 256])
    """The DINO head's MLP widths; the last is the bottleneck, L2-normalized before the last layer."""
    projection_bn: bool = False
    """BatchNorm in the head's MLP (DINO's use_bn_in_head; off by default)."""
    projection_activation: str = choice("gelu", ("gelu", "relu"))
    """The activation between the head's linear layers: gelu (DINO's) or relu."""
    num_prototypes: int = 65536
    """Output dimensions of the weight-normalized last layer (DINO's out_dim, K)."""
    temperature: float = 0.1
    """The student's softmax temperature."""
    teacher_temperature: float = 0.04
    """The teacher's softmax temperature after its warm-up (sharpening; DINO: 0.04 to 0.07)."""
    warmup_teacher_temperature: float = 0.04
    """The teacher's temperature at step 0, rising linearly to teacher_temperature."""
    warmup_teacher_temperature_steps: int = 0
    """Steps of the teacher temperature's warm-up (DINO: 30 epochs)."""
    center_momentum: float = 0.9
    """Momentum of the center: center = m * center + (1 - m) * the global batch's mean teacher output."""
    freeze_last_layer_steps: int = 0
    """Optimizer steps at the start whose last-layer gradients are dropped (DINO: 1 epoch)."""


@dataclass
class MultiCropDataConfig(ImageDataConfig):
    """Images as for image classification (source, path, num_train, ...), each read as several augmented crops.
    data.image_size is the global crops' size; label_smoothing does not apply (no labels are used)."""

    num_global_crops: int = 2
    """Crops of data.image_size pixels per image (SimCLR's two views; SwAV assigns codes to these)."""
    global_crop_scale: list[float] = field(default_factory=lambda: [0.14, 1.0])
    """Area range of a global crop as a fraction of the image (random-resized crop)."""
    num_local_crops: int = 0
    """Extra small crops per image (SwAV's multi-crop: 6 at 96 px for 224 px global crops)."""
    local_crop_size: int | None = None
    """Local crop size in pixels; null = 3/7 of the global size rounded up to a multiple of 8 (224 -> 96, 32 -> 16)."""
    local_crop_scale: list[float] = field(default_factory=lambda: [0.05, 0.14])
    """Area range of a local crop as a fraction of the image."""
    color_jitter: float = 0.5
    """Colour distortion strength s: brightness, contrast and saturation jitter 0.8 s, hue 0.2 s (SimCLR's)."""
    color_jitter_prob: float = 0.8
    """Probability a crop is colour-jittered."""
    grayscale_prob: float = 0.2
    """Probability a crop is turned to grey."""
    blur_prob: float = 0.0
    """Probability of a Gaussian blur (kernel ~1/10 of the crop, sigma in [0.1, 2.0]); SimCLR and SwAV use 0.5 on
    ImageNet, none on 32 px images."""
    solarize_prob: float = 0.0
    """Probability of solarizing a crop (pixels above half brightness inverted; BYOL and DINO use 0.2)."""


# One data section for both methods: conf/data/multicrop.yaml names schema/data/swav (the same dataclass).
TASKS.register_lazy(
    "swav", "shardlab_tasks.self_supervised.task:SwAVTask", dataclass=SwAVConfig, data=MultiCropDataConfig
)
TASKS.register_lazy(
    "simclr", "shardlab_tasks.self_supervised.task:SimCLRTask", dataclass=SimCLRConfig, data=MultiCropDataConfig
)
TASKS.register_lazy(
    "dino", "shardlab_tasks.self_supervised.task:DINOTask", dataclass=DINOConfig, data=MultiCropDataConfig
)
