"""Compare how long synchronous and asynchronous checkpoint saves block training, and their peak memory.

    python -m shardlab_bench checkpoint --models gpt_small,gpt_125m --saves 3 --out bench_checkpoint.json

Each (model, mode) trains in a fresh process (so the peak RSS, VmHWM, is its own) on a short sequence and small batch,
saving every ``--interval`` steps into a temporary run directory. Per save: the time training waited (``blocked_s``:
sync, the whole write; async, staging into CPU memory plus any wait for the previous save) and the time until the
checkpoint had its final name (``total_s``). The last save of a run is reported apart: at exit the run waits for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from shardlab_bench import child_env, command
from shardlab_bench.provenance import collect, finish

REPO = Path(__file__).resolve().parents[1]


def peak_rss_gib() -> float:
    """The process's peak resident set size (VmHWM), as if the trainer's meter had not reset it every step."""
    import torch

    from shardlab.memory.meter import process_peak

    return process_peak(torch.device("cpu")) / 2**30


def one(model: str, mode: str, saves: int, interval: int, batch: int, seq_len: int, run_dir: Path) -> dict:
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    overrides = [
        f"model={model}",
        f"data.seq_len={seq_len}",
        f"optimization.batch_size={batch}",
        f"optimization.max_steps={saves * interval}",
        "lr_scheduler.warmup_steps=0",
        f"checkpoint.interval_steps={interval}",
        "checkpoint.keep_last=1",
        f"checkpoint.async_save={mode == 'async'}",
        "validation.interval_steps=0",
        "validation.num_batches=1",
        f"validation.batch_size={batch}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"logging.interval_steps={interval}",
    ]
    cfg = compose_config(overrides)
    result = run_rank(cfg, run_dir, dist_env.detect(), after_fit=lambda t: {"records": t.checkpointer.records})
    records = [r.__dict__ for r in result["records"]]
    during = records[:-1]
    train = [r for r in result["history"] if r["split"] == "train"]
    return {
        "model": model,
        "mode": mode,
        "saves": records,
        "blocked_s_median": statistics.median(r["blocked_s"] for r in during) if during else None,
        "total_s_median": statistics.median(r["total_s"] for r in during) if during else None,
        "final_save_blocked_s": records[-1]["blocked_s"],
        "ms_per_step": train[-1]["ms_per_step"] if train else None,
        "losses": [r["loss"] for r in train],
        "peak_rss_gib": round(peak_rss_gib(), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt_small,gpt_125m")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--interval", type=int, default=2, help="steps between saves")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # the child: one measurement, JSON on the last line
        r = one(*args.one, args.saves, args.interval, args.batch_size, args.seq_len, args.run_dir)
        print(json.dumps(r))
        return r
    meta = collect(__file__, argv, settings=vars(args) | {"out": str(args.out)})
    runs = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
                cmd = command("checkpoint", "--one", model, mode, "--run-dir", tmp)
                cmd += ["--saves", str(args.saves), "--interval", str(args.interval)]
                cmd += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
                out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=child_env())
                if out.returncode != 0:
                    raise SystemExit(f"{model} {mode} failed:\n{out.stderr[-3000:]}")
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = runs[-1]
                print(
                    f"{model} {mode}: blocked {r['blocked_s_median']:.3f} s, peak RSS {r['peak_rss_gib']} GiB",
                    flush=True,
                )
    result = {"tool": "bench_checkpoint", "settings": vars(args) | {"out": str(args.out)}, "runs": runs}
    for model in args.models.split(","):
        by_mode = {r["mode"]: r for r in runs if r["model"] == model}
        if {"sync", "async"} <= set(by_mode):
            result.setdefault("same_losses", {})[model] = by_mode["sync"]["losses"] == by_mode["async"]["losses"]
    result["meta"] = finish(meta)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return result
