"""The self-supervised defaults judged over seeds on the test split (issue #31 item 2): each method's default
pretraining (``python -m shardlab.train task=METHOD seed=S``) for every seed, then ``tools/evaluate.py`` on its last
checkpoint, and the untrained trunk of the same architecture with each seed's init (its BatchNorm statistics
re-estimated on the train split, evaluate's default for --random-init). Reported: mean and sample standard deviation
over the seeds of linear-probe top-1/top-5 and kNN top-1 on the test split, which nothing was tuned on.

    python -m shardlab_bench ssl_seeds --out docs/bench/ssl_seeds.json  # swav simclr dino + random, 3 seeds
    python -m shardlab_bench ssl_seeds --methods simclr --seeds 1 2 --out /tmp/simclr.json    # a part of it
    python -m shardlab_bench ssl_seeds --table docs/bench/ssl_seeds.json  # the markdown table of a study
    python -m shardlab_bench ssl_seeds --methods simclr --name simclr_last_bn --no-random \\
        -- task.projection_last_bn=true
    python -m shardlab_bench ssl_seeds --methods swav --seeds 1 --split valid --name swav_eps03 --no-random \\
        -- task.epsilon=0.03

A screen (``--split valid``; one seed allowed) judges on the validation split, the one recipes are chosen on, and its
table shows each run's own final loss and code entropy (from its status.json) beside the probe: the ablation tables
of docs/vision.md.

Runs go to ``--runs``/<name>/seed_<S> (default runs/ssl_seeds; the name is the method's unless ``--name`` gives a
variant its own). The training command resumes (checkpoint.resume=auto), so a study stopped half-way continues where it
stopped and a finished run is only evaluated again. Each training run's wall time is recorded with the load average
before and after: on a shared machine the times are noisy, the figures are not (every run is seeded). Arguments after
``--`` are overrides for every training run (e.g. ``-- distributed=single distributed.world_size=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shardlab.jobs import run_record
from shardlab_bench import provenance

METRICS = ("linear_top1", "linear_top5", "knn_top1")
EVAL_ARGS = {"dino": ["--ema"]}
"""How each method's trunk is judged beyond the defaults: DINO by its teacher (the EMA weights, their BatchNorm
statistics re-estimated: evaluate's default with --ema), as its paper does."""
LABELS = {
    "swav": "SwAV",
    "simclr": "SimCLR",
    "dino": "DINO",
    "random": "random init, BN re-estimated on train",
    "random_init_bn": "random init, its init's BN statistics",
}


def newest_checkpoint(run_dir: Path) -> Path:
    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    if not steps:
        raise SystemExit(f"{run_dir}: the training run left no checkpoint; see {run_dir} for its log")
    return steps[-1]


def train(method: str, seed: int, run_dir: Path, overrides: list[str]) -> dict:
    """The default pretraining of ``method`` with ``seed``, in its own process, as a user runs it; its wall time, or
    none when the run had finished before (the command then only finds its last checkpoint)."""
    finished_before = completed(run_dir)
    command = [sys.executable, "-m", "shardlab.train", f"task={method}", f"seed={seed}", f"hydra.run.dir={run_dir}"]
    command += ["logging.progress_bar=false", *overrides]
    load = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    print(f"[{method} seed {seed}] {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=provenance.REPO)
    if done.returncode != 0:
        raise SystemExit(f"[{method} seed {seed}] training failed with exit code {done.returncode}")
    return {
        "command": command[1:],
        "seconds": None if finished_before else round(time.perf_counter() - started, 1),
        "load_average": [load, round(os.getloadavg()[0], 2)],
        **({"note": "finished before this study: evaluated only"} if finished_before else {}),
    }


def completed(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run that finished (its status.json says so)."""
    return (run_record.read(run_dir) or {}).get("status") == "completed"


def judge(argv: list[str], out: Path, split: str = "test") -> dict[str, float]:
    """tools/evaluate.py with ``argv`` on ``split``, the figures also written to ``out``."""
    from shardlab_commands import (
        evaluate,  # torch: not needed to print a table (tables.py renders studies)
    )

    results = evaluate.main([*argv, "--split", split, "--out", str(out)])
    return {k: results[k] for k in METRICS}


def final_metrics(run_dir: Path) -> dict[str, float]:
    """The run's own last validation figures (the method's loss and its diagnostics, e.g. SwAV's code_entropy), as its
    status.json recorded them: what a collapse shows before any probe."""
    return dict((run_record.read(run_dir) or {}).get("final") or {})


def summary(per_seed: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean and sample standard deviation (n - 1) of each metric over the seeds."""
    out = {}
    for metric in METRICS:
        values = [r[metric] for r in per_seed.values()]
        sd = statistics.stdev(values) if len(values) > 1 else float("nan")
        out[metric] = {"mean": round(statistics.fmean(values), 2), "sd": round(sd, 2), "n": len(values)}
    return out


TABLE_HEADER = (
    "| trunk (test split) | linear top-1 | linear top-5 | kNN top-1 | seeds: linear top-1 | training time |",
    "| --- | --- | --- | --- | --- | --- |",
)


SCREEN_HEADER = (
    "| setting (validation split) | final loss | code entropy | linear top-1 | kNN top-1 | training time |",
    "| --- | --- | --- | --- | --- | --- |",
)


def table(study: dict) -> str:
    """The study as a markdown table: mean ± sd over the seeds and the seeds' own values; a screen (on the validation
    split) as its runs' own final loss and code entropy beside the probe."""
    if study.get("split", "test") != "test":
        return "\n".join([*SCREEN_HEADER, *screen_rows(study)])
    return "\n".join([*TABLE_HEADER, *rows(study)])


def label(name: str, entry: dict, base: list[str] | tuple[str, ...] = ()) -> str:
    """The method's name and the overrides of the variant that ``base`` does not set alike: ``base`` is what every row
    of a table shares, or a screen's base (``key=value`` strings), which the table's text names once."""
    text = LABELS.get(entry.get("task", name), name)
    own = differs_from(base, entry.get("overrides") or [])
    if own:
        text += f" ({' '.join(own)})"
    elif base:
        text += " (the base of these runs)"
    return text


def differs_from(base: list[str] | tuple[str, ...], overrides: list[str]) -> list[str]:
    """``overrides`` that set a key to another value than ``base`` does, or a key it leaves alone."""
    kept = {o.split("=", 1)[0]: o for o in base}
    return [o for o in overrides if kept.get(o.split("=", 1)[0]) != o]


def training_time(entry: dict) -> str:
    times = [t["seconds"] for t in entry.get("training", {}).values() if t.get("seconds") is not None]
    return f"{min(times) / 60:.1f}-{max(times) / 60:.1f} min" if times else "-"


def mean_final(finals: list[dict[str, float]], key: str) -> str:
    values = [f[key] for f in finals if key in f]
    return f"{statistics.fmean(values):.3f}" if values else "-"


def screen_rows(study: dict, base: list[str] | None = None) -> list[str]:
    """One row per variant of a screen: its runs' final loss and code entropy (means over the seeds) beside the
    probe, which is how the recipes were chosen on the validation split (docs/vision.md). ``base``: the overrides of
    the screens' base (the table's first row), which its text names once: each row shows what it changes."""
    lines = []
    for name, entry in study["methods"].items():
        finals = list(entry.get("final", {}).values())
        s = entry["summary"]
        probe = [f"{s[m]['mean']:.1f}%" if s[m]["n"] == 1 else f"{s[m]['mean']:.1f} ± {s[m]['sd']:.1f}%"
                 for m in ("linear_top1", "knn_top1")]  # fmt: skip
        steps = f", {entry['steps']} steps" if entry.get("steps") else ""
        diagnostics = [mean_final(finals, "loss"), mean_final(finals, "code_entropy")]
        cells = [f"{label(name, entry, base or ())}{steps}", *diagnostics, *probe]
        lines.append(f"| {' | '.join(cells)} | {training_time(entry)} |")
    return lines


def rows(study: dict, common: tuple[str, ...] = ()) -> list[str]:
    """The table's rows, one per method or variant (tables.py puts the rows of several studies, run apart,
    under one header, and passes as ``common`` the overrides they all share, which its text names once)."""
    lines = []
    for name, entry in study["methods"].items():
        s = entry["summary"]
        cells = [f"{s[m]['mean']:.1f} ± {s[m]['sd']:.1f}%" for m in METRICS]
        seeds = ", ".join(f"{r['linear_top1']:.1f}" for r in entry["per_seed"].values())
        steps = f", {entry['steps']} steps" if entry.get("steps") else ""
        cells = [f"{label(name, entry, common)}{steps}", *cells, seeds, training_time(entry)]
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def parse(mine: list[str]) -> argparse.Namespace:
    """The study's own options (those before ``--``; the training overrides follow it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="*", default=["swav", "simclr", "dino"], help="tasks to pretrain (none: "
                        "the random trunk only)")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--no-random", action="store_true", help="skip the untrained trunk")
    parser.add_argument("--split", choices=["test", "valid"], default="test", help="the split judged on: test (the "
                        "report; nothing is tuned on it) or valid (a screen, how recipes are chosen: one seed allowed, "
                        "the table shows each run's final loss and code entropy)")  # fmt: skip
    parser.add_argument("--runs", type=Path, default=Path("runs/ssl_seeds"), help="where the training runs go")
    parser.add_argument("--out", type=Path, default=None, help="the study as JSON")
    parser.add_argument("--table", type=Path, default=None, help="print the table of this study's JSON and stop")
    parser.add_argument("--name", default=None, help="the study's name for its one method's variant (its runs' "
                        "folder too), e.g. simclr_last_bn with -- task.projection_last_bn=true")  # fmt: skip
    return parser.parse_args(mine)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    mine = argv[: argv.index("--")] if "--" in argv else argv
    args = parse(mine)
    if args.table is not None:
        study = json.loads(args.table.read_text())
        print(table(study))
        return study
    if args.name is not None and len(args.methods) != 1:
        raise SystemExit(f"--name names one method's variant: give one method with it, got --methods {args.methods}")
    if len(args.seeds) < 2 and args.split == "test":
        raise SystemExit("--seeds: give at least 2 seeds for a standard deviation (the study's default: 1 2 3), or "
                         "screen one seed on the validation split with --split valid")  # fmt: skip
    meta = provenance.collect(__file__, argv)
    study: dict = {"methods": {}, "overrides": overrides, "split": args.split}
    for method in args.methods:
        name = args.name or method
        entry: dict = {"task": method, "overrides": overrides, "per_seed": {}, "training": {}, "final": {}}
        for seed in args.seeds:
            run_dir = (args.runs / name / f"seed_{seed}").resolve()
            entry["training"][str(seed)] = train(method, seed, run_dir, overrides)
            checkpoint = newest_checkpoint(run_dir)
            entry["steps"] = int(checkpoint.name.split("_")[-1])
            entry["final"][str(seed)] = final_metrics(run_dir)
            judged = [str(checkpoint), *EVAL_ARGS.get(method, [])]
            entry["per_seed"][str(seed)] = judge(judged, run_dir / f"eval_{args.split}.json", args.split)
        entry["summary"] = summary(entry["per_seed"])
        study["methods"][name] = entry
        print(table(study), flush=True)
    # The same trunk architecture (regnet_cifar, every method's default) untrained, with each seed's init: with its
    # BatchNorm statistics re-estimated on the train split (evaluate's default for --random-init), and, to show what
    # that changes, with its init's (mean 0, variance 1).
    baselines = [] if args.no_random else [("random", []), ("random_init_bn", ["--no-recompute-bn"])]
    for name, bn in baselines:
        entry = {"per_seed": {}}
        for seed in args.seeds:
            out = (args.runs / name / f"seed_{seed}" / f"eval_{args.split}.json").resolve()
            task = args.methods[0] if args.methods else "swav"
            architecture = [f"task={task}", *overrides, f"seed={seed}"]  # as trained: model.* included
            entry["per_seed"][str(seed)] = judge(["--random-init", *bn, *architecture], out, args.split)
        entry["summary"] = summary(entry["per_seed"])
        study["methods"][name] = entry
    study["meta"] = provenance.finish(meta)
    print(table(study), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(study, indent=1) + "\n")
    return study
