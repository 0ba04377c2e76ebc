"""Pipeline rank 0's training step on a device's real tensors beside the same step on fake tensors and the plan: that
the CPU's count (shardlab.memory.stage_step, which distributed.verify_plan holds the plan to) is what a device holds.

    python -m shardlab_bench stage_step --storage cuda --out stage_step.json [OVERRIDES ...]

tools/gpu_check.sh memory runs it on a lent GPU. Both steps run on torch's fake process group (one process stands for
rank 0 of the layout; collectives leave their outputs unwritten, so values mean nothing), through the stages and
schedule training builds. The JSON holds, per storage, the step's peak of live tensor bytes (LiveBytes) and, on
CUDA, the caching allocator's peak of allocated bytes over the measured step (torch.cuda.max_memory_allocated), with
the plan of rank 0 (its peak without the allocator's term). Default layout: Llama 3.1 8B at FSDP 4 x TP 2 x PP 2 (16
ranks, 1F1B, 4 micro-batches of one 8192-token sequence, bf16, activation checkpointing of the blocks), whose rank 0
holds ~20 GiB: one H100 runs it in seconds (``--storage cpu`` would allocate those 20 GiB in host memory: give a
smaller layout's overrides). On CPU the real tensors' count equals the fake one to the byte
(tests/unit/test_stage_step.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from shardlab_bench.plan_axes import keys
from shardlab_bench.provenance import collect, finish

DEFAULT = keys("llama3_8b", 16, 4, 4, tp=2, pp=2)
"""shardlab_bench.plan_axes' keys for the default layout (plan_device h100_80gb, sequence 8192, bf16, full AC)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", choices=("fake", "cpu", "cuda"), default="cuda",
                        help="where the real step's tensors live (fake: the fake step only)")  # fmt: skip
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("overrides", nargs="*", help="the layout's config overrides (default: Llama 3.1 8B, 3D)")
    args = parser.parse_args(argv)
    meta = collect(__file__, argv)
    from shardlab.cli.preflight import compose_config
    from shardlab.memory.layout import layout_of
    from shardlab.memory.stage_step import measure_stage_step
    from shardlab.runner import build_task

    overrides = args.overrides or DEFAULT
    cfg = compose_config(overrides)
    world = cfg.distributed.world_size
    task = build_task(cfg, world_size=world)
    layout = layout_of(cfg.distributed, world)
    results = {"tool": "stage_step", "overrides": overrides, "label": layout.label(world), "steps": {}}
    for storage in dict.fromkeys(("fake", args.storage)):
        step = measure_stage_step(cfg, task, world, storage=storage)
        results["steps"][storage] = {"not_run": step} if isinstance(step, str) else dataclasses.asdict(step)
    # the plan of rank 0, as each step that ran reports it (the same layout: the same figure)
    results["plan_rank0_bytes"] = next((s["planned"] for s in results["steps"].values() if "planned" in s), None)
    results["meta"] = finish(meta)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    gib = 2**30
    planned = results["plan_rank0_bytes"]
    said = [f"plan of rank 0 {planned / gib:.2f} GiB" if planned is not None else "no step ran, no plan of rank 0"]
    for storage, step in results["steps"].items():
        if "not_run" in step:
            said.append(f"{storage}: not run ({step['not_run']})")
        else:
            device = f", allocator {step['device_peak'] / gib:.2f}" if step["device_peak"] is not None else ""
            said.append(f"{storage}: peak {step['peak'] / gib:.2f} GiB{device} in {step['seconds']:.1f} s")
    print(f"wrote {args.out}: {layout.label(world)}; " + "; ".join(said))
    return 1 if any("not_run" in step for step in results["steps"].values()) else 0
