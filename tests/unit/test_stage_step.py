"""Pipeline rank 0's training step on fake tensors (shardlab.memory.stage_step), and the pipeline as training builds
it, seen on torch's fake process group: the blocks every stage recomputes under distributed.ac_skip_units and
ac_every_k_units are counted over the whole model's units, as the memory plan counts them; the step runs through
torch's schedule with the stage boundary split by sequence under TP (the stages' static shapes say so, and torch
checks every output against them); and the plan of rank 0 holds at least what the step held, and not much more."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from shardlab.memory.stage_step import LiveBytes, fake_rank_pipeline, measure_stage_step
from tests.unit.test_memory_axes import tiny_task

LLAMA = ["model=llama_tiny", "model.num_kv_heads=2", "model.ffn_dim=null", "distributed=fully_sharded"]
FSDP2_TP2_PP2 = [*LLAMA, "distributed.world_size=8", "distributed.sharding_degree=2",
                 "distributed.tensor_parallel_degree=2", "distributed.pipeline_parallel_degree=2",
                 "optimization.batch_size=8", "optimization.update_freq=2", "validation.batch_size=16",
                 "distributed.activation_checkpointing=full", "distributed.ac_skip_units=[0,-1]"]  # fmt: skip
INTERLEAVED_BF16 = [*LLAMA, "distributed.world_size=4", "distributed.pipeline_parallel_degree=2",
                    "distributed.pipeline_schedule=interleaved_1f1b", "distributed.pipeline_stages_per_rank=2",
                    "optimization.batch_size=8", "optimization.update_freq=4", "validation.batch_size=32",
                    "distributed.precision=bf16"]  # fmt: skip


def test_live_bytes_counts_each_storage_once_until_it_is_freed():
    with LiveBytes() as live:
        kept = torch.zeros(256)  # 1 KiB
        view = kept.view(16, 16)  # the same storage
        gone = torch.zeros(512)  # 2 KiB, freed below
        del gone
        torch.zeros(128)  # 512 bytes, freed at once
    assert view.data_ptr() == kept.data_ptr()
    assert (live.peak, live.now) == (1024 + 2048, 1024)


def recomputing_blocks(overrides: list[str], world: int) -> list[list[str]]:
    """Per pipeline rank, the units of its stages that activation checkpointing wrapped."""
    cfg, task = tiny_task(overrides, world)
    wrapped = []
    for rank in range(0, world, world // cfg.distributed.pipeline_parallel_degree):  # pp is the outermost axis
        with fake_rank_pipeline(cfg, task, world, rank) as pipeline:
            wrapped.append(sorted(
                f"{name}" for stage in pipeline.stage_modules for name, module in stage.named_modules()
                if isinstance(module, CheckpointWrapper)
            ))  # fmt: skip
    return wrapped


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # every block of the four, on both stages: the embedding (unit 0) and the head (unit -1) never
        ([], [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]),
        # every 2nd block counted over the model's blocks, not restarted on each stage
        (["distributed.activation_checkpointing=selective_layer", "distributed.ac_every_k_units=2"],
         [["blocks.1"], ["blocks.3"]]),
    ],
)  # fmt: skip
def test_activation_checkpointing_under_a_pipeline_counts_the_whole_models_units(mode, expected):
    """Each stage is parallelized alone, over its own units; ac_skip_units=[0,-1] still means the model's embedding
    and head (a stage-relative count left each stage's last block unrecomputed: 7 of 16 GiB more on the first stage
    of Llama 3.1 405B at FSDP 8 x TP 8 x PP 8, its 8 micro-batches in flight)."""
    assert recomputing_blocks([*FSDP2_TP2_PP2, *mode], 8) == expected


@pytest.mark.parametrize("overrides", [FSDP2_TP2_PP2, INTERLEAVED_BF16], ids=["fsdp2_tp2_pp2", "interleaved_bf16"])
def test_pipeline_rank_0s_step_on_fake_tensors_holds_what_its_plan_says(overrides):
    """Torch's schedule runs rank 0's stages two steps on fake tensors (the second measured); the plan of that rank
    (its state, gathered units, unsharded gradients and activations) is not below the step's peak of live bytes, nor
    a quarter above it. Under TP the stage boundary is the sequence's 1/tp slice: torch checks each stage's output
    against the static shapes the measurement gives it."""
    from shardlab.memory.estimate import estimate
    from shardlab.memory.layout import layout_of
    from shardlab.memory.plan import profile_config
    from shardlab.runner import build_task
    from tests.conftest import compose_config

    cfg = compose_config(overrides)
    world = cfg.distributed.world_size
    task = build_task(cfg, world_size=world)
    step = measure_stage_step(cfg, task, world)
    assert not isinstance(step, str), step
    from shardlab.distributed.units import model_on_meta

    profile, ctx = profile_config(cfg, task, world, model_on_meta(task))
    planned = estimate(profile, layout_of(cfg.distributed, world), ctx).axes.rank_peaks[0]
    assert step.stages == ((0,) if cfg.distributed.pipeline_stages_per_rank == 1 else (0, 2))
    assert 0 < step.state < step.peak <= planned < 1.25 * step.peak, (step, planned)
    assert step.planned == planned  # what verify_plan and the benchmarks hold the step to


def test_verify_plan_reports_the_fake_step_and_says_why_when_it_cannot_run():
    from shardlab.memory.verify import verify_plan
    from tests.unit.test_memory_axes import TINY_3D, colwise_rowwise_plan

    cfg, task = tiny_task(TINY_3D)
    lines = verify_plan(cfg, task, 16)
    assert len(lines) == 2 and "pipeline rank 0's step (stages 0) through torch's schedule" in lines[1], lines
    assert "the plan's rank 0" in lines[1]
    # a plan without sequence parallelism hands the whole sequence across stages: not the shapes the step is given
    task.tensor_parallel_plan = colwise_rowwise_plan
    lines = verify_plan(cfg, task, 16)
    assert "not run: the step failed on fake tensors" in lines[1], lines


def test_real_tensors_hold_what_the_fake_step_counted_to_the_byte(tmp_path):
    """shardlab_bench stage_step runs rank 0's step on fake tensors and on a device's real ones (on a GPU:
    tools/gpu_check.sh memory, beside the CUDA allocator's peak); on CPU the two counts are the same bytes, so the
    fake step measures the storages a run makes, not an artifact of fake tensors."""
    import json

    from shardlab_bench import stage_step

    out = tmp_path / "stage_step.json"
    assert stage_step.main(["--storage", "cpu", "--out", str(out), *FSDP2_TP2_PP2]) == 0
    result = json.loads(out.read_text())
    fake, real = result["steps"]["fake"], result["steps"]["cpu"]
    assert fake["peak"] == real["peak"] and fake["state"] == real["state"] and real["device_peak"] is None
    assert fake["peak"] <= result["plan_rank0_bytes"] and result["label"].startswith("FSDP 2 x TP 2 x PP 2 (1f1b)")
