"""The FSDP claim on shardlab itself: under one machine's memory budget, how large a GPT (and how large a batch) each
layout trains, measured, with the memory plan's prediction beside every measured point.

    python -m shardlab_bench max_model                       # 18 GiB per machine, world size 4, all four layouts
    python -m shardlab_bench max_model --layouts ddp,fully_sharded --skip-batch --budget-gib 8

Models grow layers and width together: scale k gives k layers of width 64k with k heads (GPT-2/3 keep a similar
ratio). Each point is a real `python -m shardlab.train` run of --steps steps at --world-size local ranks. A watcher
sums the memory of the run's whole process tree (proportional set size) every few milliseconds and kills the tree
(SIGKILL) the moment it passes the budget, so an over-budget point fails here, not by the kernel's OOM killer. The
search starts where the plan predicts the largest fit (the rule distributed.backend=auto uses) and steps up until a
run is killed, or down until one fits.

Writes a JSON of every run (--out) and a PNG (--plot; needs matplotlib: pip install -e '.[plot]').
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlab_bench.provenance import collect, finish

REPO = Path(__file__).resolve().parent.parent

GiB = 2**30
LAYOUTS = {
    "ddp": ["distributed=ddp"],
    "fully_sharded": ["distributed=fully_sharded"],
    "fully_sharded_ac": ["distributed=fully_sharded", "distributed.activation_checkpointing=full"],
    "fully_sharded_offload": ["distributed=fully_sharded", "distributed.cpu_offload=true", "optimizer=cpu_adam"],
}
MEMORY_LINE = re.compile(
    r"training-step peak ([\d.]+) GiB .*?plan ([\d.]+); held between steps ([\d.]+) GiB, plan ([\d.]+)"
)


def model_overrides(k: int, seq_len: int) -> list[str]:
    return [
        f"model.num_layers={k}",
        f"model.dim={64 * k}",
        f"model.num_heads={k}",
        f"model.max_seq_len={seq_len}",
        f"data.seq_len={seq_len}",
    ]


def run_overrides(opts, layout: str, k: int, batch: int) -> list[str]:
    return [
        "task=lm",
        *LAYOUTS[layout],
        *model_overrides(k, opts.seq_len),
        f"distributed.world_size={opts.world_size}",
        f"optimization.batch_size={batch}",
        f"optimization.max_steps={opts.steps}",
        "lr_scheduler.warmup_steps=0",
        f"validation.batch_size={opts.world_size}",
        "validation.num_batches=1",
        "checkpoint.save=false",
        "distributed.cpu_allocator=lean",  # resident memory is what the plan predicts, not the allocator's cache
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"logging.interval_steps={opts.steps}",
    ]


# ---- prediction ------------------------------------------------------------------------------------------------------
def predict(overrides: list[str], world_size: int) -> dict:
    """The memory plan of a run, as the run itself will print it (per rank), and the auto rule's need per machine."""
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory import budget as memory_budget
    from shardlab.memory.estimate import estimate
    from shardlab.memory.layout import layout_of
    from shardlab.memory.plan import profile_config
    from shardlab.runner import build_task

    cfg = compose_config(overrides)
    task = build_task(cfg, world_size)
    profile, ctx = profile_config(cfg, task, world_size, model_on_meta(task))
    est = estimate(profile, layout_of(cfg.distributed, world_size), ctx)
    return {
        "params": profile.params,
        "predicted_peak_gib": est.peak / GiB,
        "predicted_between_steps_gib": est.between_steps / GiB,
        "needed_per_machine_gib": ctx.ranks_per_node * memory_budget.needed(est) / GiB,
    }


# ---- measurement -----------------------------------------------------------------------------------------------------
def tree_pss(root_pid: int) -> int:
    """Proportional set size of ``root_pid``'s process group (the run started its own session): resident memory
    with pages shared between processes (torch's libraries, mapped data) split among them, so the sum is what the
    machine holds. A sum of RSS would count torch's shared libraries once per rank."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != root_pid:
                continue
            for line in Path(entry.path, "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total


def measure(overrides: list[str], budget: int, run_dir: Path, poll_s: float) -> dict:
    """Run one point under the watcher; the measured figures, or killed=True if it passed the budget."""
    cmd = [sys.executable, "-m", "shardlab.train", *overrides, f"hydra.run.dir={run_dir}"]
    started = time.monotonic()
    with open(run_dir.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        peak, killed = 0, False
        while proc.poll() is None:
            rss = tree_pss(proc.pid)
            peak = max(peak, rss)
            if rss > budget:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(poll_s)
        proc.wait()
    text = run_dir.with_suffix(".log").read_text()
    result = {"killed": killed, "machine_peak_gib": peak / GiB, "seconds": time.monotonic() - started}
    match = MEMORY_LINE.search(text)
    if not killed and proc.returncode == 0 and match:
        peak_r, plan_r, held, plan_held = map(float, match.groups())
        result.update(rank_peak_gib=peak_r, rank_between_steps_gib=held, completed=True)
    else:
        result["completed"] = False
        if not killed:
            result["error"] = text.strip().splitlines()[-1] if text.strip() else f"exit {proc.returncode}"
    return result


def point(opts, layout: str, k: int, batch: int, budget: int, workdir: Path) -> dict:
    overrides = run_overrides(opts, layout, k, batch)
    record = {"layout": layout, "k": k, "batch_size": batch, **predict(overrides, opts.world_size)}
    name = f"{layout}_k{k}_b{batch}"
    record.update(measure(overrides, budget, workdir / name, opts.poll_s))
    if record.get("completed"):
        record["prediction_error"] = record["predicted_peak_gib"] / record["rank_peak_gib"] - 1
    status = "fits" if record["completed"] else ("over budget, killed" if record["killed"] else "failed")
    print(
        f"  {layout:<22} k={k:<3} params={record['params'] / 1e6:7.1f}M batch={batch:<4} {status:<20} machine peak "
        f"{record['machine_peak_gib']:5.2f} GiB; per rank: measured "
        f"{record.get('rank_peak_gib', float('nan')):.2f}, plan {record['predicted_peak_gib']:.2f} GiB "
        f"({record['seconds']:.0f} s)",
        flush=True,
    )
    return record


def search(opts, layout: str, vary: str, fixed: int, budget: int, workdir: Path, runs: list, save) -> int | None:
    """The largest value of ``vary`` (k or the batch per rank) whose run fits; starts at the plan's prediction."""

    def args(v: int) -> tuple[int, int]:
        return (v, fixed) if vary == "k" else (fixed, v * opts.world_size)

    def predicted_fit(v: int) -> bool:
        k, batch = args(v)
        need = predict(run_overrides(opts, layout, k, batch), opts.world_size)["needed_per_machine_gib"]
        return need <= opts.budget_gib

    v = 1
    while predicted_fit(v + 1) and v < 512:
        v += 1
    best, tried = None, {}
    step = 1 if vary == "k" else max(1, v // 16)  # a batch grows in ~6% steps: the plan's margin is 10%
    for _ in range(opts.max_runs):
        k, batch = args(v)
        record = point(opts, layout, k, batch, budget, workdir)
        record["vary"] = vary
        runs.append(record)
        save()  # after every run: an interrupted search keeps what it measured
        tried[v] = record["completed"]
        if record["completed"]:
            best = v if best is None else max(best, v)
            if any(not ok for u, ok in tried.items() if u > v):
                break  # the next size up was already killed
            v += step
        elif not record["killed"] or best is not None or v - step < 1:
            break  # a failure that is not memory (reported), or the edge is found
        else:
            v -= step
    return best


# ---- report ----------------------------------------------------------------------------------------------------------
def summarize(results: dict) -> dict:
    largest = {}
    for layout, best_k in results["largest_k"].items():
        fits = [r for r in results["runs"] if r["layout"] == layout and r["vary"] == "k" and r["k"] == best_k]
        largest[layout] = {"k": best_k, "params": fits[0]["params"] if fits else None}
    ddp = largest.get("ddp", {}).get("params")
    ratios = {
        layout: (v["params"] / ddp if ddp and v["params"] else None) for layout, v in largest.items() if layout != "ddp"
    }
    errors = [abs(r["prediction_error"]) for r in results["runs"] if "prediction_error" in r]
    return {
        "largest_model": largest,
        "params_ratio_vs_ddp": ratios,
        "largest_batch_per_rank": results.get("largest_batch_per_rank", {}),
        "max_abs_prediction_error": max(errors) if errors else None,
    }


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[plot]')", file=sys.stderr)
        return False
    summary = results["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(summary["largest_model"])
    params = [(summary["largest_model"][n]["params"] or 0) / 1e6 for n in names]
    bars = axes[0].bar(range(len(names)), params, color=["#888"] + ["#3a7"] * (len(names) - 1))
    for bar, name in zip(bars, names, strict=True):
        ratio = summary["params_ratio_vs_ddp"].get(name)
        label = f"{bar.get_height():.0f}M" + (f"\n{ratio:.1f}x ddp" if ratio else "")
        axes[0].annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    axes[0].set_xticks(range(len(names)), [n.replace("fully_sharded", "fs") for n in names])
    axes[0].set_ylabel("largest GPT trained (M parameters)")
    axes[0].set_title(f"{results['budget_gib']:g} GiB per machine, {results['world_size']} ranks")
    axes[0].margins(y=0.2)
    done = [r for r in results["runs"] if r.get("completed")]
    top = max([r["rank_peak_gib"] for r in done] + [r["predicted_peak_gib"] for r in done] + [1.0]) * 1.1
    axes[1].plot([0, top], [0, top], color="#444", lw=1, label="plan = measured")
    axes[1].fill_between([0, top], [0, 0.75 * top], [0, 1.25 * top], color="#ddd", label="within 25%")
    for layout, marker in zip(LAYOUTS, "osD^", strict=True):
        pts = [r for r in done if r["layout"] == layout]
        if pts:
            x, y = [r["rank_peak_gib"] for r in pts], [r["predicted_peak_gib"] for r in pts]
            axes[1].scatter(x, y, label=layout, marker=marker, s=60 if marker == "o" else 30, alpha=0.8)
    axes[1].set_xlabel("measured training-step peak per rank (GiB above the rank's start)")
    axes[1].set_ylabel("memory plan's prediction (GiB)")
    axes[1].set_title("predicted vs measured, every completed run")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=18.0, help="memory per machine (default 18)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=0, help="global batch of the model search (0: 1 per rank)")
    parser.add_argument("--batch-k", type=int, default=12, help="the fixed model's scale k for the batch search")
    parser.add_argument("--skip-batch", action="store_true", help="only the largest-model search")
    parser.add_argument("--skip-model", action="store_true", help="only the largest-batch search")
    parser.add_argument("--max-runs", type=int, default=4, help="runs per layout and search")
    parser.add_argument("--poll-s", type=float, default=0.02, help="seconds between memory readings")
    parser.add_argument("--out", type=Path, default=Path("max_model.json"))
    parser.add_argument("--plot", type=Path, default=Path("max_model.png"))
    opts = parser.parse_args()
    meta = collect(__file__, settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()})
    layouts = opts.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    budget = int(opts.budget_gib * GiB)
    batch = opts.batch_size or opts.world_size
    results: dict = {
        "tool": "max_model",
        "budget_gib": opts.budget_gib,
        "world_size": opts.world_size,
        "steps": opts.steps,
        "seq_len": opts.seq_len,
        "model_search_batch_size": batch,
        "batch_search_k": opts.batch_k,
        "model_family": "k layers, width 64k, k heads, byte vocabulary (320 rows)",
        "runs": [],
        "largest_k": {},
        "largest_batch_per_rank": {},
        "host": {"cpu_count": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
    }

    def save() -> None:
        results["summary"] = summarize(results)
        results["meta"] = finish(meta)
        opts.out.write_text(json.dumps(results, indent=1))

    with tempfile.TemporaryDirectory(prefix="shardlab-max-model-") as tmp:
        workdir = Path(tmp)
        for layout in layouts if not opts.skip_model else []:
            print(f"largest model, {layout}:", flush=True)
            results["largest_k"][layout] = None
            results["largest_k"][layout] = search(opts, layout, "k", batch, budget, workdir, results["runs"], save)
        for layout in layouts if not opts.skip_batch else []:
            print(f"largest batch, {layout} (k={opts.batch_k}):", flush=True)
            best = search(opts, layout, "batch", opts.batch_k, budget, workdir, results["runs"], save)
            results["largest_batch_per_rank"][layout] = best
    save()
    print(json.dumps(results["summary"], indent=1))
    if not opts.skip_model and plot(results, opts.plot):
        print(f"wrote {opts.out} and {opts.plot}")
