"""Typed config sections (Hydra structured configs): the schemas, each key's type, docstring, choices and range.

Every section is a dataclass registered in Hydra's ConfigStore as a schema (here, or with its factory through
shardlab.registry), so Hydra itself rejects an override with a typo in its key or a value of the wrong type. The
defaults a run starts from are conf/*.yaml's.

One place per key: a key with a fixed set of values declares them beside its field (``choice``), a number its range
(``bounded``), and ``field_errors`` - one generic walker over the composed config, schemas of task plug-ins and
user_dirs included - refuses every value outside them, each in one line naming the dotted key and listing the valid
values. shardlab.cli.checks runs it first on every composed config, before any other check (the pre-flight: before
a folder, lock or process exists), and keeps only the rules that span sections or need the world and the device.

Why metadata and not ``Enum`` fields: OmegaConf (2.3) has no ``Literal``, and its EnumNode matches a string by the
member's *name* and hands ``Enum`` members to every reader: the names would have to be the yaml values ('1f1b' is no
Python identifier), and each reader (string comparisons, f-strings, JSON and YAML writers of the run record and of
shardlab.json, the run folder's name) would get a ``str`` subclass or an ``Enum`` where it gets a ``str`` today. The
ranges need a walker over the composed config anyway (OmegaConf has no bounds), so choices and ranges are one
mechanism, and the values stay plain ``str``: the saved config.yaml, shardlab.json, the run folder's name and a
requeue's re-composition read exactly as before.

Keys that name a registry entry (task.name, model.arch, optimizer.name, lr_scheduler.name, distributed.backend,
distributed.plan_device) are open sets that plug-ins extend: ``registry_name`` marks them, and shardlab.cli.checks
checks them against the registry, listing the names it knows.
"""

from __future__ import annotations

import dataclasses
import math
import pkgutil
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
"""The range bounds ``bounded`` takes, and how a message writes each."""


def choice(default: Any, choices: Sequence[str], refused: dict[str, str] | None = None, **kwargs: Any) -> Any:
    """A field whose value (or each of whose list's values) must be one of ``choices``; null passes where the type
    allows it. ``refused``: values a user may reach for, each with why it is not offered (said in the error).
    ``kwargs`` go to ``bounded`` (a list's ``length``/``nonempty``)."""
    return bounded(default, choices=tuple(choices), refused=refused or {}, **kwargs)


def bounded(default: Any = MISSING, factory: Callable[[], Any] | None = None, note: str = "", fix: str = "",
            **limits: Any) -> Any:  # fmt: skip
    """A field with a range: any of gt, ge, lt, le (a list's values each), ``length`` (a list's exact length) or
    ``nonempty``; ``note`` is said beside the range ("(0 = off)"), ``fix`` after the value. Null passes."""
    unknown = set(limits) - {*BOUNDS, "length", "nonempty", "choices", "refused"}
    assert not unknown, f"bounded() takes no {unknown}"  # a schema's own mistake, found at import
    metadata = {**limits, "note": note, "fix": fix}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def registry_name(default: Any, registry: str) -> Any:
    """A field naming an entry of ``registry`` (a name in shardlab.registry: TASKS, MODELS, ...), an open set that
    plug-ins extend: checked against the registry by shardlab.cli.checks, not here."""
    return field(default=default, metadata={"registry": registry})


DTYPES = ("fp32", "bf16", "fp16")
"""The values of distributed.param_dtype and reduce_dtype (precision adds auto)."""
AC_MODES = ("none", "full", "selective_layer", "selective_op")
"""The values of distributed.activation_checkpointing (shardlab/distributed/activation_checkpointing.py)."""
AC_SAVE_OP_GROUPS = ("matmul", "attention")
"""The op groups distributed.ac_save_ops names (activation_checkpointing.SAVE_OP_GROUPS maps them to ops)."""
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""The schedules distributed.pipeline_schedule offers (shardlab/distributed/pipeline.py maps them to torch's)."""
UNOFFERED_SCHEDULES = dict.fromkeys(
    ("interleaved_zero_bubble", "zbv_zero_bubble"),
    "its forward-only pass fails in torch 2.14, so validation cannot run through it",
)
"""Schedules torch ships that distributed.pipeline_schedule refuses, and why."""


@dataclass
class TaskConfig:
    name: str = registry_name(MISSING, "TASKS")
    """A name in TASKS: lm, image_classification, swav, simclr."""


@dataclass
class OptimizerConfig:
    name: str = registry_name("adamw", "OPTIMIZERS")
    """A name in OPTIMIZERS: adamw, sgd, cpu_adam, lars."""
    lr: float = bounded(1e-3, gt=0)
    """Peak learning rate (reached after warmup)."""
    weight_decay: float = bounded(0.0, ge=0)
    """Decoupled weight decay; applied to matrices/kernels only when exclude_norm_and_bias is true."""
    exclude_norm_and_bias: bool = True
    """Put norm weights and biases (1-D params) in a group without weight decay."""
    betas: list[float] = bounded(factory=lambda: [0.9, 0.95], ge=0, lt=1, length=2)
    """Adam betas (adamw, cpu_adam)."""
    eps: float = bounded(1e-8, gt=0, note="it keeps a denominator off zero")
    """Adam epsilon (adamw, cpu_adam); lars: added to the trust ratio's denominator."""
    implementation: str = choice("auto", ("auto", "fused", "foreach", "loop"))
    """Adam kernel: auto (fused where supported: ~7x faster on CPU than the per-tensor loop), fused, foreach, loop."""
    momentum: float = bounded(0.9, ge=0, lt=1)
    """SGD and LARS momentum."""
    nesterov: bool = True
    """SGD and LARS Nesterov momentum."""
    trust_coefficient: float = bounded(1e-3, gt=0)
    """lars: eta of the trust ratio eta * |w| / (|g| + weight_decay * |w| + eps) that scales each weight's step."""


@dataclass
class LRSchedulerConfig:
    name: str = registry_name("cosine", "LR_SCHEDULERS")
    """A name in LR_SCHEDULERS: cosine, inverse_sqrt, constant."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear warmup from ~0 to optimizer.lr over this many steps (at most optimization.max_steps: clipped, said so)."""
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    """cosine: the final lr as a fraction of the peak."""


@dataclass
class DistributedConfig:
    backend: str = registry_name("single", "BACKENDS")
    """A name in BACKENDS: single, ddp, fully_sharded; or auto: the fastest layout the memory plan predicts to fit
    memory_budget_gb (shardlab/memory/budget.py)."""
    world_size: int = bounded(1, ge=1)
    """The ranks shardlab starts itself: on this machine when no launcher started this process, or in each task of a
    Slurm job with fewer tasks than this (one task per node, each starting world_size / tasks ranks). torchrun, and a
    Slurm job of one task per rank, set the world themselves."""
    sharding_degree: int = -1
    """fully_sharded: ranks a parameter is sharded over (FSDP paper's F). -1 = all data-parallel ranks (world size
    / (tensor x pipeline x context degrees)); 1 <= F < those = hybrid."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's matrices are split over (Megatron-style column/row-wise linears with sequence-parallel norms,
    through torch's parallelize_module); 1 = off. Must divide the heads, KV heads, FFN width and vocabulary. The
    innermost mesh dimension: kept inside one host by default (shardlab/distributed/mesh.py)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages (groups of consecutive layers), each on its own ranks (torch.distributed.pipelining); 1 = off.
    The outermost mesh dimension."""
    pipeline_schedule: str = choice("1f1b", PIPELINE_SCHEDULES, refused=UNOFFERED_SCHEDULES)
    """pipeline_parallel_degree > 1: the schedule torch ships: gpipe, 1f1b (optimization.update_freq >= stages) or
    interleaved_1f1b (needs pipeline_stages_per_rank >= 2); each of update_freq's micro-batches is one pipeline
    micro-batch. Not the zero-bubble ones: torch 2.14's forward-only pass through them fails (validation)."""
    pipeline_stages_per_rank: int = 1
    """pipeline_parallel_degree > 1: model stages each pipeline rank holds (2+ for the interleaved schedules)."""
    context_parallel_degree: int = 1
    """Ranks each sequence is split over, attention run as a ring over them (torch's context_parallel; CUDA only;
    fully_sharded, which then shards over data-shard x context ranks); data.seq_len must divide by 2 x it; 1 = off."""
    context_parallel_rotate_method: str = choice("allgather", ("allgather", "alltoall"))
    """context_parallel_degree > 1: how the ring passes key/value chunks: allgather (once per attention) or alltoall."""
    expert_parallel_degree: int = 1
    """Ranks an MoE layer's routed experts are split over (each holds num_experts / degree of them; tokens travel to
    them and back by all-to-all); 1 = off. Borrowed from the data-sharding ranks, as torchtitan's: must divide
    them (fully_sharded), FSDP2 shards each expert over the data ranks outside its group (shardlab/distributed/
    expert_parallel.py)."""
    async_tensor_parallel: bool = False
    """tensor_parallel_degree > 1 on CUDA: overlap TP's collectives with the matmuls (torch's async TP)."""
    loss_parallel: bool = True
    """tensor_parallel_degree > 1: the LM's head leaves its logits split over the vocabulary and the cross-entropy
    runs on the splits (torch's loss_parallel), never gathering (tokens x vocabulary) logits; false gathers them."""
    reshard_after_forward: bool = True
    """fully_sharded: free gathered params after forward (ZeRO-3); false keeps them until backward (ZeRO-2-like)."""
    precision: str = choice("fp32", (*DTYPES, "auto"))
    """Shorthand for param_dtype/reduce_dtype: fp32, bf16, fp16 (fp16 adds a gradient scaler), or auto: bf16 where this
    machine's bf16 matmuls are measurably faster than fp32, else fp32 (measured once per machine, cached in
    precision_cache, the same on every rank: shardlab/distributed/precision.py)."""
    precision_cache: str | None = "~/.cache/shardlab/precision"
    """precision=auto: where each machine's measured bf16 and fp32 matmul rates are kept (keyed by CPU, GPU and
    torch); null: measure in every run."""
    param_dtype: str | None = choice(None, DTYPES)
    """Compute dtype of gathered params: fp32, bf16, fp16; null = from precision."""
    reduce_dtype: str | None = choice(None, DTYPES)
    """Dtype of gradient reduce-scatter/all-reduce: fp32, bf16, fp16; null = from precision (fp32 for bf16)."""
    cpu_offload: bool = False
    """fully_sharded: keep sharded params, grads and optimizer state on the CPU (pinned on CUDA)."""
    activation_checkpointing: str = choice("none", AC_MODES)
    """Recompute activations per FSDP unit (a transformer block in the LMs) in backward: none; full (every unit keeps
    only its input); selective_layer (every ac_every_k_units-th unit does); selective_op (every unit keeps its input
    and the outputs of the ops in ac_save_ops, recomputing the rest). Every backend
    (shardlab/distributed/activation_checkpointing.py)."""
    ac_every_k_units: int = bounded(2, ge=2, fix="every unit (k=1) is activation_checkpointing=full")
    """activation_checkpointing=selective_layer: checkpoint every k-th unit (k=2: half of them)."""
    ac_save_ops: list[str] = choice(MISSING, AC_SAVE_OP_GROUPS, factory=lambda: ["matmul", "attention"], nonempty=True)
    """activation_checkpointing=selective_op: the op groups whose outputs are kept: matmul (mm, addmm, bmm), attention
    (the fused attention kernels); the rest of each unit is recomputed."""
    ac_matmul_save_every: int = bounded(1, ge=1, note="1 keeps every matmul")
    """activation_checkpointing=selective_op with matmul in ac_save_ops: keep the output of every n-th matmul of each
    unit's forward, counting from its first (1: all; 2: the 1st, 3rd, ..., as torchtitan's selective op policy keeps
    them), and recompute the others."""
    ac_skip_units: list[int] = field(default_factory=list)
    """Units (by index in the task's fsdp_units order; negative: from the end) that never recompute, whatever
    activation_checkpointing says; the modes choose among the others. [0, -1]: a Llama's embedding and output head,
    as torchtitan checkpoints only the transformer blocks."""
    offload_activations: bool = False
    """With activation_checkpointing=none: move saved activations to the CPU during forward."""
    prefetch_units: int = bounded(0, ge=0)
    """fully_sharded: all-gather this many units ahead (forward: next, backward: previous); 0 leaves FSDP2's implicit
    prefetching. On CPU it also makes unshards asynchronous (a private FSDP2 flag, used on a tested torch only)."""
    reduce_scatter: str = choice("native", ("native", "all_reduce"))
    """fully_sharded: how gradients are reduce-scattered. native = the process group's reduce_scatter; all_reduce
    (CPU/gloo only, opt-in) = one all-reduce of the unit's gradient buffer, keeping the local shard, through FSDP2's
    custom-comm hook, run under the next unit's backward where nothing reads it sooner."""
    reduce_every_microbatch: bool = True
    """Gradient accumulation: reduce-scatter every micro-batch (least memory) or only the last (least traffic)."""
    wrap_min_num_params: int = 0
    """Generic wrap policy for models without a unit plan: wrap submodules holding at least this many params."""
    memory_budget_gb: float = bounded(0.0, ge=0, note="0 = none")
    """Memory one rank (or one machine, see memory_budget_per) may use, in GiB; 0 = no budget. backend=auto picks
    a layout within it; an explicit backend predicted to exceed it is refused before launch."""
    auto_tune: bool = True
    """backend=auto: measure a few real steps of each layout (and micro-batch split) predicted to fit, on the real
    ranks, and keep the fastest (shardlab/runner/autotune.py); false: the first that fits in a fixed order."""
    auto_tune_steps: int = bounded(3, ge=2, note="one warm-up")
    """backend=auto with auto_tune: steps timed per candidate; the first is a warm-up and not counted."""
    auto_tune_max_trials: int = bounded(6, ge=1)
    """backend=auto with auto_tune: candidates measured at most (layouts first, then the fastest one's splits)."""
    auto_tune_cache: str | None = "~/.cache/shardlab/autotune"
    """backend=auto with auto_tune: where decisions are kept for the next run of the same model, world size, device
    and torch (a requeue or resume reuses its own run's copy either way, and is never handed another run's); null:
    no cache."""
    memory_budget_per: str = choice("rank", ("rank", "machine"))
    """What memory_budget_gb covers: rank (one GPU's memory) or machine (shared by the ranks on one machine, as CPU
    ranks share its RAM)."""
    cpu_allocator: str = choice("auto", ("auto", "lean", "fast"))
    """CPU ranks only: how glibc treats freed memory. lean = return freed buffers to the OS, so resident memory tracks
    what a rank holds, as the memory plan predicts; fast = keep freed pages for the next step (faster, resident memory
    above the plan: docs/benchmarks.md "Memory versus speed on CPU"); auto = lean with a memory_budget_gb (the plan
    must hold), else fast (shardlab/distributed/cpu_allocator.py)."""
    timeout_s: int = bounded(600, gt=0)
    """Collective timeout: a dead rank fails the others after this many seconds instead of hanging forever."""
    init_timeout_s: int = bounded(600, gt=0)
    """How long the ranks may take to start: to reach the master (a rank that cannot fails in one line naming the
    address, port and interface), for rank 0 to see every rank arrive (who is missing is printed every 30 s), and the
    collective timeout while they build, shard and materialize the model and the optimizer and restore; timeout_s
    applies from the first training step (checkpoint.timeout_s while checkpoints are read and written)."""
    on_lost_host: str = choice("requeue", ("requeue", "fail"))
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
    compile_timeout_s: int = bounded(1800, gt=0)
    """compile: the collective timeout during the first training step, while ranks compile (one may wait for a slower
    one); timeout_s applies from the second step on."""
    plan_device: str = registry_name("auto", "DEVICES")
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
    state; validation.ema validates with it, shardlab-export --ema exports it, a teacher network reads it."""
    decay: float = bounded(0.999, ge=0, le=1)
    """Weight of the old average at each update: average = decay * average + (1 - decay) * weights. With
    schedule=cosine, its value at start_step."""
    schedule: str = choice("constant", ("constant", "cosine"))
    """constant, or cosine: the decay rises from decay to final_decay along a half cosine from start_step to
    optimization.max_steps (BYOL's and DINO's momentum)."""
    final_decay: float = bounded(1.0, ge=0, le=1)
    """The decay at the last step under schedule=cosine (unused under constant)."""
    start_step: int = bounded(0, ge=0)
    """Steps before this one copy the weights into the average instead of averaging (fairseq's ema_start_update)."""


@dataclass
class OptimizationConfig:
    max_steps: int = bounded(1000, gt=0)
    """Optimizer steps to train for."""
    batch_size: int = bounded(32, gt=0)
    """Samples per micro-batch over all ranks (each rank gets batch_size / data-parallel ranks)."""
    update_freq: int = bounded(1, ge=1)
    """Micro-batches accumulated per optimizer step; global batch = batch_size * update_freq."""
    clip_norm: float = bounded(1.0, ge=0, note="0 disables")
    """Clip the global gradient norm to this; 0 disables clipping."""
    max_nonfinite_steps: int = bounded(3, ge=1)
    """Stop the run as failed when the loss is NaN or infinite on this many steps in a row (any rank), or at a save
    whose weights are; nothing non-finite is saved. fp16's gradient overflows, which the scaler skips, do not count."""
    ema: EMAConfig = field(default_factory=EMAConfig)
    """The moving average of the weights (optimization.ema.*)."""


@dataclass
class ValidationConfig:
    interval_steps: int = bounded(250, ge=0)
    """Validate every this many steps (and always after the last); 0 = only at the end."""
    num_batches: int = bounded(20, ge=0)
    """Batches per validation; 0 = the whole validation set."""
    batch_size: int = bounded(64, gt=0)
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
    interval_steps: int = bounded(200, ge=0)
    """Save every this many steps (and after the last); 0 = only at the end."""
    interval_minutes: float = bounded(0.0, ge=0)
    """Also save when this many minutes passed since the last save (rank 0's clock, agreed by all); 0 = off."""
    keep_last: int = bounded(2, ge=1)
    """Number of most recently written checkpoints kept; older ones are deleted once a newer one is complete."""
    keep_every_steps: int = bounded(0, ge=0)
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
    timeout_s: int = bounded(1800, gt=0)
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
    mode: str = choice("online", ("online", "offline"))
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
    interval_steps: int = bounded(50, gt=0)
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
    """The architecture's own schema (model.arch's registration: GPTConfig, LlamaConfig, RegNetConfig, a user_dir's),
    which the yaml option composes in; ``Any`` because OmegaConf types a field by one class and these share none."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: Any = MISSING
    """The task's data schema (its registration's ``data=``: LMDataConfig, ImageDataConfig, ...), composed in by the
    yaml option; ``Any`` for the same reason as model."""
    seed: int = 1
    """Seeds parameter init, data order and dropout; the same seed gives the same run on any world size."""
    dry_run: bool = False
    """Build the model on the meta device, print its size and the sharding plan, and exit without allocating."""
    user_dir: str | None = None
    """A folder of your own plug-ins (tasks, models, optimizers, schedules) and their conf/, imported before the config
    composes (shardlab/registry/user_dir.py; docs/tutorial.md). Command line only; recorded as an absolute path."""


CONF_DIR = Path(__file__).resolve().parent / "conf"
"""The config groups' options (conf/<group>/<option>.yaml): shardlab.cli.conf_options reads them."""


def register_schemas() -> None:
    """The run's schema and the distributed section's; the schemas of tasks, models, optimizers and schedules come
    with their registration (shardlab.registry). Stored once: every composition calls this, and storing converts the
    dataclasses anew (~20 ms of the ~200 a composition takes)."""
    cs = ConfigStore.instance()
    if "config_schema.yaml" not in cs.repo:
        cs.store(name="config_schema", node=TrainConfig)
    if "distributed.yaml" not in cs.repo.get("schema", {}):
        cs.store(group="schema", name="distributed", node=DistributedConfig)


# ---- every field's choices and range, checked over a composed config -------------------------------------------------
def field_errors(cfg: DictConfig) -> list[str]:
    """Each value of the composed config outside its field's ``choice`` or ``bounded``, one line per key, in the
    config's order."""
    problems = (value_problem(key, value, meta) for key, value, meta, _ in declared_values(cfg))
    return [problem for problem in problems if problem]


def declared_values(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, Any, Any, type]]:
    """(dotted key, value, its field's metadata, the schema declaring it) for every value of ``node`` whose field
    has metadata (``choice``, ``bounded``, ``registry_name``), at any depth. Left out: keys of sections without a
    schema, Hydra's own node, null or missing values, and interpolations (the value is checked where it is set)."""
    schema = OmegaConf.get_type(node)
    declared = {f.name: f.metadata for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for key in node:
        dotted, child = f"{prefix}{key}", node._get_node(key)
        if dotted == "hydra" or child._is_missing() or child._is_none() or child._is_interpolation():
            continue
        if isinstance(child, DictConfig):
            yield from declared_values(child, f"{dotted}.")
        elif declared.get(key):
            value = list(child) if isinstance(child, ListConfig) else child._value()
            yield dotted, value, declared[key], schema


def value_problem(key: str, value: Any, meta: Any) -> str | None:
    """The one line refusing ``value`` of ``key`` against its field's metadata (``choice``, ``bounded``), or None."""
    choices, note = meta.get("choices"), f" ({meta['note']})" if meta.get("note") else ""
    fix = f"; {meta['fix']}" if meta.get("fix") else ""
    if isinstance(value, list):
        length, nonempty = meta.get("length"), meta.get("nonempty")
        what = f"{'non-empty ' if nonempty else ''}list of {f'{length} ' if length else ''}"
        what += ", ".join(choices) if choices else f"values {range_text(meta)}".rstrip()
        ok = (length is None or len(value) == length) and (value or not nonempty)
        if ok and all(in_range(v, meta) and (not choices or v in choices) for v in value):
            return None
        return f"{key} must be a {what}{note}, got {value}{fix}"
    if choices is not None:
        if value in choices:
            return None
        why = f" ({meta['refused'][value]})" if value in meta.get("refused", {}) else ""
        return f"{key} must be one of {', '.join(choices)}, got {value!r}{why}{fix}"
    if in_range(value, meta):
        return None
    return f"{key} must be {range_text(meta)}{note}, got {value}{fix}"


def in_range(value: Any, meta: Any) -> bool:
    """Whether a number is within the field's bounds (a value that is no number: its type is Hydra's to check; NaN
    and infinity: shardlab.cli.checks.nonfinite_errors's, which says so for every number of the config)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return True
    tests = {"gt": value.__gt__, "ge": value.__ge__, "lt": value.__lt__, "le": value.__le__}
    return all(test(meta[b]) is True for b, test in tests.items() if b in meta)


def range_text(meta: Any) -> str:
    """The field's bounds as a message says them: ``>= 0``, or ``in [0, 1)`` where it has two."""
    lower = next((b for b in ("gt", "ge") if b in meta), None)
    upper = next((b for b in ("lt", "le") if b in meta), None)
    if lower and upper:
        left, right = "(" if lower == "gt" else "[", ")" if upper == "lt" else "]"
        return f"in {left}{meta[lower]:g}, {meta[upper]:g}{right}"
    return " ".join(f"{BOUNDS[b]} {meta[b]:g}" for b in (lower, upper) if b)


def declared_keys(schema: type, prefix: str = "") -> dict[str, Any]:
    """Every key of ``schema`` and its sub-schemas with choices, a range or a registry, by dotted key: the table the
    tests of the refusals are made from, and docs/configuration.md's."""
    keys: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        sub = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
        if sub:  # a section (model.lora), or an optional one (model.moe: null by default)
            keys |= declared_keys(sub[0], f"{prefix}{f.name}.")
        elif f.metadata:
            keys[f"{prefix}{f.name}"] = f.metadata
    return keys


# ---- the composed config, typed --------------------------------------------------------------------------------------
PLUGIN_SECTIONS = ("task", "model", "data")
"""The sections whose schema a plug-in registers (TrainConfig declares them ``Any`` or by a base): the composed node
carries the schema its yaml option named, a config read back from text does not."""


def typed(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """The composed config as the dataclasses (OmegaConf.to_object), made once where a run is put together
    (shardlab.runner.run_rank) and passed typed to the trainer, the backend, the checkpointer and the task
    (Task.use_config). Sections that carry no schema (a plug-in registered without ``dataclass=``/``data=``) stay a
    DictConfig, resolved: attribute access reads them alike. A config that lost its schemas in text (a spawned
    rank's) is given them first (``with_section_types``); one without the root's schema is typed section by section
    (``typed_by_section``)."""
    if isinstance(cfg, TrainConfig):
        return cfg
    if OmegaConf.get_type(cfg) is not TrainConfig:
        return typed_by_section(cfg)
    untyped = {
        key: OmegaConf.create(OmegaConf.to_container(cfg[key], resolve=True))
        for key in PLUGIN_SECTIONS
        if isinstance(cfg.get(key), DictConfig) and not dataclasses.is_dataclass(OmegaConf.get_type(cfg, key))
    }
    result = OmegaConf.to_object(cfg)
    assert isinstance(result, TrainConfig)
    for key, section in untyped.items():
        setattr(result, key, section)
    return result


def typed_by_section(cfg: DictConfig) -> TrainConfig:
    """A config without TrainConfig's schema (made from a dict or text): each generic section merged onto its schema,
    the plug-in sections kept as DictConfigs (no schema is guessed for them: task=lm composes TaskConfig, not the
    LMTaskConfig its name registers)."""
    hints, values = typing.get_type_hints(TrainConfig), {}
    for key in cfg:
        node = cfg[key]
        if not isinstance(node, DictConfig):
            values[key] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        elif key in PLUGIN_SECTIONS or not dataclasses.is_dataclass(hints.get(key)):
            values[key] = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
        else:
            values[key] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(hints[key]), node))
    return TrainConfig(**values)


def as_container(section: Any) -> Any:
    """A typed section (or a DictConfig) as the plain dicts and lists the run records (status.json, a checkpoint's
    config and model_config): the same keys in the same order as the composed DictConfig gave."""
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        section = OmegaConf.structured(section)
    return OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else section


def section_types(cfg: DictConfig) -> dict[str, str]:
    """``module:qualname`` of the schema each plug-in section of a composed config carries, for a config sent as text
    to spawned ranks (shardlab.runner.launch_local), which ``with_section_types`` gives them back."""
    types = {}
    for key in PLUGIN_SECTIONS:
        schema = OmegaConf.get_type(cfg, key) if isinstance(cfg.get(key), DictConfig) else None
        if dataclasses.is_dataclass(schema):
            types[key] = f"{schema.__module__}:{schema.__qualname__}"
    return types


def with_section_types(cfg: DictConfig, types: dict[str, str]) -> DictConfig:
    """``cfg`` (read back from text) merged onto TrainConfig and onto each plug-in section's schema named in
    ``types`` (``section_types``), as the composed config was; the plug-ins must be loaded (a user_dir's modules are
    found in sys.modules). No ``types`` (the launcher's config had no schemas: a test's dict): ``cfg`` as it is."""
    if not types:
        return cfg
    schema = OmegaConf.structured(TrainConfig)
    for key, name in types.items():
        schema[key] = OmegaConf.structured(pkgutil.resolve_name(name))
    return OmegaConf.merge(schema, cfg)
