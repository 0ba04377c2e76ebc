"""The memory plan of layouts with tensor and pipeline axes: torchtitan's published 2D and 3D Llama 3.1 runs planned
with their settings, and the table docs/distributed.md's "Choosing a layout" shows for 8B, 70B and 405B on H100s.

    python -m shardlab_bench plan_axes --out docs/bench/plan_axes.json

Nothing is measured: the published figures are typed below with their source (file, commit, table, row), and every
plan is a dry run on the meta device (seconds each, on any machine). The published figure is torchtitan's `memory:`,
the CUDA caching allocator's peak *reserved* bytes, the maximum over ranks; the plan's figure beside it is its
allocated peak plus its allocator term (rounding and the fragmentation allowance), without the CUDA context and
NCCL's buffers, which live outside the allocator (as plan_vs_published.py compares its FSDP runs).

How the published runs map onto shardlab's keys (torchtitan 9dec370, train_configs/llama3_{70b,405b}.toml and
torchtitan/parallelisms/pipeline_llama.py there):
- local batch: optimization.batch_size is the global micro-batch, so batch_size = local batch x data-parallel ranks
  without PP; with PP torchtitan splits the local batch into pipeline_parallel_microbatches (default: the pipeline
  degree, 8), which in shardlab are optimization.update_freq micro-batches of batch_size / data ranks each
  (32 = 8 x 4 sequences);
- full activation checkpointing of the transformer blocks only (distributed.ac_skip_units=[0,-1]); under PP no
  resharding after forward (distributed.reshard_after_forward=false), as torchtitan's apply_fsdp does;
- bf16 parameters and fp32 gradient reduction; AdamW; sequence 8192; interleaved 1F1B with 2 stages per rank
  (torchtitan's default for a looped schedule without split points);
- float8 linears with fp8 all-gather and torch.compile of each block: not modelled. Under full AC they touch the one
  block being recomputed (compile fuses it; float8 saves fp8 casts in place of some bf16 inputs), and fp8 all-gather
  would halve the gathered linear weights, which PP keeps for the whole step: all lower memory, so the plan of the
  bf16 eager run is an upper bound of what they change. AsyncTP's symmetric-memory buffers live outside the
  caching allocator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from shardlab_bench.provenance import collect, finish

REPO = Path(__file__).resolve().parent.parent

TITAN = "https://github.com/pytorch/torchtitan/blob"
DEC_2024 = "31a17bfdb70bab6f62a13d21816a5339b911d6e3"  # benchmarks/llama3_h100_202412_torchtitan.md as stored
H100_FILE = "benchmarks/llama3_h100_202412_torchtitan.md"
RUN = (
    "torch 1963fc8 (2024-12-23), torchao eab345c, torchtitan 9dec370 (2024-12-26): seq_len 8192, AdamW, bf16 params / "
    "fp32 reduce, full AC, torch.compile, float8 linears with fp8 all-gather; H100 SXM 96 GB HBM2e at 500 W"
)
COMMON = [
    "distributed=fully_sharded", "distributed.plan_device=h100_80gb", "data.seq_len=8192", "model.max_seq_len=8192",
    "distributed.precision=bf16",
]  # fmt: skip
FULL_AC = ["distributed.activation_checkpointing=full", "distributed.ac_skip_units=[0,-1]"]


def keys(model: str, world: int, batch: int, update_freq: int = 1, tp: int = 1, pp: int = 1, schedule: str = "1f1b",
         stages: int = 1, ac: list[str] = FULL_AC) -> list[str]:  # fmt: skip
    """The shardlab overrides of one planned run (``batch``: optimization.batch_size, the global micro-batch)."""
    return [
        f"model={model}", *COMMON, f"distributed.world_size={world}", f"optimization.batch_size={batch}",
        f"validation.batch_size={batch * update_freq}", f"optimization.update_freq={update_freq}",
        f"distributed.tensor_parallel_degree={tp}", f"distributed.pipeline_parallel_degree={pp}",
        f"distributed.pipeline_schedule={schedule}", f"distributed.pipeline_stages_per_rank={stages}", *ac,
    ]  # fmt: skip


def published(key: str, table: str, row: str, gib: float, model: str, overrides: list[str]) -> dict[str, Any]:
    return {
        "key": key,
        "source": {
            "url": f"{TITAN}/{DEC_2024}/{H100_FILE}",
            "repo": "pytorch/torchtitan",
            "file": H100_FILE,
            "commit": DEC_2024,
            "table": table,
            "row": row,
            "run": RUN,
        },  # fmt: skip
        "published_gib": gib,
        "model": model,
        "overrides": overrides,
    }


NO_RESHARD = ["distributed.reshard_after_forward=false"]
"""torchtitan turns resharding after forward off under PP (parallelize_llama.py's apply_fsdp at 9dec370)."""
T4 = "Table 4: 2D (FSDP 32, TP 8) + torch.compile + Float8, Llama 3.1 70B, 256 GPUs, local batch 16, full AC"
T5 = "Table 5: 3D (FSDP 8, TP 8, PP 8) + torch.compile + Float8 + AsyncTP, Llama 3.1 405B, 512 GPUs, local batch 32"
PUBLISHED = [
    published("70b_2d", T4, "2D", 71.9, "Llama 3.1 70B", keys("llama3_70b", 256, 16 * 32, tp=8)),
    published("405b_1f1b", T5, "1F1B", 82.5, "Llama 3.1 405B",
              [*keys("llama3_405b", 512, 4 * 8, 8, tp=8, pp=8), *NO_RESHARD]),
    published("405b_interleaved", T5, "Interleaved 1F1B", 72.7, "Llama 3.1 405B",
              [*keys("llama3_405b", 512, 4 * 8, 8, tp=8, pp=8, schedule="interleaved_1f1b", stages=2), *NO_RESHARD]),
]  # fmt: skip

SELECTIVE = ["distributed.activation_checkpointing=selective_op", "distributed.ac_matmul_save_every=2",
             "distributed.ac_skip_units=[0,-1]"]  # fmt: skip
CHOICES = [
    # Llama 3.1 8B on one machine of 8 H100s, 16 sequences of 8192 per step
    ("Llama 3.1 8B", keys("llama3_8b", 8, 16, ac=SELECTIVE)),
    ("Llama 3.1 8B", keys("llama3_8b", 8, 16, tp=2, ac=SELECTIVE)),
    ("Llama 3.1 8B", keys("llama3_8b", 8, 4, 4, pp=2, ac=SELECTIVE)),
    # Llama 3.1 70B on 256 H100s, 512 sequences per step
    ("Llama 3.1 70B", keys("llama3_70b", 256, 512)),
    ("Llama 3.1 70B", keys("llama3_70b", 256, 512, tp=4)),
    ("Llama 3.1 70B", keys("llama3_70b", 256, 512, tp=8)),
    ("Llama 3.1 70B", keys("llama3_70b", 256, 128, 4, tp=4, pp=2)),
    # Llama 3.1 405B on 512 H100s, 256 sequences per step
    ("Llama 3.1 405B", keys("llama3_405b", 512, 256, tp=8)),
    ("Llama 3.1 405B", keys("llama3_405b", 512, 64, 4, tp=8, pp=4)),
    ("Llama 3.1 405B", keys("llama3_405b", 512, 32, 8, tp=8, pp=8)),
    ("Llama 3.1 405B", keys("llama3_405b", 512, 32, 8, tp=8, pp=8, schedule="interleaved_1f1b", stages=2)),
]
"""The layouts docs/distributed.md compares: (model, shardlab overrides)."""


def plan(overrides: list[str], split: str = "shardlab") -> dict[str, Any]:
    """What dry_run plans for ``overrides`` (``split``: whose cut of the layers into stages): the fullest rank's
    figures, its axes, and the layout's label."""
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory.estimate import estimate
    from shardlab.memory.layout import layout_of
    from shardlab.memory.plan import profile_config
    from shardlab.runner import build_task

    cfg = compose_config(overrides)
    world = cfg.distributed.world_size
    task = build_task(cfg, world_size=world)
    profile, ctx = profile_config(cfg, task, world, model_on_meta(task))
    # torchtitan's published runs split the layers as torchtitan does (the middle stages taking the remainder), their
    # schedule kept the last stage's outputs (torch's step with return_outputs on, which shardlab turns off), and
    # their embedding was torch's RowwiseParallel, whose gradient is the whole vocabulary on each TP rank
    torchtitan = split == "torchtitan"
    layout = dataclasses.replace(
        layout_of(cfg.distributed, world), stage_split=split, last_stage_outputs_kept=torchtitan,
        embedding_gradient_whole=torchtitan,
    )  # fmt: skip
    est = estimate(profile, layout, ctx)
    axes = est.axes
    return {
        "label": layout.label(world), "world_size": world, "samples_per_microbatch": profile.local_batch,
        "microbatches": cfg.optimization.update_freq, "peak_bytes": est.peak, "allocator_bytes": est.allocator,
        "reserved_bytes": est.peak + est.allocator, "device_bytes": est.device_peak, "capacity_bytes": ctx.capacity,
        "state_bytes": est.state, "gathered_bytes": est.gathered, "activation_bytes": est.activations or 0,
        "fullest_pipeline_rank": axes.rank if axes else 0, "in_flight": axes.in_flight if axes else 1,
        "bubble": axes.bubble if axes else 0.0, "traffic_bytes": axes.traffic if axes else {"fsdp": est.comm_bytes},
    }  # fmt: skip


def verify(overrides: list[str]) -> dict[str, Any]:
    """distributed.verify_plan of a layout, timed from the composed config (the model on meta, the mesh and
    fully_shard on the fake process group, seen from the first and the last rank)."""
    import time

    from shardlab.cli.preflight import compose_config
    from shardlab.memory.verify import verify_plan
    from shardlab.runner import build_task

    cfg = compose_config(overrides)
    world = cfg.distributed.world_size
    started = time.perf_counter()
    lines = verify_plan(cfg, build_task(cfg, world_size=world), world)
    return {"overrides": overrides, "seconds": round(time.perf_counter() - started, 1), "line": lines[0],
            "lines": lines}  # fmt: skip


def measured_step(overrides: list[str]) -> dict[str, Any]:
    """Pipeline rank 0's step of a layout on fake tensors (shardlab.memory.stage_step: shardlab's own build of that
    rank, through torch's schedule, on the fake process group), beside the plan of that rank as shardlab runs it
    (shardlab's cut of the layers)."""
    from shardlab.cli.preflight import compose_config
    from shardlab.memory.layout import layout_of
    from shardlab.memory.stage_step import measure_stage_step
    from shardlab.runner import build_task

    cfg = compose_config(overrides)
    world = cfg.distributed.world_size
    step = measure_stage_step(cfg, build_task(cfg, world_size=world), world)
    if isinstance(step, str):
        raise RuntimeError(f"pipeline rank 0's step on fake tensors did not run: {step}")
    return {
        "overrides": overrides, "label": layout_of(cfg.distributed, world).label(world), "stages": list(step.stages),
        "peak_bytes": step.peak, "state_bytes": step.state, "plan_rank0_bytes": step.planned, "ops": step.ops,
        "seconds": round(step.seconds, 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    meta = collect(__file__, argv)
    results = {
        "tool": "plan_axes",
        "published": [{**p, "plan": plan(p["overrides"], "torchtitan")} for p in PUBLISHED],
        "choices": [{"model": model, "overrides": o, "plan": plan(o)} for model, o in CHOICES],
        "verify": verify(PUBLISHED[1]["overrides"]),
        "measured_steps": [measured_step(p["overrides"]) for p in PUBLISHED
                           if "distributed.pipeline_parallel_degree=1" not in p["overrides"]],
    }  # fmt: skip
    results["meta"] = finish(meta)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"wrote {args.out}: {len(PUBLISHED)} published runs, {len(CHOICES)} layouts in {results['meta']['seconds']} s"
    )
    return 0
