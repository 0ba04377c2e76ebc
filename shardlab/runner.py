"""Run one training job in this process, or start world_size local processes that each run it.

train.py (the CLI), the tests and the benchmarks all come through here, so they exercise the same code path.
"""

from __future__ import annotations

import faulthandler
import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from shardlab.config import path_errors, validate
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError, ShardlabError
from shardlab.registry import BACKENDS, TASKS, load_plugins


def build_task(cfg: DictConfig, world_size: int | None = None, run_dir: Path | None = None):
    """The task for ``cfg``, after every generic and task-specific config check (one ConfigError for all).

    ``run_dir``: also check that it and the checkpoint directory in it can be written (default: Hydra's run
    directory, when called under @hydra.main)."""
    import torch
    from hydra.core.hydra_config import HydraConfig

    from shardlab.task import Task

    if run_dir is None and HydraConfig.initialized():
        run_dir = Path(HydraConfig.get().runtime.output_dir)

    load_plugins()
    import shardlab.distributed.backends  # noqa: F401  (registers single, ddp, fully_sharded)

    problems: list[str] = []
    world_size = world_size or dist_env.detect().world_size
    try:
        validate(cfg, world_size if world_size > 1 else None, torch.cuda.device_count())
    except ConfigError as e:
        problems.append(str(e))
    BACKENDS.get(cfg.distributed.backend, key="distributed.backend")
    task = TASKS.build(cfg.task.name, cfg, key="task.name")
    problems += task.config_errors()
    if cfg.distributed.wrap_min_num_params > 0 and type(task).fsdp_units is not Task.fsdp_units:
        problems.append(
            f"distributed.wrap_min_num_params applies to models without a unit plan, but task {cfg.task.name} "
            "declares its FSDP units; drop it"
        )
    problems += path_errors(cfg, run_dir) if run_dir is not None else []
    if problems:
        raise ConfigError("; ".join(problems))
    return task


def run_rank(cfg: DictConfig, run_dir: Path, env: dist_env.DistEnv, after_fit=None, teardown: bool = True) -> dict:
    """Train on this rank; returns {'final': last validation metrics, 'history': logged records (rank 0)}.

    ``after_fit(trainer) -> dict`` runs before the process group is torn down (tests and benchmarks inspect the
    trained model there); ``teardown=False`` keeps the group for another run in the same processes.
    """
    from shardlab.trainer import Trainer

    task = build_task(cfg, env.world_size)
    backend = BACKENDS.build(cfg.distributed.backend, cfg.distributed, env, key="distributed.backend")
    backend.setup()
    try:
        trainer = Trainer(cfg, task, backend, run_dir)
        trainer.setup()
        if env.is_main:
            print("\n".join([*trainer.plan, *backend.describe()]), flush=True)
        final = trainer.fit()
        extra = after_fit(trainer) if after_fit is not None else {}
        return {"final": final, "history": trainer.history, "stopped_early": trainer.stop_requested, **extra}
    finally:
        if teardown:
            backend.teardown()


def _spawned_entry(rank: int, cfg_yaml: str, run_dir: str, world_size: int, port: int) -> None:
    """Body of a locally spawned rank: errors are reported with the rank and end the process non-zero."""
    faulthandler.register(__import__("signal").SIGUSR2)  # `kill -USR2 <pid>` dumps a hung rank's stacks
    cfg = OmegaConf.create(cfg_yaml)
    env = dist_env.detect(spawned_rank=rank, spawned_world=world_size, spawned_port=port)
    try:
        run_rank(cfg, Path(run_dir), env)
    except ShardlabError as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception:
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


def launch_local(cfg: DictConfig, run_dir: Path, world_size: int) -> None:
    """Start ``world_size`` processes on this machine (gloo on CPU, nccl on CUDA) and wait for all of them."""
    import torch.multiprocessing as mp

    port = dist_env.free_port()
    dist_env.set_local_rank_defaults(world_size)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    try:
        mp.start_processes(
            _spawned_entry,
            args=(cfg_yaml, str(run_dir), world_size, port),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    except mp.ProcessExitedException as e:
        raise SystemExit(f"error: rank {e.error_index} exited with code {e.exit_code}; see its message above") from None
    except mp.ProcessRaisedException as e:
        raise SystemExit(f"error: rank {e.error_index} failed: {str(e).strip().splitlines()[-1]}") from None


def print_plan(cfg: DictConfig, task) -> None:
    """dry_run: build on meta, print the size and the unit plan, allocate nothing."""
    from shardlab.plan import describe_plan, meta_model

    model = meta_model(task.build_model)
    for line in describe_plan(model, task.fsdp_units(model), cfg.distributed):
        print(line)


def format_final(metrics: dict[str, float]) -> str:
    from shardlab.logging import format_metrics

    return format_metrics(metrics)
