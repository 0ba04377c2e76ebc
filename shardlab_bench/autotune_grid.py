"""Is distributed.backend=auto's measured choice as fast as the best hand choice? One JSON that says.

    python -m shardlab_bench autotune_grid model=gpt_small distributed.world_size=2 distributed.memory_budget_gb=4 \\
        --steps 6 --warmup 2 --out autotune_grid.json

For the overrides given (a model, a world size, a budget), it
1. lists every layout the memory plan predicts to fit the budget, each at every split of the configured global batch
   that fits (the configured one, twice the micro-batch with half the accumulation, and the reverse): the grid;
2. measures each grid point with train.py (its own processes, ``--steps`` timed steps after ``--warmup``);
3. runs ``python -m shardlab.train ... distributed.backend=auto`` for one step (no cache, a fresh run directory) and
   reads its decision and its tuning time from the run's status.json;
4. reports the tuned choice's grid throughput against the grid's best (``tuned_vs_best``, 1.0 = the best) and the
   tuning time as a fraction of a 300-step run at the best point's step time (``tuning_fraction_of_300_steps``).
Every command it runs is in the JSON. Grid points are measured in the order listed, ``--rounds`` times interleaved
(round 1 of every point, then round 2, ...), and each point's median is compared.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardlab_bench import child_env, command, provenance

REPO = Path(__file__).resolve().parent.parent


def grid(overrides: list[str]) -> tuple[list[dict], dict]:
    """Every (layout, split) the plan predicts to fit: the overrides that select it and its predicted peak."""
    from shardlab import runner
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory.budget import fitting, sharded_only
    from shardlab.memory.devices import GiB
    from shardlab.memory.plan import profile_config
    from shardlab.runner.autotune import _splits

    cfg = compose_config([*overrides, "distributed.backend=auto"])
    task = runner.build_task(cfg, check_budget=False)
    world = cfg.distributed.world_size
    o = cfg.optimization
    model = model_on_meta(task)  # one meta model for every split: profiling casts it and puts it back
    points = []
    for batch, accumulate in [(o.batch_size, o.update_freq), *_splits(o.batch_size, o.update_freq, world)]:
        trial = copy.deepcopy(cfg)
        trial.optimization.batch_size = batch
        profile, ctx = profile_config(trial, task, world, model)
        try:
            fits = fitting(profile, trial, ctx, sharded_only(cfg.distributed))
        except Exception:  # noqa: BLE001  (nothing fits at this split)
            continue
        for choice in fits:
            layout = {f"distributed.{k}": v for k, v in choice.layout.overrides(world).items()}
            if choice.layout.cpu_offload and cfg.optimizer.name == "adamw":
                layout["optimizer"] = "cpu_adam"
            points.append(
                {
                    "layout": choice.layout.label(world),
                    "micro_batch": batch,
                    "update_freq": accumulate,
                    "overrides": {**layout, "optimization.batch_size": batch, "optimization.update_freq": accumulate},
                    "predicted_peak_gib": round(choice.estimate.peak / GiB, 3),
                }
            )
    return points, {"unit": task.unit, "world_size": world}


def as_args(overrides: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]


def bench(base: list[str], point: dict, steps: int, warmup: int, scratch: Path, unit: str) -> tuple[dict, list[str]]:
    out = scratch / "bench.json"
    cmd = command("train", *base, *as_args(point["overrides"]))
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=child_env())
    result = json.loads(out.read_text())
    return {"per_s": result[f"{unit}_per_s"], "step_ms": result["median_step_ms"]}, cmd


def tuned(base: list[str], scratch: Path) -> tuple[dict, list[str]]:
    run_dir = scratch / "tuned"
    cmd = [
        sys.executable,
        "-m",
        "shardlab.train",
        *base,
        "distributed.backend=auto",
        "distributed.auto_tune_cache=null",
    ]
    cmd += ["optimization.max_steps=1", "lr_scheduler.warmup_steps=0", "validation.num_batches=1"]
    cmd += ["checkpoint.save=false", "logging.tensorboard=false", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads((run_dir / "status.json").read_text())["autotune"], cmd


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved measurements of every grid point")
    parser.add_argument("--out", default="autotune_grid.json")
    args, base = parser.parse_known_args(argv)
    settings = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "overrides": base}
    meta = provenance.collect(__file__, argv, settings)
    points, info = grid(base)
    unit = info["unit"]
    commands: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="shardlab-grid-") as tmp:
        scratch = Path(tmp)
        for _ in range(args.rounds):
            for point in points:
                measured, cmd = bench(base, point, args.steps, args.warmup, scratch, unit)
                point.setdefault("runs", []).append(measured)
                commands.append(cmd)
                split = f"{point['micro_batch']} x {point['update_freq']}"
                print(f"{point['layout']:<40} {split:>9} {measured['per_s']:10.1f} {unit}/s", flush=True)
        decision, cmd = tuned(base, scratch)
        commands.append(cmd)
    for point in points:
        point[f"{unit}_per_s"] = statistics.median(r["per_s"] for r in point["runs"])
        point["step_ms"] = statistics.median(r["step_ms"] for r in point["runs"])
    best = max(points, key=lambda p: p[f"{unit}_per_s"])
    chosen = next(p for p in points if _same(p, decision))
    run_300_s = 300 * chosen["step_ms"] / 1000  # the run that follows the tuning, at the chosen point's speed
    result = {
        "meta": provenance.finish(meta),
        "overrides": base,
        "grid": points,
        "best": {k: best[k] for k in ("layout", "micro_batch", "update_freq", f"{unit}_per_s")},
        "tuned": {"label": decision["label"], "choice": decision["choice"], "trials": decision["trials"]},
        "tuned_grid_throughput": chosen[f"{unit}_per_s"],
        "tuned_vs_best": round(chosen[f"{unit}_per_s"] / best[f"{unit}_per_s"], 4),
        "tuning_s": decision["tuning_s"],
        "tuning_fraction_of_300_steps": round(decision["tuning_s"] / run_300_s, 4),
        "commands": [" ".join(c) for c in commands],
        **info,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"tuned: {decision['label']} at {chosen[f'{unit}_per_s']:.1f} {unit}/s; best of the grid: {best['layout']}, "
        f"{best['micro_batch']} x {best['update_freq']} at {best[f'{unit}_per_s']:.1f} "
        f"(tuned / best {result['tuned_vs_best']:.3f}); "
        f"tuning {decision['tuning_s']:.1f} s = {result['tuning_fraction_of_300_steps']:.1%} of a 300-step run"
    )


def _same(point: dict, decision: dict) -> bool:
    """Whether a grid point is the tuned choice (same layout keys and split; optimizer names may differ)."""
    keys = [k for k in decision["choice"] if k != "optimizer.name"]
    return all(point["overrides"].get(k) == decision["choice"][k] for k in keys if k in point["overrides"])
