"""fp32 against bf16 (and what distributed.precision=auto picks) on the default LM: tokens/s and final validation loss.

    python -m shardlab_bench precision --out docs/bench/precision.json  # the default LM's full run, both at once
    python -m shardlab_bench precision --isa-cap AVX2 --precisions fp32,bf16,auto \\
        --out docs/bench/precision_avx2.json optimization.max_steps=3 lr_scheduler.warmup_steps=1

Each run is ``python -m shardlab.train distributed.precision=<p> hydra.run.dir=<run-root>_<round>_<p>`` in a fresh
process, plus the Hydra overrides given here (arguments without a leading ``--``); its throughput is the run's own
logged ``tokens_per_s`` (the trainer's windows, which leave validation and saving out), its loss the final
validation loss the run writes to status.json. With --concurrent (the default) the runs of a round start together,
so a busy machine's load falls on every precision alike; without it they run one after another, the order rotating
every round. The load average is sampled every 10 s while they run.

Before the runs a fresh interpreter measures the matmul rates that precision=auto decides by
(shardlab/distributed/precision.py, not cached) and prints auto's line. ``--isa-cap AVX2`` sets ONEDNN_MAX_CPU_ISA
for that measurement and every run (oneDNN reads it once, at its first call: it must be in a process's environment
when it starts): on an AVX-512-BF16 CPU its bf16 matmuls then take the path of an AVX2-only CPU. An ISA cap already
in this process's environment (ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA) is inherited the same way; the JSON records
the one in force.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shardlab_bench import provenance

REPO = Path(__file__).resolve().parent.parent
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
RATES = """
import json, torch
from shardlab.distributed import precision
cpu = torch.device("cpu")
rates, source = precision.machine_rates(cpu, None)
chosen = precision.choice(rates)
print(json.dumps({**rates, "choice": chosen, "line": precision.describe(chosen, rates, source, cpu)}))
"""
TRAIN_LINE = re.compile(r"\[train\] step (\d+) \| (.*)")
VALID_LINE = re.compile(r"\[valid\] step (\d+) \| loss ([\d.]+)")


def matmul_rates() -> dict:
    """The rates precision=auto decides by, measured now in a fresh interpreter (it inherits the ISA cap)."""
    out = subprocess.run([sys.executable, "-c", RATES], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_run(run_dir: Path, stdout: str) -> dict:
    """The run's logged throughput windows, its validation losses (the final one: None for a run stopped early) and,
    for auto, the line it printed."""
    windows, last_step, valid = [], 0, {}
    for line in (run_dir / "train.log").read_text().splitlines():
        if m := VALID_LINE.search(line):
            valid[m.group(1)] = float(m.group(2))  # keyed by the step as a string, as the JSON keeps it
        if m := TRAIN_LINE.search(line):
            step = int(m.group(1))
            fields = dict(part.split(" ", 1) for part in m.group(2).split(" | "))
            ms = float(fields["ms_per_step"])
            windows.append({"step": step, "tokens_per_s": float(fields["tokens_per_s"]), "ms_per_step": ms,
                            "steps": step - last_step, "loss": float(fields["loss"])})  # fmt: skip
            last_step = step
    status = json.loads((run_dir / "status.json").read_text())
    seconds = sum(w["ms_per_step"] * w["steps"] / 1000 for w in windows)
    tokens = sum(w["tokens_per_s"] * w["ms_per_step"] * w["steps"] / 1000 for w in windows)
    auto = [line for line in stdout.splitlines() if "distributed.precision=auto" in line]
    return {
        "status": status["status"],
        "steps": last_step,
        "tokens_per_s": tokens / seconds,  # the run's training tokens over its training time
        "tokens_per_s_median_window": statistics.median(w["tokens_per_s"] for w in windows),
        "final_valid_loss": (status.get("final") or {}).get("loss") if status["status"] == "completed" else None,
        "valid_losses": valid,
        "windows": windows,
        "auto_line": auto[-1].strip() if auto else None,
    }


def start(precision: str, run_dir: Path, overrides: list[str], cache: Path) -> tuple[subprocess.Popen, Path]:
    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover run would be resumed (checkpoint.resume=auto)
    log = run_dir.with_name(run_dir.name + ".out")
    cmd = [sys.executable, "-m", "shardlab.train", f"distributed.precision={precision}",
           f"distributed.precision_cache={cache}", f"hydra.run.dir={run_dir}", *overrides]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT), log


def wait(procs: list[tuple[str, subprocess.Popen, Path, Path]], loads: list[float], limit_s: float) -> dict[str, dict]:
    """Wait for the runs of a round, sampling the 1-minute load average; each run's parsed result. Past ``limit_s``
    the runs still going get SIGTERM (shardlab saves and stops at the step's end) and count as stopped early."""
    started, stopped = time.perf_counter(), False
    while any(p.poll() is None for _, p, _, _ in procs):
        if not stopped and time.perf_counter() - started > limit_s:
            for _, p, _, _ in procs:
                if p.poll() is None:
                    p.terminate()
            stopped = True
        loads.append(round(os.getloadavg()[0], 2))
        time.sleep(10)
    results = {}
    for precision, proc, run_dir, log in procs:
        stdout = log.read_text()
        if proc.returncode != 0 and not stopped:
            raise SystemExit(f"bench_precision: the {precision} run failed (exit {proc.returncode}); see {log}")
        results[precision] = {**parse_run(run_dir, stdout), "wall_s": round(time.perf_counter() - started, 1)}
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", default="fp32,bf16", help=f"comma-separated, of: {', '.join(PRECISIONS)}")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of one run per precision")
    parser.add_argument("--sequential", action="store_true", help="one run at a time (default: a round at once)")
    parser.add_argument("--run-root", default="/tmp/prec_bench", help="runs go to <run-root>_<round>_<precision>")
    parser.add_argument("--isa-cap", help="ONEDNN_MAX_CPU_ISA for every process started here, e.g. AVX2")
    parser.add_argument("--time-limit", type=float, help="minutes per round, then its runs stop (recorded as such)")
    parser.add_argument("--out", required=True, help="the JSON (tables.py renders it in docs/)")
    args, overrides = parser.parse_known_args(argv)
    precisions = args.precisions.split(",")
    if any(p not in PRECISIONS for p in precisions) or args.rounds < 1 or any(o.startswith("-") for o in overrides):
        parser.error(f"bad --precisions {args.precisions} (of {', '.join(PRECISIONS)}), --rounds or an unknown option")
    if args.isa_cap:
        os.environ["ONEDNN_MAX_CPU_ISA"] = args.isa_cap  # the processes started below inherit it
    env = {v: os.environ[v] for v in ISA_VARIABLES if v in os.environ}
    settings = {"precisions": precisions, "rounds": args.rounds, "concurrent": not args.sequential, "env": env}
    meta = provenance.collect(__file__, argv, settings)
    if env and not args.isa_cap:  # a cap from the environment is part of what was measured: the command shows it
        meta["command"] = " ".join(f"{k}={v}" for k, v in env.items()) + " " + meta["command"]
    rates = matmul_rates()
    print(f"bench_precision: {rates['line']}", flush=True)
    cache = Path(f"{args.run_root}_cache")  # fresh: auto measures again here, under this run's ISA cap
    shutil.rmtree(cache, ignore_errors=True)
    result = {"meta": meta, "tool": "bench_precision", "overrides": overrides, "env": env, "matmul": rates}
    result.update({"concurrent": not args.sequential, "rounds": []})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        order = precisions[r % len(precisions) :] + precisions[: r % len(precisions)]
        loads: list[float] = []
        runs: dict[str, dict] = {}
        groups = [order] if not args.sequential else [[p] for p in order]
        for group in groups:
            procs = []
            for p in group:
                run_dir = Path(f"{args.run_root}_{r}_{p}")
                proc, log = start(p, run_dir, overrides, cache)
                procs.append((p, proc, run_dir, log))
            runs.update(wait(procs, loads, 60 * args.time_limit if args.time_limit else float("inf")))
        result["rounds"].append({"order": order, "runs": runs, "load_average": loads})
        for p in order:
            run = runs[p]
            auto = f" ({run['auto_line']})" if run["auto_line"] else ""
            loss = run["final_valid_loss"] or f"none (stopped: {run['status']})"
            line = f"{run['tokens_per_s']:.0f} tokens/s at step {run['steps']}, final validation loss {loss}{auto}"
            print(f"bench_precision: round {r + 1} {p}: {line}", flush=True)
        result["summary"] = summarize(result["rounds"], precisions)
        result["meta"] = provenance.finish(meta)
        out.write_text(json.dumps(result, indent=1) + "\n")  # partial results survive a stop
    print(f"bench_precision: wrote {out}", flush=True)
    return result


def common_valid_step(runs: dict[str, dict]) -> int | None:
    """The last step every run of a round validated at: where runs stopped at different steps compare."""
    steps = set.intersection(*(set(map(int, r["valid_losses"])) for r in runs.values()))
    return max(steps) if steps else None


def summarize(rounds: list[dict], precisions: list[str]) -> dict:
    """Per precision: the median over rounds of tokens/s and of the validation loss at each round's last common
    validation step (the final one where every run completed), and each against fp32."""
    summary = {}
    for p in precisions:
        losses = [r["runs"][p]["valid_losses"].get(str(common_valid_step(r["runs"]))) for r in rounds]
        summary[p] = {
            "tokens_per_s": statistics.median(r["runs"][p]["tokens_per_s"] for r in rounds),
            "valid_loss": statistics.median(x for x in losses if x is not None) if any(losses) else None,
            "valid_steps": [common_valid_step(r["runs"]) for r in rounds],
        }
    if "fp32" in summary:
        base = summary["fp32"]
        for p in precisions:
            summary[p]["speed_vs_fp32"] = summary[p]["tokens_per_s"] / base["tokens_per_s"]
            if summary[p]["valid_loss"] is not None and base["valid_loss"]:
                summary[p]["loss_vs_fp32"] = summary[p]["valid_loss"] / base["valid_loss"] - 1
    return summary
