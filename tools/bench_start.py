"""How fast a short run starts: a one-step run's time to its first logged step against ``import torch``.

Every debug run, sweep point and requeue pays shardlab's start-up, so it is measured against the floor any torch
program pays: a fresh ``python -c "import torch"``. Pairs are interleaved (torch, run, torch, run, ...) in fresh
processes so that a machine's load drifts over both alike; the figure is the ratio of the medians. The run is the
default LM with one step and nothing else (no validation, checkpoint or TensorBoard); its time is taken when its
``[train] step 1`` line reaches this process, and its whole wall time is reported beside.

    python tools/bench_start.py --pairs 5 --out docs/bench/start.json
    python tools/bench_start.py --pairs 5 -- model=llama_tiny     # extra overrides for the run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools import bench_meta  # noqa: E402

ONE_STEP = [
    "optimization.max_steps=1",
    "lr_scheduler.warmup_steps=0",
    "validation.interval_steps=0",
    "validation.num_batches=1",
    "checkpoint.save=false",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "logging.interval_steps=1",
]
"""One step and nothing around it but the final validation every run ends with (one batch; it comes after the first
step, which is what is timed). The corpus is preprocessed before the pairs start (its cache is warm)."""


def time_import_torch() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def time_one_step(overrides: list[str], run_dir: Path) -> tuple[float, float]:
    """(seconds until the ``[train] step 1`` line, seconds until the process ended)."""
    cmd = [sys.executable, "-m", "shardlab.train", *ONE_STEP, *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    first_step = None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        output = []
        for line in proc.stdout:
            output.append(line)
            if first_step is None and line.startswith("[train] step 1 "):
                first_step = time.perf_counter() - start
    total = time.perf_counter() - start
    if proc.returncode != 0 or first_step is None:
        raise SystemExit(f"error: the one-step run failed (exit {proc.returncode}):\n{''.join(output[-20:])}")
    return first_step, total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="interleaved (import torch, one-step run) pairs")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("overrides", nargs="*", help="extra overrides for the run (after --)")
    args = parser.parse_args(argv)
    meta = bench_meta.collect(__file__, argv, {"pairs": args.pairs, "run": ONE_STEP + args.overrides})
    with tempfile.TemporaryDirectory() as tmp:
        # Warm-up (not counted): preprocesses the corpus into the cache and fills the OS page cache for both.
        time_import_torch()
        time_one_step(args.overrides, Path(tmp) / "warmup")
        torch_s, first_step_s, total_s = [], [], []
        for i in range(args.pairs):
            torch_s.append(time_import_torch())
            first, total = time_one_step(args.overrides, Path(tmp) / f"run{i}")
            first_step_s.append(first)
            total_s.append(total)
            print(f"pair {i + 1}: import torch {torch_s[-1]:.2f} s, first step {first:.2f} s, exit {total:.2f} s")
    result = {
        "meta": meta,
        "import_torch_s": torch_s,
        "first_step_s": first_step_s,
        "total_s": total_s,
        "median_import_torch_s": statistics.median(torch_s),
        "median_first_step_s": statistics.median(first_step_s),
        "median_total_s": statistics.median(total_s),
        "first_step_over_import_torch": statistics.median(first_step_s) / statistics.median(torch_s),
        "load_average_end": os.getloadavg(),
    }
    print(
        f"median: import torch {result['median_import_torch_s']:.2f} s, first step "
        f"{result['median_first_step_s']:.2f} s ({result['first_step_over_import_torch']:.2f}x), exit "
        f"{result['median_total_s']:.2f} s"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
