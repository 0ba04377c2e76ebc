"""Tiny vision configs shared by the unit and distributed tests, all on one 2-stage RegNetY (~3k parameters, with
squeeze-excitation) on 16 px generated images: image classification on it (TINY_VISION, which each test completes with
the length and sizes of its run), and the self-supervised methods (2 global crops of 16 px and 2 local ones of 8 px, a
global batch of 16)."""

from __future__ import annotations

from tests.conftest import compose_config

STEPS = 6
TINY_REGNET = [
    "model.depth=2",
    "model.w_0=8",
    "model.w_a=8",
    "model.group_width=8",
    "model.stem_width=8",
    "data.image_size=16",
]
# Supervised: the task on the tiny trunk, no validation during the run, quiet logs.
TINY_VISION = [
    "task=image_classification",
    *TINY_REGNET,
    "validation.interval_steps=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]
TINY_SSL = [
    "distributed=single",  # the tasks' default is two fully_sharded ranks
    "distributed.world_size=1",
    *TINY_REGNET,
    "data.local_crop_size=8",
    "data.num_train=128",
    "data.num_valid=32",
    "data.num_workers=0",
    "task.projection_dims=[32,16]",
    "optimization.batch_size=16",
    f"optimization.max_steps={STEPS}",
    "optimizer.lr=2.0",
    "lr_scheduler.warmup_steps=1",
    "validation.interval_steps=0",
    "validation.num_batches=1",
    "validation.batch_size=16",
    "checkpoint.interval_steps=0",
    "logging.interval_steps=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]
# SwAV with everything that has state or a schedule: 2 + 2 crops, prototypes frozen for the first 3 steps, a queue of
# two batches that starts filling at step 1 (full from step 3 on, used from step 4), the temperature warming up from
# 0.5 to the default's 0.1 over 4 steps.
SWAV = [
    "task=swav",
    *TINY_SSL,
    "data.num_local_crops=2",
    "task.num_prototypes=24",
    "task.freeze_prototypes_steps=3",
    "task.queue_length=32",
    "task.queue_start_step=1",
    "task.warmup_temperature_steps=4",
]
SIMCLR = ["task=simclr", *TINY_SSL]
# DINO with everything that has state or a schedule: 2 + 2 crops, the last layer frozen for 3 steps, the teacher
# temperature warming up over 3 steps, the teacher's momentum on its cosine, the center.
DINO = [
    "task=dino",
    *TINY_SSL,
    "data.num_local_crops=2",
    "task.projection_dims=[32,32,16]",
    "task.num_prototypes=24",
    "task.freeze_last_layer_steps=3",
    "task.warmup_teacher_temperature=0.02",
    "task.warmup_teacher_temperature_steps=3",
    "optimizer.lr=0.01",
    "optimization.ema.decay=0.9",
    # No BatchNorm in the head here: over this 16-image batch it amplifies rounding (one pass against per-rank
    # statistics combined) to 3e-4 of the loss by step 4, past the parity tests' 1e-5; test_dino_parity.py holds the
    # default's head BatchNorm on two ranks to a looser bound of its own.
    "task.projection_bn=false",
]


def swav(*overrides: str):
    return compose_config([*SWAV, *overrides])


def simclr(*overrides: str):
    return compose_config([*SIMCLR, *overrides])


def dino(*overrides: str):
    return compose_config([*DINO, *overrides])
