"""distributed.backend=auto with distributed.auto_tune: the fastest layout that fits, measured on the real ranks.

Which layout is fastest depends on the model, the world size, the interconnect and the micro-batch, so a fixed order
is wrong somewhere. The memory plan (shardlab.memory.budget.fitting) says which layouts fit the budget; here each
candidate trains ``auto_tune_steps`` real steps on the ranks that will run the job (same data from the run's start,
same seeded init, updates thrown away), and the fastest wins.

What is measured, in order, at most ``auto_tune_max_trials`` candidates:
1. every fitting layout without recomputation or offload, at the configured micro-batch (activation checkpointing and
   cpu_offload only trade speed for memory, so they are measured only when nothing lighter fits);
2. the fastest of those with the configured global batch split the other ways that fit: twice the micro-batch and
   half the accumulation, or the reverse (the step's samples, and so the training, stay the same).
A step's time is the median of the timed steps (the first is a warm-up) on the slowest rank: every rank gets the same
numbers through one all-reduce and makes the same choice.

The decision is part of the run: it is written to ``<run dir>/autotune.json``, so a requeue or resume of the run reuses
it without measuring, and to ``distributed.auto_tune_cache`` under a key of what the speed depends on (model config,
batch shapes, global batch, budget, world size, ranks per machine, device, torch version, precision), so the next run
of the same shape starts at once too. Delete either file to measure again.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from shardlab.errors import ConfigError
from shardlab.memory.budget import Choice, apply_choice, fitting, sharded_only
from shardlab.memory.plan import GiB, Layout, profile_config

DECISION_FILE = "autotune.json"


@dataclass
class Candidate:
    layout: Layout
    batch_size: int
    """optimization.batch_size: the global micro-batch."""
    update_freq: int
    """optimization.update_freq: micro-batches accumulated per step (batch_size x update_freq is the configured)."""

    def label(self, world_size: int) -> str:
        return self.layout.label(world_size)


@dataclass
class Trial:
    layout: str
    overrides: dict[str, Any]
    """The distributed.* values of the layout, plus optimization.batch_size / update_freq."""
    micro_batch: int
    update_freq: int
    predicted_peak_gib: float
    step_s: float | None = None
    units_per_s: float | None = None
    measured_peak_gib: float | None = None
    error: str | None = None


def decision_key(cfg: DictConfig, task, world_size: int, ranks_per_node: int, device: torch.device) -> dict:
    """What a layout's speed depends on; equal keys reuse a decision."""
    d, o = cfg.distributed, cfg.optimization
    batch = task.example_batch(o.batch_size // world_size)
    shapes = [list(t.shape) + [str(t.dtype)] for t in (batch if isinstance(batch, (tuple, list)) else [batch])]
    return {
        "task": cfg.task.name,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "batch_shapes": shapes if batch is not None else None,
        "global_batch": o.batch_size * o.update_freq,
        "optimizer": cfg.optimizer.name,
        "budget_gib": d.memory_budget_gb,
        "budget_per": d.memory_budget_per,
        "precision": [d.precision, d.param_dtype, d.reduce_dtype],
        "fixed": [d.prefetch_units, d.reduce_scatter, d.reduce_every_microbatch, d.wrap_min_num_params],
        "world_size": world_size,
        "ranks_per_node": ranks_per_node,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "trials": [d.auto_tune_steps, d.auto_tune_max_trials],
    }


def key_hash(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def tune(cfg: DictConfig, task, env, run_dir: Path) -> str:
    """Choose the layout (and micro-batch split) for ``cfg`` with backend=auto and write it into ``cfg``; returns the
    line(s) saying what was chosen and how. Every rank calls it after joining the process group, with its data open."""
    from shardlab.checkpoint.agreement import broadcast_text
    from shardlab.distributed import env as dist_env
    from shardlab.distributed.base import pick_device

    device = pick_device(env.local_rank)
    world, per_node = env.world_size, dist_env.ranks_per_node(env.world_size)
    key = decision_key(cfg, task, world, per_node, device)
    recorded = broadcast_text(_recorded(cfg, run_dir, key) if env.is_main else "", 0, device)
    if recorded:
        decision = json.loads(recorded)
        _apply(cfg, decision["choice"])
        where = "this run's" if decision.get("from") == "run" else f"the cached ({decision.get('created', '?')})"
        return f"distributed.backend=auto: {where} decision, {decision['label']} (not measured again)"
    started = time.perf_counter()
    trials = _measure(cfg, task, env, device, run_dir)
    ok = [t for t in trials if t.step_s is not None]
    if not ok:
        failures = "; ".join(f"{t.layout}: {t.error}" for t in trials)
        raise ConfigError(f"distributed.backend=auto: every candidate failed ({failures}); set distributed.backend")
    best = min(ok, key=lambda t: t.step_s)
    decision = {
        "key": key,
        "choice": best.overrides,
        "label": f"{best.layout}, micro-batch {best.micro_batch} x {best.update_freq}",
        "trials": [asdict(t) for t in trials],
        "tuning_s": round(time.perf_counter() - started, 2),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    _apply(cfg, best.overrides)
    if env.is_main:
        _record(cfg, run_dir, decision)
    return "\n".join(_table(decision, task.unit, world))


def _measure(cfg: DictConfig, task, env, device: torch.device, run_dir: Path) -> list[Trial]:
    """Measure the candidates (see the module docstring); every rank runs every trial."""
    d, o = cfg.distributed, cfg.optimization
    world = env.world_size
    profile, ctx = profile_config(cfg, task, world)
    fits = fitting(profile, cfg, ctx, sharded_only(d))
    lightest = [c for c in fits if not (c.layout.activation_checkpointing or c.layout.cpu_offload)]
    lightest = lightest or [c for c in fits if not c.layout.cpu_offload] or fits
    budget = d.auto_tune_max_trials
    trials = [_trial(cfg, task, env, device, run_dir, c, o.batch_size, o.update_freq) for c in lightest[:budget]]
    measured = [t for t in trials if t.step_s is not None]
    if measured and len(trials) < budget:
        best = min(measured, key=lambda t: t.step_s)
        choice = next(c for c in lightest if c.layout.label(world) == best.layout)
        for batch, accumulate in _splits(o.batch_size, o.update_freq, world):
            if len(trials) >= budget:
                break
            fits_split = _fits_at(cfg, task, world, choice.layout, batch)
            if fits_split is not None:
                trials.append(_trial(cfg, task, env, device, run_dir, fits_split, batch, accumulate))
    return trials


def _splits(batch: int, update_freq: int, world: int) -> list[tuple[int, int]]:
    """The configured global batch split the other ways next to the configured one: (2b, u/2), (b/2, 2u)."""
    out = []
    if update_freq % 2 == 0:
        out.append((2 * batch, update_freq // 2))
    if batch % 2 == 0 and (batch // 2) % world == 0:
        out.append((batch // 2, 2 * update_freq))
    return out


def _fits_at(cfg: DictConfig, task, world: int, layout: Layout, batch: int) -> Choice | None:
    """``layout`` at global micro-batch ``batch``, if the plan predicts it fits the budget."""
    trial_cfg = copy.deepcopy(cfg)
    trial_cfg.optimization.batch_size = batch
    profile, ctx = profile_config(trial_cfg, task, world)
    try:
        fits = fitting(profile, trial_cfg, ctx, sharded_only(cfg.distributed))
    except ConfigError:  # nothing fits at this micro-batch
        return None
    return next((c for c in fits if c.layout == layout), None)


def _trial(cfg: DictConfig, task, env, device, run_dir: Path, choice: Choice, batch: int, update_freq: int) -> Trial:
    """Train ``auto_tune_steps`` steps of one candidate on every rank; the model is thrown away afterwards."""
    from shardlab.memory.plan import plan_run
    from shardlab.registry import BACKENDS
    from shardlab.trainer import Trainer

    world = env.world_size
    trial_cfg = copy.deepcopy(cfg)
    apply_choice(trial_cfg, choice, world)
    trial_cfg.optimization.batch_size, trial_cfg.optimization.update_freq = batch, update_freq
    trial_cfg.logging.tensorboard = False
    overrides = {
        **{f"distributed.{k}": v for k, v in choice.layout.overrides(world).items()},
        "optimizer.name": trial_cfg.optimizer.name,
        "optimization.batch_size": batch,
        "optimization.update_freq": update_freq,
    }
    trial = Trial(choice.layout.label(world), overrides, batch, update_freq, choice.estimate.peak / GiB)
    backend = BACKENDS.build(trial_cfg.distributed.backend, trial_cfg.distributed, env, key="distributed.backend")
    error, seconds, units, peak = None, [float("inf")], 0.0, 0
    try:
        backend.setup()  # the process group exists: only the layout's mesh is made
        plan = plan_run(trial_cfg, task, world)
        trainer = Trainer(trial_cfg, task, backend, run_dir)
        trainer.setup(plan, restore=False)  # the run directory is not touched
        seconds, units = trainer.time_steps(trial_cfg.distributed.auto_tune_steps)
        peak = trainer.meter.peak_above_baseline
        del trainer, plan
    except Exception as e:  # noqa: BLE001  (a candidate that cannot run is reported, not fatal)
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    (failed,) = backend.any_rank(error is not None)
    if failed:
        trial.error = error or "failed on another rank"
        return trial
    step_s, peak = backend.max_over_ranks([statistics.median(seconds[1:]), float(peak)])
    units = float(backend.all_reduce_sum(torch.tensor([units], dtype=torch.float64, device=backend.device))[0])
    trial.step_s = round(step_s, 4)
    trial.units_per_s = round(units / step_s, 1)
    trial.measured_peak_gib = round(peak / GiB, 3)
    return trial


def _apply(cfg: DictConfig, overrides: dict[str, Any]) -> None:
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        cfg[section][key] = value


def _recorded(cfg: DictConfig, run_dir: Path, key: dict) -> str:
    """Rank 0: a decision for ``key``, as JSON text: this run's own first, then the cache; "" when there is none."""
    candidates = [(Path(run_dir) / DECISION_FILE, "run")]
    if cfg.distributed.auto_tune_cache:
        candidates.append((Path(cfg.distributed.auto_tune_cache).expanduser() / f"{key_hash(key)}.json", "cache"))
    for path, origin in candidates:
        try:
            decision = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if decision.get("key") == key:
            return json.dumps({**decision, "from": origin})
    return ""


def _record(cfg: DictConfig, run_dir: Path, decision: dict) -> None:
    """Rank 0: the decision into the run directory, the cache and status.json."""
    from shardlab.jobs import run_record

    targets = [Path(run_dir) / DECISION_FILE]
    if cfg.distributed.auto_tune_cache:
        targets.append(Path(cfg.distributed.auto_tune_cache).expanduser() / f"{key_hash(decision['key'])}.json")
    for path in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(decision, indent=1))
            os.replace(tmp, path)
        except OSError as e:  # a cache that cannot be written costs the next run a measurement, nothing more
            print(f"warning: distributed.backend=auto could not write {path} ({e})", flush=True)
    summary = {k: decision[k] for k in ("label", "choice", "trials", "tuning_s")}
    run_record.update(run_dir, autotune=summary)


def _table(decision: dict, unit: str, world: int) -> list[str]:
    trials = decision["trials"]
    lines = [
        f"distributed.backend=auto measured {len(trials)} candidate(s) in {decision['tuning_s']:.1f} s and chose "
        f"{decision['label']}:",
        f"  {'layout':<34} {'micro-batch x accum':>19} {unit + '/s':>12} {'step s':>8} {'plan GiB':>9} {'peak GiB':>9}",
    ]
    chosen = decision["choice"]
    for t in trials:
        mark = "*" if t["overrides"] == chosen else " "
        split = f"{t['micro_batch']} x {t['update_freq']}"
        if t["error"]:
            lines.append(f"{mark} {t['layout']:<34} {split:>19}   failed: {t['error']}")
            continue
        lines.append(
            f"{mark} {t['layout']:<34} {split:>19} {t['units_per_s']:>12.1f} {t['step_s']:>8.3f} "
            f"{t['predicted_peak_gib']:>9.2f} {t['measured_peak_gib']:>9.2f}"
        )
    return lines
