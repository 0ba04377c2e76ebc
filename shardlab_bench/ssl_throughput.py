"""Images/s of SwAV against supervised training on the same trunk and world size, and against a bare SwAV loop, in one
run and one JSON.

    python -m shardlab_bench ssl_throughput --world-size 2 --steps 20 --warmup 5 --pairs 3 \\
        --out bench_ssl.json [overrides]

Three measurements, one after the other, each on ``--world-size`` local ranks under fully_sharded (CPU: gloo):
  swav        train.py on task=swav (default: 2 x 32 px + 4 x 16 px crops of the embedded images, regnet_cifar)
  supervised  train.py on task=image_classification with the same model.*, batch size and data.num_workers
  reference   a bare loop of the same method, written out here: the same trunk, heads and multi-crop dataset, FSDP2
              on the same units (each block resharded after forward but the last, the root not), shardlab's synced BN
              (torch's refuses CPU tensors), the same SwAV loss and LARS; a plain DataLoader with a DistributedSampler,
              no per-sample seeding, metrics, logging or stop-flag agreement. What it lacks is the framework's overhead.
Overrides (Hydra, as for shardlab.train) apply to the swav and reference runs; the model.* and data.num_workers ones
also to the supervised run. The JSON holds each run's images_per_s (global images per median step), median_step_ms
and load, and the ratios swav / supervised and 1 - swav / reference (the framework's overhead). ``--pairs N`` runs swav
and the bare loop N times, alternating, so that a machine's drift falls on both; the figures are those of the pair with
the median overhead, and ``pairs`` holds every pair's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from shardlab.distributed.cpu_allocator import configure_cpu_allocator, resolve_cpu_allocator
from shardlab.distributed.env import free_port, set_local_rank_defaults
from shardlab_bench import train as bench

SWAV = [
    "task=swav",
    "data.num_global_crops=2",
    "data.num_local_crops=4",
    "data.image_size=32",
    "data.local_crop_size=16",
]
SHARED_PREFIXES = ("model.", "data.num_workers=", "optimization.batch_size=")


def sharded_model(cfg) -> torch.nn.Module:
    """The SwAV model of ``cfg`` with synced BN, fully sharded per unit (the last unit and the root kept gathered after
    forward), its local shards filled from its seeded init plan."""
    from torch.distributed.fsdp import fully_shard

    from shardlab.distributed.sync_bn import convert_sync_batchnorm
    from shardlab_tasks.self_supervised import model as ssl_model

    with torch.device("meta"):
        model = convert_sync_batchnorm(ssl_model.build(cfg.model, cfg.task))
    units = ssl_model.fsdp_units(model)
    for i, unit in enumerate(units):
        fully_shard(unit, reshard_after_forward=i < len(units) - 1)
    fully_shard(model, reshard_after_forward=False)
    model.to_empty(device="cpu")
    plan, g = ssl_model.init_plan(model), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            full = torch.empty(tensor.shape, dtype=tensor.dtype)
            plan[name](full, g)
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local.copy_(full[tuple(slice(0, s) for s in local.shape)])  # any values of the right scale will do
    return model


def reference_rank(rank: int, world: int, port: int, cfg_yaml: str, opts: dict) -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    from shardlab.optim.lars import build_lars
    from shardlab_tasks.self_supervised.data import open_datasets
    from shardlab_tasks.self_supervised.swav import swav_loss
    from shardlab_tasks.self_supervised.task import normalize_prototypes

    cfg = OmegaConf.create(cfg_yaml)
    configure_cpu_allocator(resolve_cpu_allocator(cfg.distributed))  # as the shardlab run it is compared with
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t, o = cfg.task, cfg.optimization
    model = sharded_model(cfg)
    optimizer = build_lars(model, cfg.optimizer)
    train, _, _ = open_datasets(cfg.data)
    local_batch = o.batch_size // world
    loader = DataLoader(
        train,
        batch_size=local_batch,
        sampler=DistributedSampler(train, world, rank, shuffle=True, seed=0, drop_last=True),
        num_workers=cfg.data.num_workers,
        persistent_workers=cfg.data.num_workers > 0,
        drop_last=True,
    )
    ends, total = [time.perf_counter()], opts["warmup"] + opts["steps"]
    while len(ends) <= total:
        for crops, _, _ in loader:
            normalize_prototypes(model)
            _, scores, _ = model(crops)
            loss = swav_loss(scores, local_batch, list(t.crops_for_assign), t.temperature, t.epsilon,
                             t.sinkhorn_iterations, [None] * len(t.crops_for_assign))  # fmt: skip
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ends.append(time.perf_counter())
            if len(ends) > total:
                break
    step_ms = [1000 * (b - a) for a, b in zip(ends[opts["warmup"] : -1], ends[opts["warmup"] + 1 :], strict=True)]
    if rank == 0:
        median = statistics.median(step_ms)
        out = {
            "images_per_s": o.batch_size / (median / 1000),
            "median_step_ms": median,
            "step_ms": [round(s, 3) for s in step_ms],
            "final_loss": float(loss.detach()),
            "loadavg_1min_at_end": os.getloadavg()[0],
        }
        Path(opts["out"]).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_reference(overrides: list[str], world: int, opts: dict) -> dict:
    import torch.multiprocessing as mp

    from shardlab.cli.preflight import compose_config

    cfg = compose_config(["distributed=fully_sharded", f"distributed.world_size={world}", *overrides])
    set_local_rank_defaults(world)
    mp.start_processes(
        reference_rank,
        args=(world, free_port(), OmegaConf.to_yaml(cfg, resolve=True), opts),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return json.loads(Path(opts["out"]).read_text())


def summary(result: dict) -> dict:
    keep = ("images_per_s", "median_step_ms", "step_ms", "num_params", "batch_size", "overrides")
    return {**{k: result[k] for k in keep if k in result}, "loadavg_1min_at_end": result["env"]["loadavg_1min_at_end"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--pairs", type=int, default=1, help="swav and the bare loop this many times, alternating (machine drift)"
    )
    parser.add_argument("--out", default="bench_ssl.json")
    args, overrides = parser.parse_known_args(argv)
    world = args.world_size
    timing = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    swav_overrides = [*SWAV, *overrides]
    shared = [o for o in overrides if o.startswith(SHARED_PREFIXES)]
    layout = ["distributed=fully_sharded", f"distributed.world_size={world}"]
    with tempfile.TemporaryDirectory(prefix="bench-ssl-") as tmp:
        load_at_start = os.getloadavg()[0]
        pairs = []
        for k in range(args.pairs):
            swav = bench.main([*layout, *swav_overrides, *timing, "--out", f"{tmp}/swav{k}.json"])
            opts = {"steps": args.steps, "warmup": args.warmup, "out": f"{tmp}/reference{k}.json"}
            pairs.append((swav, run_reference(swav_overrides, world, opts)))
        supervised_overrides = ["task=image_classification", *shared]
        if not any(o.startswith("optimization.batch_size=") for o in shared):  # the task's default batch otherwise
            supervised_overrides.append(f"optimization.batch_size={swav['batch_size']}")
        supervised = bench.main([*layout, *supervised_overrides, *timing, "--out", f"{tmp}/supervised.json"])
    overheads = [1 - swav["images_per_s"] / reference["images_per_s"] for swav, reference in pairs]
    median = sorted(range(len(pairs)), key=overheads.__getitem__)[len(pairs) // 2]
    swav, reference = pairs[median]  # the pair with the median overhead
    out = {
        "tool": "bench_ssl",
        "world_size": world,
        "backend": "fully_sharded",
        "cpu_count": os.cpu_count(),
        "loadavg_1min_at_start": load_at_start,
        "swav": summary(swav),
        "supervised": summary(supervised),
        "reference": reference,
        "swav_over_supervised": swav["images_per_s"] / supervised["images_per_s"],
        "framework_overhead": overheads[median],
        "pairs": [
            {
                "swav_images_per_s": swav["images_per_s"],
                "reference_images_per_s": reference["images_per_s"],
                "framework_overhead": overhead,
            }
            for (swav, reference), overhead in zip(pairs, overheads, strict=True)
        ],  # fmt: skip
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"bench_ssl: swav {swav['images_per_s']:.1f} images/s, supervised {supervised['images_per_s']:.1f}, bare swav "
        f"loop {reference['images_per_s']:.1f} (framework overhead {100 * out['framework_overhead']:+.1f}%, the median "
        f"of {len(pairs)} interleaved pair(s): {', '.join(f'{100 * o:+.1f}%' for o in overheads)}); "
        f"wrote {args.out}",
        flush=True,
    )
    return out
