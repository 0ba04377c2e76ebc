"""What shardlab costs per step: train.py against the bare loop of reference.py, interleaved.

    python -m shardlab_bench overhead --pairs 3 --out docs/bench/overhead.json          # ddp and fully_sharded
    python -m shardlab_bench overhead --backends fully_sharded --steps 10 --warmup 2

For each backend, ``--pairs`` pairs of runs on the same shapes (gpt_small, global batch 32 x 128 tokens, world size
2): shardlab's own path (train.py, i.e. runner.run_rank with the trainer as users run it) and a hand-written FSDP2 or
DDP loop over the same model with FSDP2's and torch's defaults (reference.py: random tokens, no data loading,
no checks, no logging). The order alternates within each pair (shardlab first, then the loop first, ...) so that a
drift in the machine's load favours neither; each pair gives a ratio of tokens/s (shardlab / loop), the figure is
the median ratio, and the framework keeps up where it is >= 0.99. Each run is a fresh process. Every run's JSON is
kept beside the summary (``<out>.runs/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from shardlab_bench import child_env, command, provenance

REFERENCE_PARALLEL = {"ddp": "ddp", "fully_sharded": "fsdp"}


def run(cmd: list[str], out: Path) -> dict:
    load = os.getloadavg()[0]
    subprocess.run(command(*cmd, "--out", str(out)), check=True, stdout=subprocess.DEVNULL, env=child_env())
    result = json.loads(out.read_text())
    result["loadavg_1min_before"] = load
    return result


def one_pair(backend: str, i: int, commands: dict[str, list[str]], runs_dir: Path) -> dict:
    """Pair ``i`` of ``backend``: both sides run one after the other, which goes first alternating with ``i``."""
    order = ("shardlab", "loop") if i % 2 == 0 else ("loop", "shardlab")
    got = {side: run(commands[side], runs_dir / f"{backend}-{i}-{side}.json") for side in order}
    pair = {
        "order": list(order),
        "shardlab_tokens_per_s": got["shardlab"]["tokens_per_s"],
        "loop_tokens_per_s": got["loop"]["tokens_per_s"],
        "ratio": got["shardlab"]["tokens_per_s"] / got["loop"]["tokens_per_s"],
        "shardlab_median_step_ms": got["shardlab"]["median_step_ms"],
        "loop_median_step_ms": got["loop"]["median_step_ms"],
        "loadavg_1min": [got[side]["loadavg_1min_before"] for side in order],
    }
    print(
        f"{backend} pair {i + 1}: shardlab {pair['shardlab_tokens_per_s']:.0f} tokens/s, bare loop "
        f"{pair['loop_tokens_per_s']:.0f} ({pair['ratio']:.3f}x); load "
        f"{pair['loadavg_1min'][0]:.1f}/{pair['loadavg_1min'][1]:.1f}",
        flush=True,
    )
    return pair


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="ddp,fully_sharded", help="comma-separated: ddp, fully_sharded")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--out", type=Path, default=Path("overhead.json"))
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    if any(b not in REFERENCE_PARALLEL for b in backends) or args.pairs < 1:
        parser.error(f"--backends takes {', '.join(REFERENCE_PARALLEL)}; --pairs >= 1")
    settings = {"backends": backends, "pairs": args.pairs, "steps": args.steps, "warmup": args.warmup}
    summary = {"meta": provenance.collect(__file__, argv, settings), "backends": {}}
    runs_dir = args.out.with_name(args.out.name + ".runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    timing = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    for backend in backends:
        commands = {
            "shardlab": [
                "train",
                "model=gpt_small",
                f"distributed.backend={backend}",
                "distributed.world_size=2",
                *timing,
            ],
            "loop": [
                "reference",
                f"--parallel={REFERENCE_PARALLEL[backend]}",
                "--world-size=2",
                *timing,
            ],
        }
        pairs = [one_pair(backend, i, commands, runs_dir) for i in range(args.pairs)]
        summary["backends"][backend] = {
            "pairs": pairs,
            "median_ratio": statistics.median(p["ratio"] for p in pairs),
            "commands": {side: ["python", "-m", "shardlab_bench", *cmd] for side, cmd in commands.items()},
        }
        summary["load_average_end"] = os.getloadavg()
        args.out.write_text(json.dumps(summary, indent=1) + "\n")  # partial results survive a stop
    for backend, result in summary["backends"].items():
        print(f"{backend}: shardlab at {result['median_ratio']:.3f}x the bare loop (median of {args.pairs} pairs)")
    return summary
