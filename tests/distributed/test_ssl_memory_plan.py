"""The memory plan for SwAV's multi-crop (2 x 32 px + 4 x 16 px crops through the trunk, projection head, prototypes)
against the fullest rank's measured training-step peak at world size 2 (CPU, gloo): within 25%, as for the LM
(tests/distributed/test_memory_plan.py says how peaks are measured)."""

from __future__ import annotations

import pytest

from tests.conftest import compose_config
from tests.distributed.harness import run_spawned


@pytest.mark.slow  # ~45 s: the suite's budget; the LM's plan against its measured peak runs by default
def test_predicted_peak_of_swav_multi_crop_matches_the_measured_one(tmp_path):
    # SwAV multi-crop (regnet_cifar, 2 x 32 + 4 x 16 crops, as on ImageNet) with 128 images per rank: ~0.6 GiB of
    # activations, well above a rank's runtime noise.
    cfg = compose_config(
        [
            "task=swav",
            "data.num_local_crops=4",
            "distributed=fully_sharded",
            "optimization.batch_size=256",
            "optimization.max_steps=3",
            "lr_scheduler.warmup_steps=0",
            "data.num_train=1024",
            "data.num_valid=128",
            "data.num_workers=0",
            "validation.num_batches=1",
            "validation.batch_size=64",
            "checkpoint.save=false",
            "distributed.cpu_allocator=lean",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
        ]
    )
    # Fresh interpreters: the memory measured is a rank's own (tests/distributed/harness.py).
    memory = run_spawned([cfg], 2, run_dirs=[tmp_path / "swav"], start_method="spawn")[0]["memory"]
    error = memory["predicted_peak_gib"] / memory["peak_gib"] - 1
    print(
        f"swav multi-crop, 2 ranks: peak {memory['peak_gib']:.3f} GiB measured, {memory['predicted_peak_gib']:.3f} "
        f"planned ({error:+.0%})"
    )
    assert abs(error) <= 0.25, memory
