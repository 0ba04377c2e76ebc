"""Every check of a config's values, in one place, run once per start.

``check(cfg)`` asks each part for its problems and raises one ConfigError naming them all: the generic sections
(``shardlab.config.validate``: ranges, finite numbers, flag combinations, unknown keys), the names the config picks
from the registries (backend, task, architecture, optimizer, schedule), the task's own checks (``Task.config_errors``
and ``Task.world_errors``, written beside each task in tasks/<task>/), torch.compile's, and an explicit backend held to
distributed.memory_budget_gb (the memory plan, on the meta device).

Who runs it, once: the CLI's pre-flight (``shardlab.jobs.preflight``, a Hydra callback), after Hydra composed the
config and before anything is written - no run folder, lock, ``.hydra/`` or status.json. The run in the same process
finds the config checked (``checked``) and does not check it again; a sweep point, which Hydra starts without
that callback, and a caller of ``runner.run_job`` that composed its own config, are checked there instead, once.
Ranks trust a checked config (``runner.rank_task``): they check only what they alone can see - their data, their
devices, their world, the checkpoints in the folder - and those checks stay where that is seen.
"""

from __future__ import annotations

import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from shardlab.config import options_of, task_section_package, validate
from shardlab.errors import ConfigError
from shardlab.registry import BACKENDS, LR_SCHEDULERS, MODELS, OPTIMIZERS, TASKS, load_plugins, plugin_packages

_checked: dict[str, Any] = {}
"""The task of each config this process checked, by ``_fingerprint``: the run that follows the pre-flight in the
same process builds nothing twice and checks nothing twice."""


def check(cfg: DictConfig, world_size: int | None = None, num_cuda_devices: int | None = None, budget: bool = True):
    """Every config check of this start; one ConfigError listing every problem. Returns the task, built to ask it.

    ``world_size``: the job's ranks (default: as the launcher or distributed.world_size says, ``job_world_size``);
    ``num_cuda_devices``: this machine's (default: torch's count); ``budget=False``: an explicit backend is not held
    to distributed.memory_budget_gb (tools that only read a trained run's model)."""
    import torch

    from shardlab.distributed import load_backends
    from shardlab.distributed.compile import compile_errors
    from shardlab.logging.trackers import tracker_uri_errors
    from shardlab.task import Task

    load_plugins(cfg.get("user_dir"))  # .get: configs recorded before user_dir existed lack it
    load_backends()  # registers single, ddp, fully_sharded
    world_size = world_size or job_world_size(cfg)
    num_cuda_devices = torch.cuda.device_count() if num_cuda_devices is None else num_cuda_devices
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
    problems += compile_errors(cfg.distributed, num_cuda_devices)
    problems += tracker_uri_errors(cfg.logging)
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
    d = cfg.distributed
    skips = bool(d.get("ac_skip_units")) and d.activation_checkpointing != "none"
    planned = budget and d.backend != "auto" and d.memory_budget_gb > 0  # auto: a choice the run makes (runner)
    if skips or planned:
        # the units exist only in the model: built once on meta (nothing allocated), for both checks
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
    _checked.clear()  # one start per process: only the last config checked is the run's
    _checked[_fingerprint(cfg, world_size)] = task
    return task


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
    """The task plug-in package a registered factory or schema class comes from (e.g. tasks.lm)."""
    return factory.__module__.rpartition(".")[0]


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
    own = [name for name in MODELS.names() if not another_plugins(MODELS.module_of(name).rpartition(".")[0], package)]
    if cfg.model.arch not in own:
        return [unknown_name_message(cfg.model.arch, f"model architecture of task {cfg.task.name}", own, "model.arch")]
    return []
