"""Activation checkpointing's memory against its recompute time: each distributed.activation_checkpointing mode on
each model, one process per run, on this machine (docs/memory-plan.md's table).

    python -m shardlab_bench activation_checkpointing --repeats 1 --out docs/bench/checkpointing.json  # ~15 min
    python -m shardlab_bench activation_checkpointing --models gpt_small --modes none,full --repeats 1 --steps 3

Every run trains the LM single-process (fresh process: no run warms another's kernels or pages) for --warmup untimed
and --steps timed steps, with distributed.cpu_allocator=lean so resident memory tracks what is live. It records the
trainer's own memory report (peak resident memory above the process's start, the plan's prediction for the same
run) and, per timed step (optimizer step to optimizer step), the wall time and the CPU time of the process (all its
threads): on a machine whose cores other jobs share, the CPU time is the work a step did, the wall time mostly the
wait for a core. The modes of one repeat run in order, the repeats alternate the order (a drift in the machine's load
favours no mode); the summary keeps each mode's best (lowest) median step and its lowest peak. Recompute cost = a
mode's best median CPU time per step / none's - 1. Arguments without a leading ``--`` are Hydra overrides added to
every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from shardlab_bench import child_env, command, provenance

MODES = ["none", "selective_layer", "selective_op", "full"]
MODELS = ["gpt_small", "llama_small"]
SHAPE = ["optimization.batch_size=4", "data.seq_len=256"]  # ~1,000 tokens a step: minutes per model on 2 cores


def run_one(model: str, mode: str, steps: int, warmup: int, overrides: list[str]) -> dict:
    """One training run in this process (the child's side): its memory report and step times."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from shardlab.cli.preflight import compose_config
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        cfg = compose_config(
            [
                "task=lm",
                f"model={model}",
                *SHAPE,
                f"distributed.activation_checkpointing={mode}",
                "distributed.cpu_allocator=lean",
                f"optimization.max_steps={warmup + steps}",
                "lr_scheduler.warmup_steps=0",
                "logging.interval_steps=1",
                "logging.progress_bar=false",
                "logging.tensorboard=false",
                "validation.interval_steps=0",
                "validation.num_batches=1",
                "checkpoint.save=false",
                *overrides,
            ]
        )
        marks: list[tuple[float, float]] = []  # (wall, this process's CPU seconds) at each optimizer step's end
        hook = register_optimizer_step_post_hook(lambda *_: marks.append((time.perf_counter(), time.process_time())))
        try:
            result = run_rank(cfg, Path(tmp), dist_env.detect())
        finally:
            hook.remove()
    train = [r for r in result["history"] if r["split"] == "train"]
    timed = [r["ms_per_step"] for r in train[warmup:]]
    # timed step j lasts from step j-1's optimizer step to its own (--warmup >= 1 gives the first one a start)
    cpu_ms = [1000 * (b[1] - a[1]) for a, b in zip(marks[warmup - 1 : -1], marks[warmup:], strict=True)]
    return {
        "median_step_ms": statistics.median(timed),
        "step_ms": timed,
        "median_step_cpu_ms": statistics.median(cpu_ms),
        "step_cpu_ms": cpu_ms,
        "peak_gib": result["memory"]["peak_gib"],
        "predicted_peak_gib": result["memory"]["predicted_peak_gib"],
        "losses": [r["loss"] for r in train],
    }


def spawn(model: str, mode: str, args: argparse.Namespace, overrides: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = command("activation_checkpointing", "--child", model, mode, "--steps", str(args.steps))
        cmd += ["--warmup", str(args.warmup), "--out", out.name, *overrides]
        load = os.getloadavg()[0]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=child_env())
        return {**json.loads(Path(out.name).read_text()), "loadavg_1min_before": load}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=2, help="runs per model and mode (the best is kept)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--out", default="bench_checkpointing.json")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.child:
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        result = run_one(*args.child, args.steps, args.warmup, overrides)
        Path(args.out).write_text(json.dumps(result))
        return result
    models, modes = args.models.split(","), args.modes.split(",")
    if any(m not in MODES for m in modes) or "none" not in modes or args.repeats < 1 or args.warmup < 1:
        parser.error(f"--modes: a comma-separated subset of {', '.join(MODES)} holding none; --repeats, --warmup >= 1")
    settings = {"models": models, "modes": modes, "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup}
    meta = provenance.collect(__file__, argv, settings)
    summary: dict = {"meta": meta, "tool": "bench_checkpointing", "shape": SHAPE, "extra_overrides": overrides}
    summary["models"] = {}
    for model in models:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                run = spawn(model, mode, args, overrides)
                runs[mode].append(run)
                print(
                    f"{model} {mode}: {run['median_step_ms']:.0f} ms/step ({run['median_step_cpu_ms']:.0f} CPU), "
                    f"peak {run['peak_gib']:.3f} GiB "
                    f"(plan {run['predicted_peak_gib']:.3f}); load {run['loadavg_1min_before']:.1f}",
                    flush=True,
                )
        best = {m: min(runs[m], key=lambda run: run["median_step_cpu_ms"]) for m in modes}
        summary["models"][model] = {
            mode: {
                "best_step_ms": min(run["median_step_ms"] for run in runs[mode]),
                "best_step_cpu_ms": best[mode]["median_step_cpu_ms"],
                "recompute_cost": best[mode]["median_step_cpu_ms"] / best["none"]["median_step_cpu_ms"] - 1,
                "peak_gib": min(run["peak_gib"] for run in runs[mode]),
                "predicted_peak_gib": best[mode]["predicted_peak_gib"],
                "same_losses_as_none": all(run["losses"] == runs["none"][0]["losses"] for run in runs[mode]),
                "runs": runs[mode],
            }
            for mode in modes
        }
        summary["meta"] = provenance.finish(meta)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")  # partial results survive a stop
    print(f"bench_checkpointing: wrote {args.out}", flush=True)
    return summary
