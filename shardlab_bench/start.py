"""How fast a short run starts: a one-step run's time to its first step against ``import torch``.

Every debug run, sweep point and requeue pays shardlab's start-up, so it is measured against the floor any torch
program pays: a fresh ``python -c "import torch"``, and beside it a program that only builds a torch optimizer (which
imports torch._dynamo, as every torch trainer does). Rounds are interleaved (torch, optimizer, run, ...) in fresh
processes so that a machine's load drifts over all alike; the figures are ratios of the medians. The run is the
default LM with one step and nothing else (no validation, checkpoint or TensorBoard); the time its ``[train] step 1``
line reaches this process, less the step's own ``ms_per_step``, is when its first step began.

    python -m shardlab_bench start --pairs 5 --out docs/bench/start.json
    python -m shardlab_bench start --pairs 5 -- model=llama_tiny     # extra overrides for the run
    python -m shardlab_bench start --pairs 5 --torchvision -- task=image_classification   # a vision run and its floor
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlab_bench import provenance

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


IMPORT_TORCH = "import torch"
TORCH_OPTIMIZER = "import torch; torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())"
"""The floor of any torch training program: building a torch.optim optimizer imports torch._dynamo (its
add_param_group is wrapped by torch._disable_dynamo), so every trainer pays that import before its first step."""
TORCHVISION_OPTIMIZER = "import torch, torchvision; torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())"
"""The floor of a vision trainer built on torchvision's models (``--torchvision``): importing torchvision imports all of
its models, datasets, transforms and ops, whatever the run uses."""


def time_python(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def time_one_step(overrides: list[str], run_dir: Path) -> tuple[float, float, float]:
    """(seconds until the first step began, until its ``[train] step 1`` line, until the process ended).

    The step's own time is the line's ``ms_per_step``: the start is the line's time less the step.
    """
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
    step_line = next(line for line in output if line.startswith("[train] step 1 "))
    step_s = float(re.search(r"ms_per_step ([0-9.]+)", step_line).group(1)) / 1000
    return first_step - step_s, first_step, total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="interleaved (import torch, one-step run) pairs")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--torchvision", action="store_true", help="also time the floor with torchvision imported")
    parser.add_argument("overrides", nargs="*", help="extra overrides for the run (after --)")
    args = parser.parse_args(argv)
    settings = {"pairs": args.pairs, "run": ONE_STEP + args.overrides, "torchvision": args.torchvision}
    meta = provenance.collect(__file__, argv, settings)
    with tempfile.TemporaryDirectory() as tmp:
        # Warm-up (not counted): preprocesses the corpus into the cache and fills the OS page cache for both.
        time_python(IMPORT_TORCH)
        time_one_step(args.overrides, Path(tmp) / "warmup")
        torch_s, optimizer_s, vision_s, start_s, first_step_s, total_s = [], [], [], [], [], []
        for i in range(args.pairs):
            torch_s.append(time_python(IMPORT_TORCH))
            optimizer_s.append(time_python(TORCH_OPTIMIZER))
            if args.torchvision:
                vision_s.append(time_python(TORCHVISION_OPTIMIZER))
            start, first, total = time_one_step(args.overrides, Path(tmp) / f"run{i}")
            start_s.append(start)
            first_step_s.append(first)
            total_s.append(total)
            print(
                f"round {i + 1}: import torch {torch_s[-1]:.2f} s, torch optimizer {optimizer_s[-1]:.2f} s, run: "
                f"first step begins {start:.2f} s, ends {first:.2f} s, exit {total:.2f} s"
            )
    median = statistics.median
    result = {
        "meta": meta,
        "import_torch_s": torch_s,
        "torch_optimizer_s": optimizer_s,
        "first_step_begins_s": start_s,
        "first_step_s": first_step_s,
        "total_s": total_s,
        "median_import_torch_s": median(torch_s),
        "median_torch_optimizer_s": median(optimizer_s),
        "median_first_step_begins_s": median(start_s),
        "median_first_step_s": median(first_step_s),
        "median_total_s": median(total_s),
        "first_step_begins_over_import_torch": median(start_s) / median(torch_s),
        "first_step_over_import_torch": median(first_step_s) / median(torch_s),
        "torch_optimizer_over_import_torch": median(optimizer_s) / median(torch_s),
        "load_average_end": os.getloadavg(),
    }
    if vision_s:
        result["torchvision_optimizer_s"] = vision_s
        result["median_torchvision_optimizer_s"] = median(vision_s)
        result["torchvision_optimizer_over_import_torch"] = median(vision_s) / median(torch_s)
    print(
        f"median: import torch {median(torch_s):.2f} s, torch optimizer {median(optimizer_s):.2f} s "
        f"({result['torch_optimizer_over_import_torch']:.2f}x); the run's first step begins at {median(start_s):.2f} s "
        f"({result['first_step_begins_over_import_torch']:.2f}x) and ends at {median(first_step_s):.2f} s "
        f"({result['first_step_over_import_torch']:.2f}x); exit {median(total_s):.2f} s"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result
