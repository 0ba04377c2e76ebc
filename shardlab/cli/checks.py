"""Every check of a config's values, in one place, run once per start.

``check(cfg)`` first refuses every value outside its field's choices or range (``shardlab.config.field_errors``: they
are declared beside each field, in the schemas, task plug-ins' included), all of them at once and alone: every rule
after it reads these values, and a task's checks may build its model from them. Then it asks each part for its
problems and raises one ConfigError naming them all: the generic sections (``validate``: numbers that are not finite,
flag combinations across keys and sections, unknown keys), the names the config picks
from the registries (backend, task, architecture, optimizer, schedule), the task's own checks (``Task.config_errors``
and ``Task.world_errors``, written beside each task in shardlab_tasks/<task>/), torch.compile's, and an explicit backend
held to distributed.memory_budget_gb (the memory plan, on the meta device). The paths a run will write (``path_errors``)
are checked here too, by writing there, by whoever is about to make them.

Who runs it, once: the CLI's pre-flight (``shardlab.cli.preflight``, a Hydra callback), after Hydra composed the
config and before anything is written - no run folder, lock, ``.hydra/`` or status.json. The run in the same process
finds the config checked (``checked``) and does not check it again; a sweep point, which Hydra starts without
that callback, and a caller of ``runner.run_job`` that composed its own config, are checked there instead, once.
Ranks trust a checked config (``runner.rank_task``): they check only what they alone can see - their data, their
devices, their world, the checkpoints in the folder - and those checks stay where that is seen.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from shardlab.cli.conf_options import options_of, task_section_package
from shardlab.config import DistributedConfig, field_errors
from shardlab.errors import ConfigError
from shardlab.jobs.run_folders import writable_dir_problem
from shardlab.registry import (
    BACKENDS,
    LR_SCHEDULERS,
    MODELS,
    OPTIMIZERS,
    TASKS,
    load_plugins,
    package_of,
    plugin_packages,
)

_checked: dict[str, Any] = {}
"""The task of each config this process checked, by ``_fingerprint``: the run that follows the pre-flight in the
same process builds nothing twice and checks nothing twice."""


def check(cfg: DictConfig, world_size: int | None = None, num_cuda_devices: int | None = None, budget: bool = True):
    """Every config check of this start; one ConfigError listing every problem. Returns the task, built to ask it.

    ``world_size``: the job's ranks (default: as the launcher or distributed.world_size says, ``job_world_size``);
    ``num_cuda_devices``: this machine's (default: torch's count); ``budget=False``: an explicit backend is not held
    to distributed.memory_budget_gb (tools that only read a trained run's model)."""
    import torch

    from shardlab.cli.axis_checks import axis_errors
    from shardlab.distributed import load_backends
    from shardlab.distributed.compile import compile_errors
    from shardlab.task import Task

    load_plugins(cfg.get("user_dir"))  # .get: configs recorded before user_dir existed lack it
    load_backends()  # registers single, ddp, fully_sharded
    world_size = world_size or job_world_size(cfg)
    num_cuda_devices = torch.cuda.device_count() if num_cuda_devices is None else num_cuda_devices
    outside = field_errors(cfg)
    if outside:  # alone, all of them: every rule below reads these values, a task's may build a model from them
        raise ConfigError("; ".join(outside))
    problems: list[str] = []
    try:
        validate(cfg, world_size if world_size > 1 else None, num_cuda_devices)
    except ConfigError as e:
        problems.append(str(e))
    if cfg.distributed.backend != "auto":
        BACKENDS.get(cfg.distributed.backend, key="distributed.backend")
    foreign = foreign_section_errors(cfg)
    if foreign:  # the task's own checks would only fail on the other task's keys
        raise ConfigError("; ".join(problems + foreign))
    task = TASKS.build(cfg.task.name, cfg, key="task.name")
    problems += architecture_errors(cfg)
    problems += registered_name_errors(cfg)
    problems += task.config_errors()
    problems += task.world_errors(world_size)
    problems += axis_errors(cfg, task, world_size, num_cuda_devices)
    problems += compile_errors(cfg.distributed, num_cuda_devices)
    problems += pipeline_errors(cfg, task.pipeline_cut(), world_size)
    if cfg.distributed.wrap_min_num_params > 0 and type(task).fsdp_units is not Task.fsdp_units:
        problems.append(
            f"distributed.wrap_min_num_params applies to models without a unit plan, but task {cfg.task.name} "
            "declares its FSDP units; drop it"
        )
    if cfg.distributed.get("plan_device") == "cuda" and not num_cuda_devices:
        # every rank's plan (shardlab.memory.plan) would refuse it, after the process group is up
        from shardlab.memory import devices

        problems.append(
            "distributed.plan_device=cuda plans for this machine's GPU, but it has none; name the GPU to plan for: "
            f"{', '.join(devices.DEVICES)}"
        )
    if problems:
        raise ConfigError("; ".join(problems))
    check_with_model(cfg, task, world_size, budget)
    _checked.clear()  # one start per process: only the last config checked is the run's
    _checked[_fingerprint(cfg, world_size)] = task
    return task


def check_with_model(cfg: DictConfig, task, world_size: int, budget: bool) -> None:
    """The checks that need the model's units, built once on meta (nothing allocated): ac_skip_units against the units
    the backend wraps, and an explicit backend against distributed.memory_budget_gb (skipped with ``budget=False``).
    Each raises its own ConfigError."""
    d = cfg.distributed
    skips = bool(d.get("ac_skip_units")) and d.activation_checkpointing != "none"
    planned = budget and d.backend != "auto" and d.memory_budget_gb > 0  # auto: a choice the run makes (runner)
    if not (skips or planned):
        return
    from shardlab.distributed.units import model_on_meta

    model = model_on_meta(task)
    if skips:  # ask what the rank would ask
        from shardlab.distributed.activation_checkpointing import checkpointed_units
        from shardlab.distributed.units import wrapped_units

        units = wrapped_units(model, task.fsdp_units(model), d)  # the units the backend wraps (generic ones too)
        checkpointed_units(len(units), d.activation_checkpointing, d.ac_every_k_units, d.ac_skip_units)
    if planned:
        from shardlab.memory import budget as memory_budget

        memory_budget.resolve(cfg, task, world_size, model)  # refuses a backend the plan predicts over the budget


def checked(cfg: DictConfig, world_size: int):
    """The task of ``cfg`` if this process checked it for ``world_size`` already (the CLI's pre-flight), else None:
    a sweep point (Hydra starts none of them through the pre-flight) or a run composed by its caller, still to
    check."""
    return _checked.get(_fingerprint(cfg, world_size))


def _fingerprint(cfg: DictConfig, world_size: int) -> str:
    """The config's values as checked (without Hydra's own node, which the task function's copy lacks)."""
    values = OmegaConf.to_container(cfg, resolve=False)
    values.pop("hydra", None)
    return json.dumps([values, world_size], sort_keys=True, default=str)


def job_world_size(cfg: DictConfig, launcher_world_size: int | None = None) -> int:
    """Ranks the job will have: the launcher's, or distributed.world_size where shardlab spawns ranks itself (in one
    process, or in each of a Slurm job's tasks: one task per node starting its share of the ranks)."""
    from shardlab.distributed import env as dist_env

    env = dist_env.detect()
    launcher_world_size = launcher_world_size or env.world_size
    if launcher_world_size > 1 and not dist_env.ranks_to_spawn(cfg.distributed.world_size, env):
        return launcher_world_size
    return max(launcher_world_size, cfg.distributed.world_size)


def pipeline_errors(cfg: DictConfig, cut, world: int) -> list[str]:
    """distributed.pipeline_*: what shardlab.distributed.pipeline can run, given the task's cut (None: the task's model
    cannot be pipelined) and the world size (the degree against the world and the task: axis_checks)."""
    d, o = cfg.distributed, cfg.optimization
    pp, per_rank, schedule = d.pipeline_parallel_degree, d.pipeline_stages_per_rank, d.pipeline_schedule
    if pp == 1:
        return [] if per_rank == 1 else [f"distributed.pipeline_stages_per_rank ({per_rank}) needs distributed."
                                         "pipeline_parallel_degree > 1; drop it"]  # fmt: skip
    if pp < 1 or world % pp or cut is None:  # shardlab.cli.axis_checks says why (the degree, the task)
        return []
    # only for a pipeline: torch's pipelining imports torch._dynamo (~1 s), which a run without one never needs
    from shardlab.distributed.mesh import ParallelDims
    from shardlab.distributed.pipeline import MULTI_STAGE

    stages, micro = pp * per_rank, o.update_freq
    data = ParallelDims.from_config(d, world).dp  # the ranks a validation batch splits over (not the TP/CP ones)
    errors = failed([
        (d.backend == "fully_sharded", f"distributed.pipeline_parallel_degree ({pp}) runs each stage under "
         f"fully_sharded (FSDP over its data-parallel ranks); set distributed.backend=fully_sharded, not {d.backend}"),
        (schedule not in MULTI_STAGE or per_rank >= 2, f"distributed.pipeline_schedule={schedule} runs several stages "
         f"per rank: set distributed.pipeline_stages_per_rank >= 2 (it is {per_rank})"),
        (schedule in MULTI_STAGE or per_rank == 1, f"distributed.pipeline_stages_per_rank ({per_rank}) needs an "
         f"interleaved schedule ({', '.join(MULTI_STAGE)}); {schedule} runs one stage per rank"),
        (stages <= cut.num_layers, f"distributed.pipeline_parallel_degree x pipeline_stages_per_rank = {stages} "
         f"pipeline stages, more than the model's {cut.num_layers} layers; lower them or raise model.num_layers"),
        (schedule != "1f1b" or micro >= stages, f"optimization.update_freq ({micro}) gives {micro} pipeline "
         f"micro-batches per step, fewer than the {stages} stages 1f1b needs; raise it to >= {stages}"),
        (schedule != "interleaved_1f1b" or micro % max(1, micro // pp) == 0, f"optimization.update_freq ({micro}): "
         f"interleaved_1f1b runs micro-batches in rounds of {pp}; use a multiple of {pp} or fewer than {2 * pp}"),
        (cfg.validation.batch_size % (data * micro) == 0, f"validation.batch_size ({cfg.validation.batch_size})"
         f" must be a multiple of data-parallel ranks x optimization.update_freq ({data * micro}): each "
         "rank's validation batch runs through the pipeline in update_freq micro-batches"),
        ("fp16" not in {d.param_dtype or d.precision, d.reduce_dtype or d.precision}, "distributed.precision fp16 "
         "with pipeline_parallel_degree > 1: the loss scaler's overflow vote is not agreed over stages yet; use bf16"),

    ])  # fmt: skip
    return errors


# ---- the names a config picks, and whose plug-in they belong to ------------------------------------------------------
def registered_name_errors(cfg: DictConfig) -> list[str]:
    """optimizer.name and lr_scheduler.name must be registered: otherwise the optimizer's build, after the weights are
    materialized on every rank, is the first to look them up."""
    errors = []
    for registry, key in ((OPTIMIZERS, "optimizer.name"), (LR_SCHEDULERS, "lr_scheduler.name")):
        try:
            registry.get(OmegaConf.select(cfg, key), key=key)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def plugin_package(factory) -> str:
    """The task plug-in package a registered factory or schema class comes from (e.g. shardlab_tasks.lm)."""
    return package_of(factory.__module__)


def section_package(task_name: str, section: str) -> str:
    """The package whose ``section`` configs (model, data) task ``task_name`` reads: the one its conf/task file picks
    (SwAV reads the vision task's RegNet), else the task's own."""
    return task_section_package(task_name, section) or plugin_package(TASKS.get(task_name, key="task.name"))


def another_plugins(package: str, own: str) -> bool:
    """Whether ``package`` is another installed task plug-in than ``own``; a user_dir's package is none of them."""
    return package != own and package in plugin_packages()


def foreign_section_errors(cfg: DictConfig) -> list[str]:
    """The model and data sections must not be another task plug-in's: a GPTConfig cannot configure image
    classification, nor image data the LM. Schemas from elsewhere (a user_dir) pass; the task checks them itself."""
    errors = []
    for section in ("model", "data"):
        package = section_package(cfg.task.name, section)
        schema = OmegaConf.get_type(cfg[section])
        if schema is None or schema is dict:
            continue
        if another_plugins(plugin_package(schema), package):
            errors.append(
                f"{section}: task {cfg.task.name} cannot read a {schema.__name__} (a {section} config of "
                f"{plugin_package(schema)}); use one of its own: {section}={' | '.join(options_of(section, package))}"
            )
    return errors


def architecture_errors(cfg: DictConfig) -> list[str]:
    """model.arch must name an architecture of the chosen task: not one of another task's plug-in package (a RegNet
    for the LM). Architectures from elsewhere (a user_dir) pass here; the task checks their shape itself."""
    from shardlab.registry import unknown_name_message

    package = section_package(cfg.task.name, "model")
    own = [name for name in MODELS.names() if not another_plugins(package_of(MODELS.module_of(name)), package)]
    if cfg.model.arch not in own:
        return [unknown_name_message(cfg.model.arch, f"model architecture of task {cfg.task.name}", own, "model.arch")]
    return []


# ---- the generic sections: finite numbers, declared choices and ranges, flag combinations, unknown keys -------------
def validate(cfg: DictConfig, world_size: int | None = None, num_cuda_devices: int = 0) -> None:
    """Check the values (finite, within their fields' choices and ranges: shardlab.config.field_errors) and the
    cross-field rules of the generic sections; raise one ConfigError listing all problems.

    ``world_size`` is the job's (from the launcher, else distributed.world_size); invalid flag combinations are
    caught here, before any process starts or any memory is allocated.
    """
    nonfinite = nonfinite_errors(cfg)
    if nonfinite:  # alone: the range checks below would only repeat them (NaN fails every comparison, inf passes >)
        raise ConfigError("; ".join(nonfinite))
    outside = field_errors(cfg)
    if outside:  # alone: the rules below, and the task's, read these values and would only follow from them
        raise ConfigError("; ".join(outside))
    d = cfg.distributed
    errors = [
        *(() if d.backend != "auto" or d.memory_budget_gb > 0 else [AUTO_NEEDS_BUDGET]),
        *ema_errors(cfg),
        *checkpointing_errors(d),
        *plan_device_errors(cfg),
        *tracker_errors(cfg.logging),
        *tracker_uri_errors(cfg.logging),
        *distributed_errors(cfg, world_size or d.world_size, num_cuda_devices),
        *unknown_key_errors(cfg),
    ]
    if errors:
        raise ConfigError("; ".join(errors))


def failed(checks: list[tuple[bool, str]]) -> list[str]:
    """The messages of the checks that do not hold, in order."""
    return [msg for ok, msg in checks if not ok]


AUTO_NEEDS_BUDGET = (
    "distributed.backend=auto chooses a layout to fit distributed.memory_budget_gb; set it (GiB per rank)"
)


def ema_errors(cfg: DictConfig) -> list[str]:
    """validation.ema without optimization.ema (its values' ranges are the schema's)."""
    ema, errors = cfg.optimization.ema, []
    if cfg.validation.ema and not ema.enabled:
        errors.append(
            "validation.ema validates with the average of optimization.ema; set optimization.ema.enabled=true"
        )
    return errors


def checkpointing_errors(d: DictConfig) -> list[str]:
    """distributed.activation_checkpointing against its keys (``d``: the distributed section; each key's values are
    the schema's)."""
    mode, errors = d.activation_checkpointing, []
    if d.ac_matmul_save_every > 1 and "matmul" not in d.ac_save_ops:
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


def tracker_errors(log_cfg: DictConfig) -> list[str]:
    """An enabled tracker must be installed (found, not imported: its import takes seconds); MLflow's URI a URI."""
    import importlib.util

    errors = []
    for extra, module in TRACKER_MODULES.items():
        section = log_cfg.get(extra)  # .get: configs recorded before the trackers existed lack them
        if section is not None and section.enabled and importlib.util.find_spec(module) is None:
            errors.append(
                f"logging.{extra}.enabled needs the {module} package, which is not installed; "
                f"pip install -e '.[{extra}]' or drop logging.{extra}.enabled"
            )
    uri = log_cfg.get("mlflow", {}).get("tracking_uri")
    if uri is not None and "://" not in uri and not uri.startswith("databricks"):
        # a bare path is MLflow's folder store, which MLflow 3 refuses (in maintenance mode) at the first call
        errors.append(
            f"logging.mlflow.tracking_uri must be a URI (http(s)://host:port, sqlite:///path.db), got '{uri}'; for a "
            f"local store use sqlite:///{uri.rstrip('/')}.db"
        )
    return errors


def nonfinite_errors(cfg: DictConfig) -> list[str]:
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


def plan_device_errors(cfg: DictConfig) -> list[str]:
    """distributed.plan_device must name a device of shardlab.memory.devices; verify_plan needs a dry run."""
    from shardlab.memory import devices

    d, errors = cfg.distributed, []
    if d.plan_device not in devices.known():
        errors.append(devices.unknown_device_message(d.plan_device))
    if d.verify_plan and not cfg.dry_run:
        errors.append("distributed.verify_plan checks the plan of a dry run; add dry_run=true")
    return errors


# ---- the paths a run writes: checked by writing there --------------------------------------------------------------
def path_errors(cfg: DictConfig, run_dir: str | os.PathLike, keep_run_dir: bool = False) -> list[str]:
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


# ---- keys and flag combinations ------------------------------------------------------------------------------------
def unknown_key_errors(cfg: DictConfig) -> list[str]:
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


def data_parallel_readers(cfg: DictConfig, world: int) -> int:
    """The ranks that read different samples: the data-parallel ones (world / tensor x pipeline x context)."""
    from shardlab.distributed.mesh import ParallelDims

    dims = ParallelDims.from_config(cfg.distributed, world)
    return dims.dp if dims.multi_axis and dims.world_size == world else world


def distributed_errors(cfg: DictConfig, world: int, num_cuda_devices: int) -> list[str]:
    """Flag combinations that cannot work (or silently would not do what they say)."""
    d, errors = cfg.distributed, []
    sharded = d.backend in ("fully_sharded", "auto")  # auto keeps fully_sharded knobs (and then shards)
    readers = data_parallel_readers(cfg, world)
    among = "the world size" if readers == world else "the data-parallel ranks (world / tensor x pipeline x context)"
    if readers > 1 and cfg.optimization.batch_size % readers:
        errors.append(
            f"optimization.batch_size ({cfg.optimization.batch_size}) must be divisible by {among} "
            f"({readers}): it is the global micro-batch, split evenly over the ranks"
        )
    if readers > 1 and cfg.validation.batch_size % readers:
        errors.append(f"validation.batch_size ({cfg.validation.batch_size}) must be divisible by {among} ({readers})")
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
    return errors + placement_errors(cfg, world, num_cuda_devices)


def placement_errors(cfg: DictConfig, world: int, num_cuda_devices: int) -> list[str]:
    """Where parameters, optimizer steps and activations go, and in which dtypes, against the backend and devices."""
    d, errors = cfg.distributed, []
    if d.cpu_offload and d.backend not in ("fully_sharded", "auto"):
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


def tracker_uri_errors(log_cfg: DictConfig) -> list[str]:
    """The pre-flight's check of the MLflow tracking URI (the configured one, else MLFLOW_TRACKING_URI): a scheme that
    MLflow's store registry has no store for (``nosuchscheme://x``) can never work, so it is refused before training,
    by the registry the client asks (plug-in schemes included); nothing is connected to or created. A server that
    does not answer is another matter: it may come back, so the run only says so (MlflowTracker)."""
    section = log_cfg.get("mlflow")  # .get: configs recorded before the trackers existed lack it
    if section is None or not section.enabled:
        return []
    key, uri = "logging.mlflow.tracking_uri", section.get("tracking_uri")
    if not uri:
        key, uri = "MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return []  # MLflow's own default store
    try:  # the registry MlflowClient builds its store from; not a public name, so a future MLflow only skips this
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry
        from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException as Unsupported
    except ImportError:
        return []  # mlflow missing: tracker_errors says so
    try:
        registry.get_store_builder(uri)
    except Unsupported as e:
        known = ", ".join(s for s in e.supported_uri_schemes if s)
        scheme = uri.split(":", 1)[0]
        return [
            f"{key} is {uri}, whose scheme '{scheme}' MLflow has no store for (it takes: {known}); give "
            "http(s)://host:port for a server or sqlite:///path.db for a local store"
        ]
    return []
