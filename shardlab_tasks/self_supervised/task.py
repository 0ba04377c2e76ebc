"""Self-supervised pretraining of a RegNet trunk: SwAV, SimCLR and DINO on multi-crop views, no labels used.

Both share the vision task's model options, image sources, config checks and BatchNorm handling (synced over the
ranks, fp32 units under bf16); they replace its classifier with a projection head (and SwAV's prototypes), its inputs
with multi-crop views (shardlab_tasks/self_supervised/data.py) and its loss with the method's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardlab.distributed.sync_bn import convert_sync_batchnorm
from shardlab_tasks.image_classification import model as regnet
from shardlab_tasks.image_classification.task import ImageClassificationTask
from shardlab_tasks.self_supervised import model as ssl_model
from shardlab_tasks.self_supervised.data import crop_sizes, open_datasets
from shardlab_tasks.self_supervised.dino import (
    Center,
    collapse_stats,
    dino_loss,
    linear_warmup,
    teacher_temperature,
    teacher_weights,
)
from shardlab_tasks.self_supervised.simclr import nt_xent
from shardlab_tasks.self_supervised.swav import FeatureQueue, swav_loss


def unwrapped(model: nn.Module) -> ssl_model.SelfSupervisedModel:
    return getattr(model, "module", model)  # DDP wraps; FSDP2 does not


class SelfSupervisedTask(ImageClassificationTask):
    # how BN syncs and where the first weights came from, not what the model holds
    resumable_model_changes = ("sync_bn", "sync_bn_group_size", "pretrained")
    trunk_prefix = ssl_model.TRUNK_PREFIX  # model.pretrained fills trunk.*; the projection head stays seeded

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.stats: dict[str, torch.Tensor] = {}
        """The last loss's collapse diagnostics (the keys of ``diagnostics``)."""

    def config_errors(self) -> list[str]:
        errors = super().config_errors()  # the trunk's model keys, the image source, validation sizes
        m, d, t = self.cfg.model, self.cfg.data, self.cfg.task
        if m.num_classes is not None:
            errors.append(f"model.num_classes ({m.num_classes}): task {t.name} has no classifier; drop it")
        if m.dropout:
            errors.append(f"model.dropout ({m.dropout}): task {t.name} has no classifier to drop features for; drop it")
        if d.num_global_crops < 1 or d.num_local_crops < 0:
            errors.append(
                f"data.num_global_crops must be >= 1 and data.num_local_crops >= 0, got {d.num_global_crops} and "
                f"{d.num_local_crops}"
            )
        for key in ("global_crop_scale", "local_crop_scale"):
            scale = list(getattr(d, key))
            if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
                errors.append(f"data.{key} must be [low, high] with 0 < low <= high <= 1, got {scale}")
        if d.local_crop_size is not None and d.local_crop_size < 8:
            errors.append(f"data.local_crop_size must be >= 8 pixels or null, got {d.local_crop_size}")
        for key in ("color_jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob"):
            if not 0 <= getattr(d, key) <= 1:
                errors.append(f"data.{key} must be a probability in [0, 1], got {getattr(d, key)}")
        if d.color_jitter < 0:
            errors.append(f"data.color_jitter must be >= 0, got {d.color_jitter}")
        if not t.projection_dims or any(w < 1 for w in t.projection_dims):
            errors.append(f"task.projection_dims must be one or more positive widths, got {list(t.projection_dims)}")
        if t.temperature <= 0:
            errors.append(f"task.temperature must be > 0, got {t.temperature}")
        return errors + self.method_errors()

    def method_errors(self) -> list[str]:
        return []

    # ---- data ----------------------------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        self.train_dataset, self.valid_dataset, self.data_classes = open_datasets(self.cfg.data)

    def example_batch(self, batch_size: int):
        meta = torch.device("meta")
        crops = [torch.empty(batch_size, 3, size, size, device=meta) for size in crop_sizes(self.cfg.data)]
        labels = torch.zeros(batch_size, dtype=torch.long, device=meta)
        return crops, labels, torch.zeros(batch_size, dtype=torch.long, device=meta)

    # ---- model ---------------------------------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        m = self.cfg.model
        model = ssl_model.build(m, self.cfg.task)
        if m.sync_bn and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            model = convert_sync_batchnorm(model, m.sync_bn_group_size)  # the head's BatchNorm too
        regnet.keep_norm_input_dtype(model)
        self._init_plan = ssl_model.init_plan(model)
        return model

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return ssl_model.fsdp_units(model)

    def features(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """The trunk's pooled features: the checkpoint's ``trunk.*`` weights are a supervised RegNet's minus ``fc``."""
        model.eval()
        device = next(model.parameters()).device
        with torch.no_grad():
            features, _, _ = model([images.to(device)], features_only=True)
        return features

    # ---- loss ----------------------------------------------------------------------------------------------------
    diagnostics: tuple[str, ...] = ()
    """The collapse diagnostics a method's loss leaves in ``self.stats`` (means over this rank's rows), logged beside
    the loss as means over the logging window's samples."""

    def loss(self, model: nn.Module, batch, device: torch.device):
        crops, labels, skipped = batch
        crops = [c.to(device, non_blocking=True) for c in crops]
        n = len(labels)
        self.stats = {}
        loss = self.method_loss(model, crops, n)
        sums = {"loss_sum": loss.detach() * n, "count": torch.tensor(float(n)), "skipped": skipped.sum().float()}
        sums.update({f"{key}_sum": self.stats[key] * n for key in self.diagnostics if key in self.stats})
        return loss, sums

    def method_loss(self, model: nn.Module, crops: list[torch.Tensor], n: int) -> torch.Tensor:
        raise NotImplementedError

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        metrics = {"loss": sums["loss_sum"] / max(sums["count"], 1)}
        if sums.get("skipped"):
            metrics["skipped"] = int(sums["skipped"])
        for key in self.diagnostics:
            if f"{key}_sum" in sums:
                metrics[key] = sums[f"{key}_sum"] / max(sums["count"], 1)
        return metrics


class SimCLRTask(SelfSupervisedTask):
    def method_errors(self) -> list[str]:
        d = self.cfg.data
        if d.num_global_crops != 2 or d.num_local_crops != 0:
            return [
                f"task=simclr contrasts two views: data.num_global_crops must be 2 and data.num_local_crops 0, got "
                f"{d.num_global_crops} and {d.num_local_crops}"
            ]
        return []

    def method_loss(self, model: nn.Module, crops: list[torch.Tensor], n: int) -> torch.Tensor:
        z, _, _ = model(crops)
        return nt_xent(z, n, self.cfg.task.temperature)


class SwAVTask(SelfSupervisedTask):
    diagnostics = ("code_entropy", "pred_entropy", "score_spread")  # swav.collapse_stats

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.queue: FeatureQueue | None = None
        self.train_state = None

    def method_errors(self) -> list[str]:
        t, d, batch = self.cfg.task, self.cfg.data, self.cfg.optimization.batch_size
        errors, crops = [], d.num_global_crops + d.num_local_crops
        if crops < 2:
            errors.append(f"task=swav predicts one crop's codes from another: it needs >= 2 crops, got {crops}")
        if not t.crops_for_assign or any(not 0 <= c < crops for c in t.crops_for_assign):
            errors.append(f"task.crops_for_assign must be crop indices in [0, {crops}), got {list(t.crops_for_assign)}")
        if t.num_prototypes < 1 or t.sinkhorn_iterations < 1 or t.epsilon <= 0:
            errors.append(
                f"task.num_prototypes and task.sinkhorn_iterations must be >= 1 and task.epsilon > 0, got "
                f"{t.num_prototypes}, {t.sinkhorn_iterations} and {t.epsilon}"
            )
        if min(t.freeze_prototypes_steps, t.queue_start_step, t.hard_codes_steps, t.warmup_temperature_steps) < 0:
            errors.append(
                "task.freeze_prototypes_steps, task.queue_start_step, task.hard_codes_steps and "
                "task.warmup_temperature_steps must be >= 0"
            )
        if t.warmup_temperature is not None and t.warmup_temperature <= 0:
            errors.append(f"task.warmup_temperature must be > 0 (null: no warm-up), got {t.warmup_temperature}")
        if t.queue_length < 0 or t.queue_length % batch:
            errors.append(
                f"task.queue_length ({t.queue_length}) must be a multiple of optimization.batch_size ({batch}): the "
                "queue holds whole past batches; 0 = no queue"
            )
        return errors

    def training_state(self, train_state, device: torch.device) -> FeatureQueue | None:
        t = self.cfg.task
        self.train_state = train_state  # the step, for task.hard_codes_steps and the temperature's warm-up
        if t.queue_length == 0:
            return None
        self.queue = FeatureQueue(
            len(t.crops_for_assign),
            t.queue_length,
            self.cfg.optimization.batch_size,
            t.projection_dims[-1],
            t.queue_start_step,
            train_state,
            device,
        )
        return self.queue

    def frozen_parameters(self, model: nn.Module, step: int) -> list[nn.Parameter]:
        if step < self.cfg.task.freeze_prototypes_steps:
            return [unwrapped(model).prototypes.weight]
        return []

    def method_loss(self, model: nn.Module, crops: list[torch.Tensor], n: int) -> torch.Tensor:
        t = self.cfg.task
        queue = self.queue if model.training else None  # validation neither reads nor fills it
        if model.training:
            normalize_prototypes(model)
        queued = None
        if queue is not None and queue.full:
            queued = torch.cat([queue.rows(i) for i in range(len(t.crops_for_assign))])
        z, scores, queued_scores = model(crops, queued=queued)
        per_crop = list(queued_scores.chunk(len(t.crops_for_assign))) if queued_scores is not None else None
        step = self.train_state.step if self.train_state is not None else None
        loss = swav_loss(
            scores,
            n,
            list(t.crops_for_assign),
            self.temperature(step),
            t.epsilon,
            t.sinkhorn_iterations,
            per_crop or [None] * len(t.crops_for_assign),
            stats=self.stats,
            hard=model.training and self.train_state is not None and self.train_state.step < t.hard_codes_steps,
        )
        if queue is not None:
            queue.push(z, list(t.crops_for_assign), n)
        return loss

    def temperature(self, step: int | None) -> float:
        """task.temperature, or on its warm-up at optimizer step ``step`` (validation too: its loss is the training
        step's); without a step (no training state) the temperature after the warm-up."""
        t = self.cfg.task
        if t.warmup_temperature is None or step is None:
            return t.temperature
        return linear_warmup(t.warmup_temperature, t.temperature, t.warmup_temperature_steps, step)


@torch.no_grad()
def normalize_prototypes(model: nn.Module) -> None:
    """Each prototype to unit length, in place, before the forward (SwAV's step). Under fully_sharded every rank holds
    whole rows of the (row-sharded) weight, so it normalizes its own shard; reshard() first puts the sharded
    parameter in place in case a forward without backward (validation) left the root gathered."""
    if isinstance(model, FSDPModule):
        model.reshard()
    weight = unwrapped(model).prototypes.weight
    rows = weight.to_local() if isinstance(weight, DTensor) else weight
    rows.copy_(F.normalize(rows, dim=1))


class DINOTask(SelfSupervisedTask):
    """DINO (shardlab_tasks/self_supervised/dino.py): the teacher is optimization.ema's average of this model."""

    diagnostics = ("teacher_entropy", "batch_entropy", "z_std")  # dino.collapse_stats

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.center: Center | None = None
        self.train_state = None

    def method_errors(self) -> list[str]:
        t, d, ema = self.cfg.task, self.cfg.data, self.cfg.optimization.ema
        errors = []
        if not ema.enabled:
            errors.append("task=dino's teacher is the moving average of the weights: set optimization.ema.enabled=true")
        if d.num_global_crops + d.num_local_crops < 2:
            errors.append(
                "task=dino predicts the teacher's view of one global crop from another crop: it needs >= 2 crops, got "
                f"{d.num_global_crops + d.num_local_crops}"
            )
        if t.num_prototypes < 1:
            errors.append(f"task.num_prototypes must be >= 1, got {t.num_prototypes}")
        if t.teacher_temperature <= 0 or t.warmup_teacher_temperature <= 0:
            errors.append("task.teacher_temperature and task.warmup_teacher_temperature must be > 0")
        if t.warmup_teacher_temperature_steps < 0 or t.freeze_last_layer_steps < 0:
            errors.append("task.warmup_teacher_temperature_steps and task.freeze_last_layer_steps must be >= 0")
        if not 0 <= t.center_momentum < 1:
            errors.append(f"task.center_momentum must be in [0, 1), got {t.center_momentum}")
        if t.projection_activation not in ("gelu", "relu"):
            errors.append(f"task.projection_activation must be gelu or relu, got '{t.projection_activation}'")
        return errors

    def training_state(self, train_state, device: torch.device) -> Center:
        self.train_state = train_state  # the step (teacher temperature) and the trainer's average (the teacher)
        self.center = Center(self.cfg.task.num_prototypes, self.cfg.task.center_momentum, device)
        return self.center

    def frozen_parameters(self, model: nn.Module, step: int) -> list[nn.Parameter]:
        if step < self.cfg.task.freeze_last_layer_steps:
            return [unwrapped(model).prototypes.weight]
        return []

    def method_loss(self, model: nn.Module, crops: list[torch.Tensor], n: int) -> torch.Tensor:
        t, num_global = self.cfg.task, self.cfg.data.num_global_crops
        state = self.train_state
        average = state.tensors.get("ema") if state is not None else None
        if state is not None and average is None:
            raise RuntimeError("task=dino: the trainer keeps no average of the weights to be the teacher")
        with teacher_weights(model, average):
            teacher_z, teacher, _ = model(crops[:num_global])
        _, student, _ = model(crops)
        step = state.step if state is not None else 0
        center = self.center.center if self.center is not None else torch.zeros((), device=student.device)
        temperature = teacher_temperature(t, step)
        loss = dino_loss(student, teacher, center, num_global, t.temperature, temperature)
        self.stats.update(collapse_stats(teacher, center, temperature, teacher_z))
        if model.training and self.center is not None:
            self.center.update(teacher)
        return loss
