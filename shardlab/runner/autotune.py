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

A job beside the runner, not a part of the memory plan: the plan (shardlab.memory) says what fits, each trial is put
together by the one assembly of a run (shardlab.trainer.assemble), and ``tune`` returns its decision for the runner,
which records it in the run's status.json.

The decision is part of the run: it is written to ``<run dir>/autotune.json`` (also when it came from the cache), so a
requeue or resume of the run reuses it without measuring, and to ``distributed.auto_tune_cache`` under a key of what
the speed depends on (model config, batch shapes, global batch, budget, world size, ranks per machine, device, torch
version, precision, compile), so the next run of the same shape starts at once too.

A run that has its own decision or checkpoints and resumes where the key differs (another world size, another GPU
model) is measured again, but only for its layout: the micro-batch split and the optimizer name the run (its
checkpoints hold them), so the run's own are kept, and the cache, another run's decision, is not read for it.
Delete the run's file (of a run without checkpoints) or the cache entry to measure again.

A candidate that fails on every rank alike (an out-of-memory error of the same step) is reported in the table and the
others are measured; one that fails on a single rank leaves the others waiting in that step's collective until
distributed.timeout_s ends the run.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from shardlab.checkpoint.agreement import broadcast_text
from shardlab.checkpoint.layout import complete_checkpoints
from shardlab.distributed import env as dist_env
from shardlab.distributed.base import pick_device
from shardlab.distributed.compile import FirstSteps
from shardlab.distributed.units import model_on_meta
from shardlab.errors import ConfigError
from shardlab.files.durable import write_json_atomic
from shardlab.files.regular_file import read_json_or_none
from shardlab.memory.budget import Choice, apply_choice, fitting, sharded_only, task_axes
from shardlab.memory.devices import GiB
from shardlab.memory.layout import Layout
from shardlab.memory.plan import profile_config
from shardlab.registry import BACKENDS
from shardlab.trainer import Trainer, assemble, run_config

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
class Decision:
    """What ``tune`` returns to the runner."""

    report: str
    """The line(s) saying what was chosen and how, for rank 0 to print."""
    measured: dict | None = None
    """Of a decision measured now, what the run's status.json records (label, choice, trials, tuning_s); None when
    a decision was reused."""


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
        "compile": d.compile,
    }


def key_hash(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def tune(cfg: DictConfig, task, env, run_dir: Path) -> Decision:
    """Choose the layout (and micro-batch split) for ``cfg`` with backend=auto and write it into ``cfg``; returns what
    was chosen and how (the runner prints it and records it). Every rank calls it after joining the process group,
    with its data open."""
    device = pick_device(env.local_rank)
    world, per_node = env.world_size, dist_env.ranks_per_node(env.world_size)
    key = decision_key(cfg, task, world, per_node, device)
    found = json.loads(broadcast_text(json.dumps(_find(cfg, run_dir, key)) if env.is_main else "", 0, device))
    decision, held = found["decision"], found["held"]
    if decision:
        _apply(cfg, decision["choice"])
        if decision["from"] == "cache" and env.is_main:  # from now on the run's own, whatever the cache does
            _write(Path(run_dir) / DECISION_FILE, {k: v for k, v in decision.items() if k != "from"})
        where = "this run's" if decision["from"] == "run" else f"the cached ({decision.get('created', '?')})"
        return Decision(f"distributed.backend=auto: {where} decision, {decision['label']} (not measured again)")
    if held:
        _hold(cfg, held, world)
    started = time.perf_counter()
    trials = _measure(cfg, task, env, device, run_dir, held)
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
        _record(cfg, run_dir, decision, cache=not held)
    measured = {k: decision[k] for k in ("label", "choice", "trials", "tuning_s")}
    return Decision("\n".join(_table(decision, task.unit, world)), measured)


def _measure(cfg: DictConfig, task, env, device: torch.device, run_dir: Path, held: dict | None) -> list[Trial]:
    """Measure the candidates (see the module docstring); every rank runs every trial. ``held``: the split (and
    optimizer) the run is bound to: only layouts are measured, and only those that keep its optimizer."""
    d, o = cfg.distributed, cfg.optimization
    world = env.world_size
    model = model_on_meta(task)  # the plan's, for every split: profiling casts it and puts it back
    profile, ctx = profile_config(cfg, task, world, model)
    fits = fitting(profile, cfg, ctx, sharded_only(d), task_axes(cfg, task, world, model, ctx.ranks_per_node))
    if held and "optimizer.name" in held:
        fits = [c for c in fits if _optimizer_with(cfg, c) == held["optimizer.name"]]
        if not fits:
            raise ConfigError(
                f"distributed.backend=auto: this run trains with optimizer.name={held['optimizer.name']} (its "
                f"{DECISION_FILE}), and no layout that fits the budget at world size {world} keeps it; raise "
                "distributed.memory_budget_gb or set distributed.backend"
            )
    lightest = [c for c in fits if not (c.layout.activation_checkpointing or c.layout.cpu_offload)]
    lightest = lightest or [c for c in fits if not c.layout.cpu_offload] or fits
    budget = d.auto_tune_max_trials
    trials = [_trial(cfg, task, env, device, run_dir, c, o.batch_size, o.update_freq) for c in lightest[:budget]]
    measured = [t for t in trials if t.step_s is not None]
    if measured and len(trials) < budget and not held:
        best = min(measured, key=lambda t: t.step_s)
        choice = next(c for c in lightest if c.layout.label(world) == best.layout)
        for batch, accumulate in _splits(o.batch_size, o.update_freq, world):
            if len(trials) >= budget:
                break
            fits_split = _fits_at(cfg, task, model, world, choice.layout, batch, accumulate)
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


def _fits_at(
    cfg: DictConfig, task, model: nn.Module, world: int, layout: Layout, batch: int, update_freq: int
) -> Choice | None:
    """``layout`` at global micro-batch ``batch`` x ``update_freq``, if the plan predicts it fits the budget
    (``model``: the task's, on meta); a TP or PP layout planned with the task's model axes, as _measure plans it."""
    trial_cfg = copy.deepcopy(cfg)
    trial_cfg.optimization.batch_size, trial_cfg.optimization.update_freq = batch, update_freq
    profile, ctx = profile_config(trial_cfg, task, world, model)
    axes = task_axes(trial_cfg, task, world, model, ctx.ranks_per_node) if layout.multi_axis else None
    try:
        fits = fitting(profile, trial_cfg, ctx, sharded_only(cfg.distributed), axes)
    except ConfigError:  # nothing fits at this micro-batch
        return None
    return next((c for c in fits if c.layout == layout), None)


def _trial(cfg: DictConfig, task, env, device, run_dir: Path, choice: Choice, batch: int, update_freq: int) -> Trial:
    """Train ``auto_tune_steps`` steps of one candidate on every rank; the model is thrown away afterwards. The trial
    is assembled as the run would be (shardlab.trainer.assemble), as a trial: the seeded init, the run directory not
    touched."""
    world = env.world_size
    trial_cfg = copy.deepcopy(cfg)
    apply_choice(trial_cfg, choice, world)
    trial_cfg.optimization.batch_size, trial_cfg.optimization.update_freq = batch, update_freq
    trial_cfg.logging.tensorboard = False
    trial_cfg.checkpoint.save = False  # never saves: its checkpointer makes no asynchronous saver (process group)
    overrides = {
        **{f"distributed.{k}": v for k, v in choice.layout.overrides(world).items()},
        "optimizer.name": trial_cfg.optimizer.name,
        "optimization.batch_size": batch,
        "optimization.update_freq": update_freq,
    }
    trial = Trial(choice.layout.label(world), overrides, batch, update_freq, choice.estimate.peak / GiB)
    trial_cfg = run_config(trial_cfg)  # as run_rank types the run's: the backend and the trainer read the dataclasses
    backend = BACKENDS.build(trial_cfg.distributed.backend, trial_cfg.distributed, env, key="distributed.backend")
    error, seconds, units, peak = None, [float("inf")], 0.0, 0
    try:
        trainer = assemble(trial_cfg, task, backend, run_dir, trial=True)  # the group and the data exist already
        seconds, units = time_steps(trainer, trial_cfg.distributed.auto_tune_steps)
        peak = trainer.meter.peak_above_baseline
        del trainer
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


def _optimizer_with(cfg: DictConfig, choice: Choice) -> str:
    """The optimizer a candidate trains with (apply_choice fuses an offloaded adamw as cpu_adam)."""
    trial_cfg = copy.deepcopy(cfg)
    apply_choice(trial_cfg, choice, 1)
    return trial_cfg.optimizer.name


HELD = ("optimization.batch_size", "optimization.update_freq", "optimizer.name")
"""What of a decision names the run (shardlab/cli/run_names.py): kept when the run's layout is measured again."""


def _hold(cfg: DictConfig, held: dict[str, Any], world: int) -> None:
    """The run's own micro-batch split into ``cfg`` (the optimizer is matched by the candidates, not set here)."""
    batch, update_freq = held["optimization.batch_size"], held["optimization.update_freq"]
    if batch % world:
        raise ConfigError(
            f"distributed.backend=auto: this run trains with optimization.batch_size={batch} x update_freq="
            f"{update_freq}, which does not divide over {world} ranks; resume it on a world size dividing {batch}"
        )
    cfg.optimization.batch_size, cfg.optimization.update_freq = batch, update_freq


def _apply(cfg: DictConfig, overrides: dict[str, Any]) -> None:
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        cfg[section][key] = value


def _read(path: Path) -> dict | None:
    """A decision file, its choice limited to the keys a decision sets (a file is data: it cannot set, say,
    checkpoint.init_from); None if it is missing or unreadable."""
    decision = read_json_or_none(path)
    if not isinstance(decision, dict) or not isinstance(decision.get("choice"), dict):
        return None
    choice = {k: v for k, v in decision["choice"].items() if k in HELD or k.startswith("distributed.")}
    return {**decision, "choice": choice}


def _find(cfg: DictConfig, run_dir: Path, key: dict) -> dict:
    """Rank 0: {"decision": one to reuse for ``key`` or None, "held": what the run is bound to or None}.

    The run's own decision for this key first. A run with its own decision for another key, or with checkpoints, is
    bound to its split (and optimizer): it is measured again for its layout only, and the cache is not read for it.
    Otherwise the cache."""
    own = _read(Path(run_dir) / DECISION_FILE)
    if own and own.get("key") == key:
        return {"decision": {**own, "from": "run"}, "held": None}
    if own:
        return {"decision": None, "held": {k: own["choice"][k] for k in HELD if k in own["choice"]}}
    if complete_checkpoints(Path(run_dir) / cfg.checkpoint.dir):  # started by hand; resumed now with auto
        o = cfg.optimization
        held = {"optimization.batch_size": o.batch_size, "optimization.update_freq": o.update_freq}
        return {"decision": None, "held": {**held, "optimizer.name": cfg.optimizer.name}}
    if cfg.distributed.auto_tune_cache:
        cached = _read(Path(cfg.distributed.auto_tune_cache).expanduser() / f"{key_hash(key)}.json")
        if cached and cached.get("key") == key:
            return {"decision": {**cached, "from": "cache"}, "held": None}
    return {"decision": None, "held": None}


def _record(cfg: DictConfig, run_dir: Path, decision: dict, cache: bool) -> None:
    """Rank 0: the decision into the run directory and the cache (``cache``: unless the run's split was held, which
    would make another run of this shape inherit it); status.json is the runner's to write."""
    targets = [Path(run_dir) / DECISION_FILE]
    if cfg.distributed.auto_tune_cache and cache:
        targets.append(Path(cfg.distributed.auto_tune_cache).expanduser() / f"{key_hash(decision['key'])}.json")
    for path in targets:
        _write(path, decision)


def _write(path: Path, decision: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, decision, indent=1)
    except OSError as e:  # a cache that cannot be written costs the next run a measurement, nothing more
        print(f"warning: distributed.backend=auto could not write {path} ({e})", flush=True)


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


def time_steps(trainer: Trainer, num_steps: int) -> tuple[list[float], float]:
    """Train ``trainer`` ``num_steps`` steps from its current state; (each step's seconds on this rank, the first
    including warm-up; the throughput units this rank processed per step). The peak meter sees them. A trial's
    measurement, whose model is thrown away afterwards: nothing is logged, validated or saved."""
    loader, sums, seconds = trainer.train_loader(), {}, []
    # A compiled trial compiles in its first step, as a run does: under compile_timeout_s, ended by a barrier.
    d = trainer.cfg.distributed
    first_steps = FirstSteps(d, trainer.backend.process_groups()) if d.compile else None
    trainer.meter.reset()
    try:
        for _ in range(num_steps):
            started = time.perf_counter()
            trainer.train_step(loader, sums)
            if trainer.backend.device.type == "cuda":
                torch.cuda.synchronize(trainer.backend.device)
            seconds.append(time.perf_counter() - started)
            if first_steps is not None:
                first_steps.ended(seconds[-1])
            trainer.meter.sample()
    finally:
        if first_steps is not None:
            first_steps.close()
    return seconds, float(sums["units"]) / num_steps
