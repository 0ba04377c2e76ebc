"""Typed config sections (Hydra structured configs). The choices live in conf/*.yaml.

Every section is a dataclass registered in Hydra's ConfigStore as a schema (here, or with its factory through
shardlab.registry), so Hydra itself rejects an override with a typo in its key or a value of the wrong type.
``validate`` then checks ranges and cross-field rules and raises one ConfigError listing every problem.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from shardlab.errors import ConfigError


@dataclass
class TaskConfig:
    name: str = MISSING
    """A name in TASKS: lm, image_classification, swav, simclr."""


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """A name in OPTIMIZERS: adamw, sgd, cpu_adam, lars."""
    lr: float = 1e-3
    """Peak learning rate (reached after warmup)."""
    weight_decay: float = 0.0
    """Decoupled weight decay; applied to matrices/kernels only when exclude_norm_and_bias is true."""
    exclude_norm_and_bias: bool = True
    """Put norm weights and biases (1-D params) in a group without weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas (adamw, cpu_adam)."""
    eps: float = 1e-8
    """Adam epsilon (adamw, cpu_adam); lars: added to the trust ratio's denominator."""
    implementation: str = "auto"
    """Adam kernel: auto (fused where supported: ~7x faster on CPU than the per-tensor loop), fused, foreach, loop."""
    momentum: float = 0.9
    """SGD and LARS momentum."""
    nesterov: bool = True
    """SGD and LARS Nesterov momentum."""
    trust_coefficient: float = 1e-3
    """lars: eta of the trust ratio eta * |w| / (|g| + weight_decay * |w| + eps) that scales each weight's step."""


@dataclass
class LRSchedulerConfig:
    name: str = "cosine"
    """A name in LR_SCHEDULERS: cosine, inverse_sqrt, constant."""
    warmup_steps: int = 0
    """Linear warmup from ~0 to optimizer.lr over this many steps."""
    min_lr_ratio: float = 0.1
    """cosine: the final lr as a fraction of the peak."""


@dataclass
class DistributedConfig:
    backend: str = "single"
    """A name in BACKENDS: single, ddp, fully_sharded; or auto: the fastest layout the memory plan predicts to fit
    memory_budget_gb (shardlab/memory/budget.py)."""
    world_size: int = 1
    """The ranks shardlab starts itself: on this machine when no launcher started this process, or in each task of a
    Slurm job with fewer tasks than this (one task per node, each starting world_size / tasks ranks). torchrun, and a
    Slurm job of one task per rank, set the world themselves."""
    sharding_degree: int = -1
    """fully_sharded: ranks a parameter is sharded over (FSDP paper's F). -1 = all ranks; 1 <= F < world = hybrid."""
    reshard_after_forward: bool = True
    """fully_sharded: free gathered params after forward (ZeRO-3); false keeps them until backward (ZeRO-2-like)."""
    precision: str = "fp32"
    """Shorthand for param_dtype/reduce_dtype: fp32, bf16, fp16 (fp16 adds a gradient scaler), or auto: bf16 where this
    machine's bf16 matmuls are measurably faster than fp32, else fp32 (measured once per machine, cached in
    precision_cache, the same on every rank: shardlab/distributed/precision.py)."""
    precision_cache: str | None = "~/.cache/shardlab/precision"
    """precision=auto: where each machine's measured bf16 and fp32 matmul rates are kept (keyed by CPU, GPU and
    torch); null: measure in every run."""
    param_dtype: str | None = None
    """Compute dtype of gathered params: fp32, bf16, fp16; null = from precision."""
    reduce_dtype: str | None = None
    """Dtype of gradient reduce-scatter/all-reduce: fp32, bf16, fp16; null = from precision (fp32 for bf16)."""
    cpu_offload: bool = False
    """fully_sharded: keep sharded params, grads and optimizer state on the CPU (pinned on CUDA)."""
    activation_checkpointing: str = "none"
    """Recompute activations per FSDP unit (a transformer block in the LMs) in backward: none; full (every unit keeps
    only its input); selective_layer (every ac_every_k_units-th unit does); selective_op (every unit keeps its input
    and the outputs of the ops in ac_save_ops, recomputing the rest). Every backend
    (shardlab/distributed/activation_checkpointing.py)."""
    ac_every_k_units: int = 2
    """activation_checkpointing=selective_layer: checkpoint every k-th unit (k=2: half of them)."""
    ac_save_ops: list[str] = field(default_factory=lambda: ["matmul", "attention"])
    """activation_checkpointing=selective_op: the op groups whose outputs are kept: matmul (mm, addmm, bmm), attention
    (the fused attention kernels); the rest of each unit is recomputed."""
    ac_matmul_save_every: int = 1
    """activation_checkpointing=selective_op with matmul in ac_save_ops: keep the output of every n-th matmul of each
    unit's forward, counting from its first (1: all; 2: the 1st, 3rd, ..., as torchtitan's selective op policy keeps
    them), and recompute the others."""
    ac_skip_units: list[int] = field(default_factory=list)
    """Units (by index in the task's fsdp_units order; negative: from the end) that never recompute, whatever
    activation_checkpointing says; the modes choose among the others. [0, -1]: a Llama's embedding and output head,
    as torchtitan checkpoints only the transformer blocks."""
    offload_activations: bool = False
    """With activation_checkpointing=none: move saved activations to the CPU during forward."""
    prefetch_units: int = 0
    """fully_sharded: all-gather this many units ahead (forward: next, backward: previous); 0 leaves FSDP2's implicit
    prefetching. On CPU it also makes unshards asynchronous (a private FSDP2 flag, used on a tested torch only)."""
    reduce_scatter: str = "native"
    """fully_sharded: how gradients are reduce-scattered. native = the process group's reduce_scatter; all_reduce
    (CPU/gloo only, opt-in) = one all-reduce of the unit's gradient buffer, keeping the local shard, through FSDP2's
    custom-comm hook, run under the next unit's backward where nothing reads it sooner."""
    reduce_every_microbatch: bool = True
    """Gradient accumulation: reduce-scatter every micro-batch (least memory) or only the last (least traffic)."""
    wrap_min_num_params: int = 0
    """Generic wrap policy for models without a unit plan: wrap submodules holding at least this many params."""
    memory_budget_gb: float = 0.0
    """Memory one rank (or one machine, see memory_budget_per) may use, in GiB; 0 = no budget. backend=auto picks
    a layout within it; an explicit backend predicted to exceed it is refused before launch."""
    auto_tune: bool = True
    """backend=auto: measure a few real steps of each layout (and micro-batch split) predicted to fit, on the real
    ranks, and keep the fastest (shardlab/memory/autotune.py); false: the first that fits in a fixed order."""
    auto_tune_steps: int = 3
    """backend=auto with auto_tune: steps timed per candidate; the first is a warm-up and not counted."""
    auto_tune_max_trials: int = 6
    """backend=auto with auto_tune: candidates measured at most (layouts first, then the fastest one's splits)."""
    auto_tune_cache: str | None = "~/.cache/shardlab/autotune"
    """backend=auto with auto_tune: where decisions are kept for the next run of the same model, world size, device
    and torch (a requeue or resume reuses its own run's copy either way, and is never handed another run's); null:
    no cache."""
    memory_budget_per: str = "rank"
    """What memory_budget_gb covers: rank (one GPU's memory) or machine (shared by the ranks on one machine, as CPU
    ranks share its RAM)."""
    cpu_allocator: str = "auto"
    """CPU ranks only: how glibc treats freed memory. lean = return freed buffers to the OS, so resident memory tracks
    what a rank holds, as the memory plan predicts; fast = keep freed pages for the next step (faster, resident memory
    above the plan: docs/benchmarks.md "Memory versus speed on CPU"); auto = lean with a memory_budget_gb (the plan
    must hold), else fast (shardlab/memory/meter.py: configure_cpu_allocator)."""
    timeout_s: int = 600
    """Collective timeout: a dead rank fails the others after this many seconds instead of hanging forever."""
    init_timeout_s: int = 600
    """How long the ranks may take to start: to reach the master (a rank that cannot fails in one line naming the
    address, port and interface), for rank 0 to see every rank arrive (who is missing is printed every 30 s), and the
    collective timeout while they build, shard and materialize the model and the optimizer and restore; timeout_s
    applies from the first training step (checkpoint.timeout_s while checkpoints are read and written)."""
    on_lost_host: str = "requeue"
    """What a Slurm job does when a collective breaks because another host went away (its processes ended, the node
    failed): requeue (rank 0 requeues the job, which resumes from the newest complete checkpoint once Slurm has the
    nodes again) or fail (the job ends failed; rerun the same command to resume). Off Slurm the job fails either way
    (torchrun's --max-restarts restarts it)."""
    compile: bool = False
    """torch.compile (inductor) each FSDP unit of the task before it is sharded or wrapped, and the LM's loss; compiled
    in the first training step, reused from compile_cache_dir by the next run; validation runs eager
    (shardlab/distributed/compile.py, docs/compile.md)."""
    compile_cache_dir: str | None = None
    """compile: inductor's on-disk cache, shared by the ranks and later runs; null = $TORCHINDUCTOR_CACHE_DIR if set,
    else ~/.cache/shardlab/inductor."""
    compile_timeout_s: int = 1800
    """compile: the collective timeout during the first training step, while ranks compile (one may wait for a slower
    one); timeout_s applies from the second step on."""
    plan_device: str = "auto"
    """The device the memory plan is made for: auto (this machine's GPU, else its CPU), cpu, cuda (this machine's
    GPU), or a named one from any machine: h100_80gb, h200_141gb, a100_80gb, a100_40gb, l40s_48gb, mi300x
    (shardlab/memory/devices.py; a user_dir can add more). backend=auto chooses for it by the plan alone."""
    verify_plan: bool = False
    """dry_run: also apply the real fully_shard for the world size on torch's fake process group (one process,
    nothing allocated) and check the plan's per-rank state bytes and collectives against it
    (shardlab/memory/verify.py)."""


@dataclass
class EMAConfig:
    enabled: bool = False
    """Keep an exponential moving average of the model's parameters (fp32, sharded like them), saved with the training
    state; validation.ema validates with it, tools/export_hf.py --ema exports it, a teacher network reads it."""
    decay: float = 0.999
    """Weight of the old average at each update: average = decay * average + (1 - decay) * weights. With
    schedule=cosine, its value at start_step."""
    schedule: str = "constant"
    """constant, or cosine: the decay rises from decay to final_decay along a half cosine from start_step to
    optimization.max_steps (BYOL's and DINO's momentum)."""
    final_decay: float = 1.0
    """The decay at the last step under schedule=cosine (unused under constant)."""
    start_step: int = 0
    """Steps before this one copy the weights into the average instead of averaging (fairseq's ema_start_update)."""


@dataclass
class OptimizationConfig:
    max_steps: int = 1000
    """Optimizer steps to train for."""
    batch_size: int = 32
    """Samples per micro-batch over all ranks (each rank gets batch_size / data-parallel ranks)."""
    update_freq: int = 1
    """Micro-batches accumulated per optimizer step; global batch = batch_size * update_freq."""
    clip_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    max_nonfinite_steps: int = 3
    """Stop the run as failed when the loss is NaN or infinite on this many steps in a row (any rank), or at a save
    whose weights are; nothing non-finite is saved. fp16's gradient overflows, which the scaler skips, do not count."""
    ema: EMAConfig = field(default_factory=EMAConfig)
    """The moving average of the weights (optimization.ema.*)."""


@dataclass
class ValidationConfig:
    interval_steps: int = 250
    """Validate every this many steps (and always after the last); 0 = only at the end."""
    num_batches: int = 20
    """Batches per validation; 0 = the whole validation set."""
    batch_size: int = 64
    """Samples per validation batch over all ranks."""
    ema: bool = False
    """Validate with the averaged weights of optimization.ema instead of the trained ones (needs it enabled)."""


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    """Where checkpoints go, relative to the run directory."""
    save: bool = True
    """false: write no checkpoint at all, not even after the last step or on a stop signal (memory probes,
    throwaway runs); resume still reads existing ones."""
    interval_steps: int = 200
    """Save every this many steps (and after the last); 0 = only at the end."""
    interval_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (rank 0's clock, agreed by all); 0 = off."""
    keep_last: int = 2
    """Number of most recently written checkpoints kept; older ones are deleted once a newer one is complete."""
    keep_every_steps: int = 0
    """Also save at every multiple of this step and keep those milestones forever; 0 = off."""
    resume: str = "auto"
    """Where a run begins; a run that finds its own checkpoints in dir (a requeue, a rerun) always continues them.
    auto = continue whatever run dir holds; none = begin from scratch (refuses a dir holding a run that began
    elsewhere); or a step_N path to begin from (docs/checkpoints.md)."""
    async_save: bool = False
    """Stage the state in CPU memory and write it in the background (one save in flight), so training waits less."""
    save_on_error: bool = False
    """Save the last completed step when a step raises (world size 1, and only if the step had not changed the
    state yet), and make Ctrl-C an agreed stop with a save at any world size."""
    init_from: str | None = None
    """Begin a new run (step 0, fresh optimizer) from these weights: a .safetensors file or a step_N directory; a
    run that has its own checkpoints continues them instead."""
    timeout_s: int = 1800
    """The collective timeout while checkpoints are saved, loaded, published and pruned (a rank writing, reading or
    deleting slowly on a busy file system waits this long, not distributed.timeout_s); never shorter than that."""


@dataclass
class WandbConfig:
    enabled: bool = False
    """Log to Weights & Biases from rank 0, beside TensorBoard (needs pip install -e '.[wandb]'; docs/tracking.md)."""
    project: str = "shardlab"
    """The W&B project the run goes to."""
    entity: str | None = None
    """The W&B team or user; None: your default entity."""
    name: str | None = None
    """The run's display name; None: the run folder's name."""
    group: str | None = None
    """The run's group; None: a sweep's points are grouped by the sweep folder's name, a single run has none."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""
    mode: str = "online"
    """online (offline when W&B cannot be reached, with the command that uploads it later) or offline."""


@dataclass
class MlflowConfig:
    enabled: bool = False
    """Log to MLflow from rank 0, beside TensorBoard (needs pip install -e '.[mlflow]'; docs/tracking.md)."""
    tracking_uri: str | None = None
    """Where runs go: http(s)://host:port or a database (sqlite:///path.db); None: MLFLOW_TRACKING_URI, else MLflow's
    default (sqlite:///mlflow.db in the working directory)."""
    experiment: str | None = None
    """The experiment; None: a sweep's points share one named by the sweep folder, a single run goes to 'shardlab'."""
    run_name: str | None = None
    """The run's name; None: the run folder's name."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags of the run (key: value), e.g. +logging.mlflow.tags.team=nlp."""


@dataclass
class LoggingConfig:
    interval_steps: int = 50
    """Print a log line and write TensorBoard scalars every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run dir>/tensorboard."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases (shardlab/logging/trackers.py)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow (shardlab/logging/trackers.py)."""


@dataclass
class TrainConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: Any = MISSING
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: Any = MISSING
    seed: int = 1
    """Seeds parameter init, data order and dropout; the same seed gives the same run on any world size."""
    dry_run: bool = False
    """Build the model on the meta device, print its size and the sharding plan, and exit without allocating."""
    user_dir: str | None = None
    """A folder of your own plug-ins (tasks, models, optimizers, schedules) and their conf/, imported before the config
    composes (shardlab/registry/user_dir.py; docs/tutorial.md). Command line only; recorded as an absolute path."""


# ---- the options of each config group (conf/<group>/<option>.yaml) --------------------------------------------------
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def group_options(group: str, user_conf: Path | None = None) -> list[str]:
    """The options of conf/<group> (and of a user_dir's conf/<group>)."""
    return sorted(p.stem for conf in (CONF_DIR, user_conf) if conf for p in (conf / group).glob("*.yaml"))


def option_package(group: str, option: str) -> str | None:
    """The task plug-in package (e.g. ``tasks.lm``) whose schema conf/<group>/<option>.yaml builds on, if any."""
    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        return None
    for entry in OmegaConf.load(path).get("defaults", []):
        if isinstance(entry, str) and entry.startswith("/schema/"):
            node = ConfigStore.instance().load(f"schema/{entry.removeprefix('/schema/').split('@')[0]}.yaml").node
            return OmegaConf.get_type(node).__module__.rpartition(".")[0]
    return None


def options_of(group: str, package: str) -> list[str]:
    """The conf/<group> options of one task plug-in package."""
    return [option for option in group_options(group) if option_package(group, option) == package]


def task_default_options(task: str) -> dict[str, str]:
    """The options conf/task/<task>.yaml picks for the other groups (e.g. {"model": "regnet_cifar"}); {} without one."""
    path = CONF_DIR / "task" / f"{task}.yaml"
    if "," in task or not path.is_file():
        return {}
    defaults = {}
    for entry in OmegaConf.load(path).get("defaults", []):
        if isinstance(entry, DictConfig):
            defaults.update({k.removeprefix("override /"): v for k, v in entry.items()})
    return defaults


def task_section_package(task: str, group: str) -> str | None:
    """The plug-in package whose ``group`` schema a task reads: that of the option its conf/task file picks (SwAV
    reads the vision task's model and its own data), or None where the task's conf does not say."""
    option = task_default_options(task).get(group)
    return option_package(group, option) if option else None


def register_schemas() -> None:
    """The run's schema and the distributed section's; the schemas of tasks, models, optimizers and schedules come
    with their registration (shardlab.registry)."""
    from shardlab.jobs.run_dir import register_resolvers

    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=TrainConfig)
    cs.store(group="schema", name="distributed", node=DistributedConfig)


DTYPES = ("fp32", "bf16", "fp16")


def validate(cfg: Any, world_size: int | None = None, num_cuda_devices: int = 0) -> None:
    """Check ranges and cross-field rules of the generic sections; raise one ConfigError listing all problems.

    ``world_size`` is the job's (from the launcher, else distributed.world_size); invalid flag combinations are
    caught here, before any process starts or any memory is allocated.
    """
    errors: list[str] = []

    def check(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    nonfinite = nonfinite_errors(cfg)
    if nonfinite:  # alone: the range checks below would only repeat them (NaN fails every comparison, inf passes >)
        raise ConfigError("; ".join(nonfinite))
    o, opt, sch, d = cfg.optimization, cfg.optimizer, cfg.lr_scheduler, cfg.distributed
    check(o.max_steps > 0, f"optimization.max_steps must be > 0, got {o.max_steps}")
    check(
        o.max_nonfinite_steps >= 1,
        f"optimization.max_nonfinite_steps must be >= 1, got {o.max_nonfinite_steps}",
    )
    check(o.batch_size > 0, f"optimization.batch_size must be > 0, got {o.batch_size}")
    check(o.update_freq > 0, f"optimization.update_freq must be >= 1, got {o.update_freq}")
    check(o.clip_norm >= 0, f"optimization.clip_norm must be >= 0 (0 disables), got {o.clip_norm}")
    check(opt.lr > 0, f"optimizer.lr must be > 0, got {opt.lr}")
    check(opt.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}")
    check(opt.trust_coefficient > 0, f"optimizer.trust_coefficient must be > 0, got {opt.trust_coefficient}")
    check(opt.eps > 0, f"optimizer.eps must be > 0 (it keeps a denominator off zero), got {opt.eps}")
    check(0 <= opt.momentum < 1, f"optimizer.momentum must be in [0, 1), got {opt.momentum}")
    check(
        len(opt.betas) == 2 and all(0 <= b < 1 for b in opt.betas),
        f"optimizer.betas must be two numbers in [0, 1), got {list(opt.betas)}",
    )
    check(
        opt.implementation in ("auto", "fused", "foreach", "loop"),
        f"optimizer.implementation must be auto, fused, foreach or loop, got '{opt.implementation}'",
    )
    check(sch.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {sch.warmup_steps}")
    check(
        sch.warmup_steps <= o.max_steps,
        f"lr_scheduler.warmup_steps ({sch.warmup_steps}) must not exceed optimization.max_steps ({o.max_steps})",
    )
    check(0 <= sch.min_lr_ratio <= 1, f"lr_scheduler.min_lr_ratio must be in [0, 1], got {sch.min_lr_ratio}")
    check(cfg.validation.interval_steps >= 0, "validation.interval_steps must be >= 0")
    check(cfg.validation.num_batches >= 0, "validation.num_batches must be >= 0")
    check(cfg.validation.batch_size > 0, f"validation.batch_size must be > 0, got {cfg.validation.batch_size}")
    errors += ema_errors(cfg)
    check(cfg.checkpoint.interval_steps >= 0, "checkpoint.interval_steps must be >= 0")
    check(cfg.checkpoint.timeout_s > 0, f"checkpoint.timeout_s must be > 0, got {cfg.checkpoint.timeout_s}")
    check(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}")
    check(
        cfg.checkpoint.interval_minutes >= 0,
        f"checkpoint.interval_minutes must be >= 0, got {cfg.checkpoint.interval_minutes}",
    )
    check(
        cfg.checkpoint.keep_every_steps >= 0,
        f"checkpoint.keep_every_steps must be >= 0, got {cfg.checkpoint.keep_every_steps}",
    )
    check(cfg.logging.interval_steps > 0, f"logging.interval_steps must be > 0, got {cfg.logging.interval_steps}")
    check(d.world_size >= 1, f"distributed.world_size must be >= 1, got {d.world_size}")
    check(d.timeout_s > 0, f"distributed.timeout_s must be > 0, got {d.timeout_s}")
    check(d.compile_timeout_s > 0, f"distributed.compile_timeout_s must be > 0, got {d.compile_timeout_s}")
    check(d.init_timeout_s > 0, f"distributed.init_timeout_s must be > 0, got {d.init_timeout_s}")
    check(d.memory_budget_gb >= 0, f"distributed.memory_budget_gb must be >= 0 (0 = none), got {d.memory_budget_gb}")
    check(
        d.cpu_allocator in ("auto", "lean", "fast"),
        f"distributed.cpu_allocator must be auto, lean or fast, got '{d.cpu_allocator}'",
    )
    check(
        d.memory_budget_per in ("rank", "machine"),
        f"distributed.memory_budget_per must be rank or machine, got '{d.memory_budget_per}'",
    )
    check(
        d.on_lost_host in ("requeue", "fail"),
        f"distributed.on_lost_host must be requeue or fail, got '{d.on_lost_host}'",
    )
    check(
        d.backend != "auto" or d.memory_budget_gb > 0,
        "distributed.backend=auto chooses a layout to fit distributed.memory_budget_gb; set it (GiB per rank)",
    )
    check(d.auto_tune_steps >= 2, f"distributed.auto_tune_steps must be >= 2 (one warm-up), got {d.auto_tune_steps}")
    check(d.auto_tune_max_trials >= 1, f"distributed.auto_tune_max_trials must be >= 1, got {d.auto_tune_max_trials}")
    check(d.prefetch_units >= 0, f"distributed.prefetch_units must be >= 0, got {d.prefetch_units}")
    check(
        d.reduce_scatter in ("native", "all_reduce"),
        f"distributed.reduce_scatter must be native or all_reduce, got '{d.reduce_scatter}'",
    )
    check(
        d.precision in (*DTYPES, "auto"),
        f"distributed.precision must be one of {', '.join(DTYPES)}, auto, got '{d.precision}'",
    )
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(d, key)
        check(value is None or value in DTYPES, f"distributed.{key} must be one of {', '.join(DTYPES)}, got '{value}'")
    errors += checkpointing_errors(d)
    errors += plan_device_errors(cfg)
    errors += tracker_errors(cfg.logging)
    errors += distributed_errors(cfg, world_size or d.world_size, num_cuda_devices)
    errors += unknown_key_errors(cfg)
    if errors:
        raise ConfigError("; ".join(errors))


def ema_errors(cfg: Any) -> list[str]:
    """optimization.ema's ranges, and validation.ema without it."""
    ema, errors = cfg.optimization.ema, []
    for key in ("decay", "final_decay"):
        if not 0 <= getattr(ema, key) <= 1:
            errors.append(f"optimization.ema.{key} must be in [0, 1], got {getattr(ema, key)}")
    if ema.schedule not in ("constant", "cosine"):
        errors.append(f"optimization.ema.schedule must be constant or cosine, got '{ema.schedule}'")
    if ema.start_step < 0:
        errors.append(f"optimization.ema.start_step must be >= 0, got {ema.start_step}")
    if cfg.validation.ema and not ema.enabled:
        errors.append(
            "validation.ema validates with the average of optimization.ema; set optimization.ema.enabled=true"
        )
    return errors


def checkpointing_errors(d: Any) -> list[str]:
    """distributed.activation_checkpointing and its keys (``d``: the distributed section)."""
    from shardlab.distributed.activation_checkpointing import MODES, SAVE_OP_GROUPS

    mode, errors = d.activation_checkpointing, []
    if mode not in MODES:
        errors.append(f"distributed.activation_checkpointing must be one of {', '.join(MODES)}, got '{mode}'")
    if d.ac_every_k_units < 2:
        errors.append(
            f"distributed.ac_every_k_units must be >= 2, got {d.ac_every_k_units}; every unit (k=1) is "
            "activation_checkpointing=full"
        )
    unknown = [g for g in d.ac_save_ops if g not in SAVE_OP_GROUPS]
    if unknown or not d.ac_save_ops:
        errors.append(
            f"distributed.ac_save_ops must be a non-empty list of {', '.join(SAVE_OP_GROUPS)}, "
            f"got {list(d.ac_save_ops)}"
        )
    if d.ac_matmul_save_every < 1:
        errors.append(
            f"distributed.ac_matmul_save_every must be >= 1 (1 keeps every matmul), got {d.ac_matmul_save_every}"
        )
    elif d.ac_matmul_save_every > 1 and "matmul" not in d.ac_save_ops:
        errors.append(
            f"distributed.ac_matmul_save_every={d.ac_matmul_save_every} thins the kept matmul outputs, but "
            f"distributed.ac_save_ops={list(d.ac_save_ops)} keeps none; add matmul to ac_save_ops or drop it"
        )
    defaults = DistributedConfig()
    for key, needs in (
        ("ac_every_k_units", "selective_layer"),
        ("ac_save_ops", "selective_op"),
        ("ac_matmul_save_every", "selective_op"),
    ):
        if getattr(d, key) != getattr(defaults, key) and mode != needs:
            errors.append(
                f"distributed.{key} applies to activation_checkpointing={needs} only (it is {mode}); drop it or set "
                f"distributed.activation_checkpointing={needs}"
            )
    if list(d.ac_skip_units) and mode == "none":
        errors.append(
            "distributed.ac_skip_units leaves units out of activation checkpointing, which is off "
            "(activation_checkpointing=none); drop it or choose a mode"
        )
    return errors


TRACKER_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker imports (logging.<tracker>.enabled), by the name of the extra that installs it."""


def tracker_errors(log_cfg: Any) -> list[str]:
    """An enabled tracker must be installed (found, not imported: its import takes seconds) and its mode known."""
    import importlib.util

    errors = []
    for extra, module in TRACKER_MODULES.items():
        section = log_cfg.get(extra)  # .get: configs recorded before the trackers existed lack them
        if section is not None and section.enabled and importlib.util.find_spec(module) is None:
            errors.append(
                f"logging.{extra}.enabled needs the {module} package, which is not installed; "
                f"pip install -e '.[{extra}]' or drop logging.{extra}.enabled"
            )
    mode = log_cfg.get("wandb", {}).get("mode", "online")
    if mode not in ("online", "offline"):
        errors.append(f"logging.wandb.mode must be online or offline, got '{mode}'")
    uri = log_cfg.get("mlflow", {}).get("tracking_uri")
    if uri is not None and "://" not in uri and not uri.startswith("databricks"):
        # a bare path is MLflow's folder store, which MLflow 3 refuses (in maintenance mode) at the first call
        errors.append(
            f"logging.mlflow.tracking_uri must be a URI (http(s)://host:port, sqlite:///path.db), got '{uri}'; for a "
            f"local store use sqlite:///{uri.rstrip('/')}.db"
        )
    return errors


def nonfinite_errors(cfg: Any) -> list[str]:
    """Every number of the config (all sections, plug-ins' included, lists too) that is NaN or infinite, by dotted
    key. Range checks let them through: ``lr > 0`` holds for inf, and optimizer.lr=inf trained a NaN loss from step 2
    and ended "completed" with a NaN checkpoint. No shardlab setting means infinity (0 is "off" where one can be)."""
    import math

    errors: list[str] = []

    def visit(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if f"{key}{k}" != "hydra":  # Hydra's own node: Hydra checks it
                    visit(v, f"{key}{k}.")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                visit(v, f"{key[:-1]}[{i}].")
        elif isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{key[:-1]} must be a finite number, got {value}; give a finite value")

    visit(OmegaConf.to_container(cfg, resolve=False), "")  # an interpolation repeats a value checked where it is set
    return errors


def plan_device_errors(cfg: Any) -> list[str]:
    """distributed.plan_device must name a device of shardlab.memory.devices; verify_plan needs a dry run."""
    from shardlab.memory import devices

    d, errors = cfg.distributed, []
    if d.plan_device not in devices.known():
        errors.append(devices.unknown_device_message(d.plan_device))
    if d.verify_plan and not cfg.dry_run:
        errors.append("distributed.verify_plan checks the plan of a dry run; add dry_run=true")
    return errors


def path_errors(cfg: Any, run_dir: str | os.PathLike, keep_run_dir: bool = False) -> list[str]:
    """The run directory and ``<run dir>/<checkpoint.dir>`` must be directories this process can create and write
    in, so a bad path stops the run before its first step, not at its first save. Checked by doing it: each is
    created (with its missing parents), a file is written and removed in it, and what the check created is removed
    again - permission bits say nothing of read-only mounts, /proc, or a root user (who passes every access check).
    ``keep_run_dir``: the run directory (and parents) the check made stay, for a rank of a job whose other ranks may
    already be starting in it (removing it under them fails their log file's open)."""
    checks = (
        ("hydra.run.dir", Path(run_dir), keep_run_dir),
        ("checkpoint.dir", Path(run_dir) / cfg.checkpoint.dir, False),
    )
    for key, path, keep in checks:
        problem = writable_dir_problem(path.expanduser().absolute(), keep=keep)
        if problem:
            # The checkpoint directory usually lives inside the run directory: one message is enough.
            return [f"{key}: cannot create or write {path} ({problem}); choose a writable directory"]
    return []


def writable_dir_problem(path: Path, attempts: int = 20, keep: bool = False) -> str | None:
    """Why ``path`` cannot be created as a directory and written in, or None; leaves the filesystem as it was, unless
    ``keep``: then the directories it made stay.

    Every rank of a job checks the same run directory at once, and one rank's clean-up may remove a directory
    another has just made or found: "no such file or directory" (under /proc the answer) and "file exists" are tried
    again."""
    problem = None
    for _ in range(attempts):
        problem, vanished = _writable_dir_problem(path, keep)
        if not vanished:
            break
    return problem


def _writable_dir_problem(path: Path, keep: bool) -> tuple[str | None, bool]:
    """One try of writable_dir_problem: (the problem or None, whether a directory was missing that may come back)."""
    missing = []
    existing = path
    while True:
        try:  # one stat per path: an exists() then an is_dir() may see another rank remove and remake it between
            mode = existing.stat().st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            missing.append(existing)
            existing = existing.parent
    if not stat.S_ISDIR(mode):
        return f"{existing} is a file, not a directory", False
    step = "creating it"
    try:
        path.mkdir(parents=True, exist_ok=True)
        step = "writing a file in it"
        fd, probe = tempfile.mkstemp(prefix=".shardlab-write-test-", dir=path)  # a name no other rank uses
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        # Path.mkdir(exist_ok=True) says "exists" where the directory went between its mkdir and its is_dir
        return f"{step} failed: {e.strerror or e}", isinstance(e, (FileNotFoundError, FileExistsError))
    finally:
        for created in [] if keep else missing:  # deepest first; one another process filled meanwhile stays
            try:
                created.rmdir()
            except OSError:
                break
    return None, False


def unknown_key_errors(cfg: Any) -> list[str]:
    """Keys the schemas do not declare. Hydra rejects a mistyped ``key=value`` itself, but a ``+key=value`` is added
    to the config unchecked, and nothing would ever read it."""
    from omegaconf import DictConfig, OmegaConf

    errors: list[str] = []

    def visit(node: DictConfig, prefix: str) -> None:
        schema = OmegaConf.get_type(node)
        fields = getattr(schema, "__dataclass_fields__", None)
        for key in node:
            dotted = f"{prefix}{key}"
            if dotted == "hydra":  # Hydra's own node (in the config a Hydra callback checks): Hydra checks it
                continue
            if fields is not None and key not in fields:
                known = ", ".join(name for name in fields if not name.startswith("_"))
                errors.append(
                    f"{dotted} is not a known key of {prefix.rstrip('.') or 'the config'} (known: {known}); drop "
                    f"+{dotted}"
                )
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
                visit(child, f"{dotted}.")

    visit(cfg, "")
    return errors


def distributed_errors(cfg: Any, world: int, num_cuda_devices: int) -> list[str]:
    """Flag combinations that cannot work (or silently would not do what they say)."""
    d, errors = cfg.distributed, []
    sharded = d.backend in ("fully_sharded", "auto")  # auto keeps fully_sharded knobs (and then shards)
    if world > 1 and cfg.optimization.batch_size % world:
        errors.append(
            f"optimization.batch_size ({cfg.optimization.batch_size}) must be divisible by the world size "
            f"({world}): it is the global micro-batch, split evenly over the ranks"
        )
    if world > 1 and cfg.validation.batch_size % world:
        errors.append(
            f"validation.batch_size ({cfg.validation.batch_size}) must be divisible by the world size ({world})"
        )
    if sharded and d.sharding_degree != -1 and (d.sharding_degree < 1 or world % d.sharding_degree):
        errors.append(
            f"distributed.sharding_degree ({d.sharding_degree}) must divide the world size ({world}); "
            "use -1 for all ranks"
        )
    defaults = DistributedConfig()
    for key in ("sharding_degree", "prefetch_units", "reduce_scatter", "reshard_after_forward", "wrap_min_num_params"):
        if not sharded and getattr(d, key) != getattr(defaults, key):
            errors.append(
                f"distributed.{key} applies to fully_sharded only (backend is {d.backend}); drop it or set "
                "distributed.backend=fully_sharded"
            )
    if d.backend == "single" and d.reduce_dtype is not None:
        errors.append("distributed.reduce_dtype: one process reduces no gradients; drop it or use ddp / fully_sharded")
    if d.backend == "single" and not d.reduce_every_microbatch:
        errors.append("distributed.reduce_every_microbatch: one process reduces no gradients; drop it")
    if d.reduce_scatter == "all_reduce" and num_cuda_devices:
        errors.append(
            "distributed.reduce_scatter=all_reduce is a gloo (CPU) workaround; NCCL's reduce-scatter moves half an "
            "all-reduce's bytes: use native"
        )
    if d.backend == "auto":
        for key in ("sharding_degree", "reshard_after_forward", "cpu_offload", "activation_checkpointing"):
            if getattr(d, key) != getattr(defaults, key):
                errors.append(
                    f"distributed.{key} is what distributed.backend=auto chooses; drop it or pick the backend yourself"
                )
    if d.cpu_offload and not sharded:
        errors.append(f"distributed.cpu_offload needs distributed.backend=fully_sharded (backend is {d.backend})")
    if cfg.optimizer.name == "cpu_adam" and not d.cpu_offload and num_cuda_devices > 0:
        errors.append(
            "optimizer=cpu_adam steps parameters on the CPU, but they live on the GPU; set "
            "distributed.cpu_offload=true or use optimizer=adamw"
        )
    if d.offload_activations and d.activation_checkpointing != "none":
        errors.append(
            f"distributed.offload_activations and activation_checkpointing={d.activation_checkpointing} both shrink "
            "activation memory; choose one"
        )
    dtypes = {d.param_dtype or d.precision, d.reduce_dtype or d.precision}
    if {"fp16", "bf16"} <= dtypes:
        errors.append("distributed.param_dtype and reduce_dtype mix fp16 and bf16; use one low-precision format")
    if num_cuda_devices and d.backend != "single" and world > num_cuda_devices and d.world_size > 1:
        errors.append(f"distributed.world_size ({world}) exceeds the {num_cuda_devices} visible CUDA devices")
    if d.backend == "single" and d.world_size > 1:
        errors.append(f"distributed.world_size={d.world_size} needs distributed.backend=ddp or fully_sharded")
    return errors
