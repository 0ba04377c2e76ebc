"""Image classification: label-smoothed cross-entropy, top-1/top-5 accuracy, RegNets with (synced) BatchNorm."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardlab.distributed.sync_bn import convert_sync_batchnorm
from shardlab.errors import CheckpointError, ConfigError
from shardlab.registry import MODELS, unknown_name_message
from shardlab.task import Task, setting
from shardlab_tasks.image_classification import model as regnet
from shardlab_tasks.image_classification import pretrained
from shardlab_tasks.image_classification.config import RegNetConfig
from shardlab_tasks.image_classification.data import (
    SOURCES,
    count_classes,
    count_valid_images,
    native_size,
    open_datasets,
    source_of,
)

CIFAR_SHAPE_KEYS = ("depth", "w_0", "w_a", "w_m", "group_width", "bottleneck_multiplier", "se_ratio", "stem_width")
"""The RegNetConfig fields only arch=regnet_cifar reads (a torchvision flavor has its shape built in)."""


def ignored_model_keys(m) -> list[str]:
    """Keys the chosen architecture would silently ignore: regnet_cifar's shape under arch=regnet (a flavor has its
    own), model.flavor under arch=regnet_cifar."""
    defaults = RegNetConfig()
    if m.arch == "regnet":
        changed = [f"model.{key}" for key in CIFAR_SHAPE_KEYS if getattr(m, key) != getattr(defaults, key)]
        if changed:
            one = len(changed) == 1
            return [
                f"{', '.join(changed)} shape{'s' if one else ''} arch=regnet_cifar only; arch=regnet takes its shape "
                f"from model.flavor ({m.flavor}): drop {'it' if one else 'them'} or use model=regnet_cifar"
            ]
    if m.arch == "regnet_cifar" and m.flavor is not None:
        return [
            f"model.flavor ({m.flavor}) names a torchvision RegNet, which arch=regnet_cifar does not read (its shape "
            "is model.depth, w_0, w_a, ...); drop model.flavor, or use model.arch=regnet"
        ]
    return []


class ImageClassificationTask(Task):
    unit = "images"
    # how BN syncs and where the first weights came from, not what the model holds
    resumable_model_changes = ("dropout", "sync_bn", "sync_bn_group_size", "pretrained")
    trunk_prefix = ""
    """Where the model holds the trunk that model.pretrained fills (the self-supervised model's: ``trunk.``)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.data_classes: int | None = None
        self._init_plan: dict = {}

    @property
    def num_workers(self) -> int:
        """DataLoader workers per rank (data.num_workers): decoding JPEGs needs them; in-memory images do not."""
        return self.cfg.data.num_workers

    def config_errors(self) -> list[str]:
        m, d = self.cfg.model, self.cfg.data
        errors = []
        if m.arch == "regnet" and m.flavor not in regnet.FLAVORS:
            errors.append(unknown_name_message(str(m.flavor), "RegNet flavor", regnet.FLAVORS, "model.flavor"))
        if m.arch == "regnet_cifar":
            errors += regnet.design_errors(m)
        errors += ignored_model_keys(m)
        if m.num_classes is not None and m.num_classes < 1:
            errors.append(f"model.num_classes must be >= 1 or null (from the data), got {m.num_classes}")
        if m.sync_bn_group_size < 0:
            errors.append(f"model.sync_bn_group_size must be >= 0 (0 = all ranks), got {m.sync_bn_group_size}")
        if d.source is not None and d.source not in SOURCES:
            errors.append(unknown_name_message(d.source, "image source", list(SOURCES), "data.source"))
        elif source_of(d) == "folder" and not d.path:
            errors.append("data.source=folder needs data.path (a directory with train/<class>/ and val/<class>/)")
        if d.image_size is not None and d.image_size < 8:
            errors.append(f"data.image_size must be >= 8 pixels or null (the source's own), got {d.image_size}")
        if not 0 <= d.label_smoothing < 1:
            errors.append(f"data.label_smoothing must be in [0, 1), got {d.label_smoothing}")
        if d.num_workers < 0:
            errors.append(f"data.num_workers must be >= 0, got {d.num_workers}")
        if not 0 <= m.dropout < 1:
            errors.append(f"model.dropout must be in [0, 1), got {m.dropout}")
        vb = self.cfg.validation.batch_size
        counted = count_valid_images(d) if source_of(d) == "folder" and d.path else None
        if counted is not None and counted[1] < vb:
            errors.append(
                f"data.path: {counted[0]} holds {counted[1]} images, fewer than one validation.batch_size ({vb}); "
                "lower validation.batch_size or add images"
            )
        if source_of(d) == "fake" and d.num_fake_classes < 1:
            errors.append(f"data.num_fake_classes must be >= 1, got {d.num_fake_classes}")
        if source_of(d) != "folder":
            if d.num_train < 1:
                errors.append(f"data.num_train must be >= 1, got {d.num_train}")
            if d.num_valid < vb:
                errors.append(
                    f"data.num_valid ({d.num_valid}) must hold at least one validation.batch_size ({vb}) of images"
                )
        return errors or self.pretrained_errors()  # the trunk is built to check the file only from valid keys

    def pretrained_errors(self) -> list[str]:
        """model.pretrained: a state-dict file whose tensors fit the trunk (read from its index, mapped, not loaded)."""
        m = self.cfg.model
        if not setting(m, "pretrained"):
            return []
        if self.cfg.checkpoint.init_from:
            return ["model.pretrained and checkpoint.init_from both give the starting weights; keep one"]
        path = Path(m.pretrained).expanduser()
        try:
            stored = pretrained.read_state_dict(path)
        except CheckpointError as e:
            return [str(e)]
        with torch.device("meta"):
            trunk = MODELS.build(m.arch, m, 1, key="model.arch")  # the classifier is not compared: any width
        errors = pretrained.fit_errors(stored, pretrained.trunk_shapes(trunk))
        return [pretrained.refusal(path, stored, errors)] if errors else []

    def load_pretrained(self, model: nn.Module, device: torch.device) -> Path | None:
        """model.pretrained's trunk into the wrapped, materialized model, each rank copying its shards' slices; the
        head keeps its seeded init."""
        if not setting(self.cfg.model, "pretrained"):
            return None
        return pretrained.load_trunk(model, Path(self.cfg.model.pretrained).expanduser(), self.trunk_prefix, device)

    def pretrained_keys(self):
        """With model.pretrained: the trunk's parameters and buffers, which load_trunk fills (it refuses, before any
        copy, a file that lacks one, so none is left as allocated); the head (classifier, projection, prototypes)
        keeps its seeded init. A dry run reads no file, so it draws everything."""
        if not setting(self.cfg.model, "pretrained") or setting(self.cfg, "dry_run"):
            return None
        prefix = self.trunk_prefix
        return lambda name: pretrained.is_trunk(name, prefix)

    def world_errors(self, world_size: int) -> list[str]:
        group = self.cfg.model.sync_bn_group_size
        if self.cfg.model.sync_bn and world_size > 1 and group > 0 and (group > world_size or world_size % group):
            # the ranks' BN groups (shardlab.distributed.sync_bn) would refuse it after the process group is up
            return [
                f"model.sync_bn_group_size ({group}) must divide the world size ({world_size}); use 0 to share BN "
                "statistics over all ranks"
            ]
        return []

    # ---- data ----------------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        self.train_dataset, self.valid_dataset, self.data_classes = open_datasets(self.cfg.data)
        wanted = self.cfg.model.num_classes
        if wanted is not None and wanted < self.data_classes:
            raise ConfigError(
                f"model.num_classes ({wanted}) is smaller than the {self.data_classes} classes in the data; "
                "use null to take the data's"
            )

    def more_samples_hint(self, split: str) -> str:
        key = "data.num_train" if split == "training" else "data.num_valid"
        return f"raise {key} (embedded, fake) or add images (folder)"

    def num_classes(self) -> int:
        if self.cfg.model.num_classes is not None:
            return self.cfg.model.num_classes
        return self.data_classes if self.data_classes is not None else count_classes(self.cfg.data)

    # ---- model ---------------------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        m = self.cfg.model
        model = MODELS.build(m.arch, m, self.num_classes(), key="model.arch")
        # Runs inside the ranks after the backend joined the process group (never in dry_run), so the sync group
        # can be created here; every rank builds the model, as creating subgroups requires.
        if m.sync_bn and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            model = convert_sync_batchnorm(model, m.sync_bn_group_size)
        regnet.keep_norm_input_dtype(model)
        self._init_plan = regnet.init_plan(model)
        return model

    def init_tensor(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        assert name in self._init_plan, f"no init rule for {name}: build_model makes the plan"
        self._init_plan[name](tensor, generator)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return regnet.fsdp_units(model)

    def full_precision_modules(self, model: nn.Module) -> list[nn.Module]:
        return [module for module in model.modules() if isinstance(module, _BatchNorm)]

    def example_batch(self, batch_size: int):
        size = self.cfg.data.image_size or native_size(source_of(self.cfg.data))
        meta = torch.device("meta")
        images = torch.empty(batch_size, 3, size, size, device=meta)
        labels = torch.zeros(batch_size, dtype=torch.long, device=meta)
        return images, labels, torch.zeros(batch_size, dtype=torch.long, device=meta)

    # ---- loss and metrics ----------------------------------------------------------------------------------------
    def loss(self, model: nn.Module, batch, device: torch.device):
        images, labels, skipped = batch
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in fp32, or float64
        loss = F.cross_entropy(logits, labels, label_smoothing=self.cfg.data.label_smoothing)
        top5 = logits.topk(min(5, logits.size(1)), dim=1).indices
        hits = top5 == labels[:, None]
        n = labels.numel()
        return loss, {
            "loss_sum": loss.detach() * n,
            "top1": hits[:, 0].sum().float(),
            "top5": hits.any(1).sum().float(),
            "count": torch.tensor(float(n)),
            "skipped": skipped.sum().float(),
        }

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums["count"], 1)
        metrics = {
            "loss": sums["loss_sum"] / count,
            "top1": 100 * sums["top1"] / count,
            "top5": 100 * sums["top5"] / count,
        }
        if sums.get("skipped"):
            metrics["skipped"] = int(sums["skipped"])  # undecodable images passed over (data.skip_corrupt=true)
        return metrics

    def num_units(self, batch) -> int:
        return len(batch[1])

    def features(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """What the classifier sees: the trunk's pooled features (the input of model.fc)."""
        return regnet.trunk_features(model, images)

    def evaluation(self):
        """shardlab-evaluate's linear probe and kNN on the trunk's features (shardlab_tasks/image_classification/
        evaluation.py), for the self-supervised tasks too."""
        from shardlab_tasks.image_classification.evaluation import TrunkEvaluation

        return TrunkEvaluation(self)
