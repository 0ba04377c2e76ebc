"""Kill a training run with SIGKILL at random moments, restart it with checkpoint.resume=auto each time, and check
that it ends exactly where an uninterrupted run ends and that a complete checkpoint was always there.

    python -m shardlab_bench kill_loop --kills 10 --out kill_loop.json                        # the default LM run
    python -m shardlab_bench kill_loop --kills 3 --out k.json -- model.num_layers=2 ...       # any training overrides

Every ``--save-every``-th kill waits for a checkpoint being written (a new step_N.tmp folder) beside a complete one
and kills during it; the others kill after a random delay. After each kill the newest complete checkpoint must load
(its model tensors are read through DCP). The final checkpoint's weights are compared with torch.equal, the final
validation line as printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardlab.checkpoint import weights
from shardlab.checkpoint.layout import REPLACED, complete_checkpoints

REPO = Path(__file__).resolve().parents[1]


def start(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shardlab.train", f"hydra.run.dir={run_dir}", "logging.progress_bar=false", *overrides]
    # A session of its own, so the kill reaches locally spawned ranks too.
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def final_line(output: str) -> str | None:
    lines = [line for line in output.splitlines() if line.startswith("final validation:")]
    return lines[-1] if lines else None


def complete_ones(root: Path) -> list[Path]:
    """The complete checkpoints in ``root`` by their listing, and each step_N.replaced (whose step_N, if missing, the
    next start restores); none where ``root`` is missing, or vanishes while listed (the pre-flight's check of the
    folder creates and removes it once at start-up)."""
    try:
        return complete_checkpoints(root) + [p for p in root.iterdir() if p.name.endswith(REPLACED)]
    except FileNotFoundError:
        return []


def newest_loadable(root: Path) -> str | None:
    """The newest complete checkpoint (complete_ones), if its model tensors load."""
    newest = max(complete_ones(root), key=lambda p: p.name, default=None)
    if newest is None:
        return None
    weights.read_full(newest)  # raises on a torn checkpoint
    return newest.name


def run_to_end(run_dir: Path, overrides: list[str]) -> tuple[str, float]:
    began = time.perf_counter()
    proc = start(run_dir, overrides)
    out, _ = proc.communicate()
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"run in {run_dir} failed (exit {proc.returncode}):\n{text[-3000:]}")
    return text, time.perf_counter() - began


def saves_in_progress(root: Path) -> set[tuple[str, int]]:
    """The step_N.tmp folders in ``root`` by (name, inode): a folder a killed start left behind keeps its inode, one a
    later save writes anew has another."""
    try:  # the pre-flight check creates and removes the folder once at start-up: it may vanish between two calls
        return {(p.name, p.stat().st_ino) for p in root.iterdir() if p.name.endswith(".tmp")}
    except FileNotFoundError:
        return set()


def kill_once(run_dir: Path, overrides: list[str], during_save: bool, delay: float, rng: random.Random) -> dict:
    """Start the run and SIGKILL it: after ``delay`` seconds, or (``during_save``) while this start writes a checkpoint
    beside a complete one, so that the kill tests that a save never costs the checkpoint before it. A step_N.tmp an
    earlier kill left behind is not a save of this start."""
    root = run_dir / "checkpoints"
    stale = saves_in_progress(root)
    proc = start(run_dir, overrides)
    began = time.perf_counter()
    saw_tmp = False
    while proc.poll() is None:
        now = time.perf_counter() - began
        saw_tmp = bool(saves_in_progress(root) - stale) and bool(complete_ones(root))  # listed: cheap to poll
        if (during_save and saw_tmp) or (not during_save and now >= delay):
            break
        time.sleep(0.002 if during_save else 0.05)
    if proc.poll() is not None:  # it finished first: nothing was killed
        proc.communicate()
        return {"killed": False, "after_s": round(time.perf_counter() - began, 2)}
    before = newest_loadable(root)
    if during_save:
        time.sleep(rng.uniform(0, 0.02))  # somewhere inside the write, not always at its first file
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return {
        "killed": True,
        "after_s": round(time.perf_counter() - began, 2),
        "during_save": saw_tmp,
        "newest_complete_before": before,
        "newest_complete_after": newest_loadable(root),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=3, help="every k-th kill lands during a save")
    parser.add_argument(
        "--max-delay",
        type=float,
        default=0.0,
        help="random kills within this many seconds of a start (0 = a quarter of the uninterrupted run's duration, "
        "so ten kills land before a restarted run can finish)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("runs/kill_loop"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="training overrides (after --)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    rng = random.Random(args.seed)
    ref_dir, run_dir = (args.workdir / "uninterrupted").absolute(), (args.workdir / "killed").absolute()
    for d in (ref_dir, run_dir):
        if d.exists():
            raise SystemExit(f"{d} exists; give a fresh --workdir")
    ref_out, ref_s = run_to_end(ref_dir, args.overrides)
    max_delay = args.max_delay or ref_s / 4
    kills, ever_saved, attempts = [], False, 0
    while sum(k["killed"] for k in kills) < args.kills and attempts < 3 * args.kills:
        attempts += 1
        during_save = (len(kills) + 1) % args.save_every == 0
        record = kill_once(run_dir, args.overrides, during_save, rng.uniform(1.0, max_delay), rng)
        ever_saved = ever_saved or record.get("newest_complete_after") is not None
        record["invariant_ok"] = not ever_saved or record.get("newest_complete_after") is not None
        kills.append(record)
        print(json.dumps(record), flush=True)
        if not record["killed"]:  # the run finished before its kill: no kill can land after it (the result says so)
            break
    out, _ = run_to_end(run_dir, args.overrides)
    ref_final = sorted(complete_checkpoints(ref_dir / "checkpoints"))[-1]
    got_final = sorted(complete_checkpoints(run_dir / "checkpoints"))[-1]
    a, b = weights.read_full(ref_final), weights.read_full(got_final)
    import torch

    result = {
        "overrides": args.overrides,
        "uninterrupted_s": round(ref_s, 1),
        "kills": kills,
        "num_killed": sum(k["killed"] for k in kills),
        "num_killed_during_save": sum(bool(k.get("during_save")) for k in kills if k["killed"]),
        "num_killed_beside_a_complete_checkpoint": sum(bool(k.get("newest_complete_before")) for k in kills),
        "always_a_complete_checkpoint": all(k["invariant_ok"] for k in kills),
        "final_uninterrupted": final_line(ref_out),
        "final_killed": final_line(out),
        "final_step": [ref_final.name, got_final.name],
        "final_weights_equal": ref_final.name == got_final.name and all(torch.equal(a[k], b[k]) for k in a),
    }
    result["ok"] = (
        result["always_a_complete_checkpoint"]
        and result["final_weights_equal"]
        and result["final_uninterrupted"] == result["final_killed"] is not None
    )
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return result
