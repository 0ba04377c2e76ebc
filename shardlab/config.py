"""Typed config sections (Hydra structured configs): the schemas, and nothing else. The choices live in conf/*.yaml.

Every section is a dataclass registered in Hydra's ConfigStore as a schema (here, or with its factory through
shardlab.registry), so Hydra itself rejects an override with a typo in its key or a value of the wrong type.
The checks of ranges, cross-field rules and paths are shardlab.jobs.checks'; the resolvers the run folder's name
uses are registered where a config is composed (shardlab.jobs.run_dir.register_resolvers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


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
    """Linear warmup from ~0 to optimizer.lr over this many steps (at most optimization.max_steps: clipped, said so)."""
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
    """fully_sharded: ranks a parameter is sharded over (FSDP paper's F). -1 = all data-parallel ranks (world size
    / (tensor x pipeline x context degrees)); 1 <= F < those = hybrid."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's matrices are split over (Megatron-style column/row-wise linears with sequence-parallel norms,
    through torch's parallelize_module); 1 = off. Must divide the heads, KV heads, FFN width and vocabulary. The
    innermost mesh dimension: kept inside one host by default (shardlab/distributed/mesh.py)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages (groups of consecutive layers), each on its own ranks (torch.distributed.pipelining); 1 = off.
    The outermost mesh dimension."""
    pipeline_schedule: str = "1f1b"
    """pipeline_parallel_degree > 1: the schedule torch ships: gpipe, 1f1b (optimization.update_freq >= stages) or
    interleaved_1f1b (needs pipeline_stages_per_rank >= 2); each of update_freq's micro-batches is one pipeline
    micro-batch. Not the zero-bubble ones: torch 2.14's forward-only pass through them fails (validation)."""
    pipeline_stages_per_rank: int = 1
    """pipeline_parallel_degree > 1: model stages each pipeline rank holds (2+ for the interleaved schedules)."""
    context_parallel_degree: int = 1
    """Ranks each sequence is split over, attention run as a ring over them (torch's context_parallel; CUDA only;
    fully_sharded, which then shards over data-shard x context ranks); data.seq_len must divide by 2 x it; 1 = off."""
    context_parallel_rotate_method: str = "allgather"
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
    ranks, and keep the fastest (shardlab/runner/autotune.py); false: the first that fits in a fixed order."""
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
    must hold), else fast (shardlab/distributed/cpu_allocator.py)."""
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
    state; validation.ema validates with it, shardlab-export --ema exports it, a teacher network reads it."""
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


CONF_DIR = Path(__file__).resolve().parent / "conf"
"""The config groups' options (conf/<group>/<option>.yaml): shardlab.jobs.conf_options reads them."""


def register_schemas() -> None:
    """The run's schema and the distributed section's; the schemas of tasks, models, optimizers and schedules come
    with their registration (shardlab.registry)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=TrainConfig)
    cs.store(group="schema", name="distributed", node=DistributedConfig)
