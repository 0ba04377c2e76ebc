"""Run one training job in this process, or start world_size local processes that each run it.

train.py (the CLI), the tests and the benchmarks all come through here, so they exercise the same code path.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from shardlab import errors
from shardlab.config import path_errors, validate
from shardlab.distributed import env as dist_env
from shardlab.distributed import load_backends
from shardlab.errors import ConfigError, RankFailed, ShardlabError
from shardlab.jobs import run_record
from shardlab.jobs.preemption import STOP_SIGNALS, STOPPED_EXIT_CODE
from shardlab.memory import budget as memory_budget
from shardlab.registry import BACKENDS, TASKS, load_plugins


def build_task(cfg: DictConfig, world_size: int | None = None, run_dir: Path | None = None, check_budget: bool = True):
    """The task for ``cfg``, after every generic and task-specific config check (one ConfigError for all).

    ``run_dir``: also check that it and the checkpoint directory in it can be written. ``check_budget=False`` skips
    holding an explicit backend to distributed.memory_budget_gb (run_rank: run_job did, before any rank started);
    backend=auto is resolved either way."""
    import torch

    from shardlab.distributed.compile import compile_errors
    from shardlab.task import Task

    load_plugins()
    load_backends()  # registers single, ddp, fully_sharded

    problems: list[str] = []
    world_size = world_size or dist_env.detect().world_size
    try:
        validate(cfg, world_size if world_size > 1 else None, torch.cuda.device_count())
    except ConfigError as e:
        problems.append(str(e))
    if cfg.distributed.backend != "auto":
        BACKENDS.get(cfg.distributed.backend, key="distributed.backend")
    task = TASKS.build(cfg.task.name, cfg, key="task.name")
    problems += task.config_errors()
    problems += compile_errors(cfg.distributed, torch.cuda.device_count())
    if cfg.distributed.wrap_min_num_params > 0 and type(task).fsdp_units is not Task.fsdp_units:
        problems.append(
            f"distributed.wrap_min_num_params applies to models without a unit plan, but task {cfg.task.name} "
            "declares its FSDP units; drop it"
        )
    problems += path_errors(cfg, run_dir) if run_dir is not None else []
    if problems:
        raise ConfigError("; ".join(problems))
    # backend=auto becomes a layout; an explicit one predicted over distributed.memory_budget_gb is refused.
    if check_budget or cfg.distributed.backend == "auto":
        chosen = memory_budget.resolve(cfg, task, job_world_size(cfg, world_size))
        if chosen and dist_env.detect().is_main:
            print(chosen, flush=True)
    return task


def job_world_size(cfg: DictConfig, launcher_world_size: int) -> int:
    """Ranks the job will have: the launcher's, or distributed.world_size for ranks shardlab spawns itself."""
    return launcher_world_size if launcher_world_size > 1 else cfg.distributed.world_size


def run_job(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> float | None:
    """One run as the CLI starts it (also one sweep point, or one task of a Slurm job): plan only (dry_run), spawn
    distributed.world_size local ranks, or train as this launcher's rank. Global rank 0 keeps the run's status.json
    (shardlab.jobs.run_record) and prints the final validation. Returns the final validation loss."""
    env = dist_env.detect()
    record = env.is_main and not cfg.dry_run
    if record:
        run_record.start(run_dir, overrides, cfg.optimization.max_steps)
    try:
        task = build_task(cfg, env.world_size, run_dir)
        if cfg.dry_run:
            print_plan(cfg, task)
            return None
        if env.launcher == "none" and cfg.distributed.world_size > 1:
            task.prepare_data()  # once, here, so the ranks find it cached and data errors come back as one line
            result = launch_local(cfg, run_dir, cfg.distributed.world_size)
        else:
            result = run_rank(cfg, run_dir, env, task=task)
    except BaseException as e:
        if record and (run_record.read(run_dir) or {}).get("status") == "running":  # not a stop that saved
            run_record.fail(run_dir, one_line(e))
        raise
    if record:
        run_record.finish(run_dir, result)
        if result["final"]:
            print(f"final validation: {format_final(result['final'])}", flush=True)
    if result["stopped_by"]:
        if record:
            print(f"stopped early on {result['stopped_by']}; rerun the same command to resume", flush=True)
        raise SystemExit(STOPPED_EXIT_CODE)
    return result["final"].get("loss") if result["final"] else None


def one_line(error: BaseException) -> str:
    if isinstance(error, ShardlabError):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}".rstrip(": ")


def run_rank(
    cfg: DictConfig, run_dir: Path, env: dist_env.DistEnv, after_fit=None, teardown: bool = True, task=None
) -> dict:
    """Train on this rank; returns {'final': last validation metrics, 'history': logged records (rank 0)}.

    The steps, in order: the task (built and checked, unless run_job passes the one it built), the process group, the
    data, the plan (model on meta, FSDP units, memory), then the trainer (shard, materialize, restore, fit).
    ``after_fit(trainer) -> dict`` runs before the process group is torn down (tests and benchmarks inspect the
    trained model there); ``teardown=False`` keeps the group for another run in the same processes.
    """
    from shardlab.memory.plan import plan_run
    from shardlab.trainer import Trainer

    task = task or build_task(cfg, env.world_size, check_budget=False)
    backend = BACKENDS.build(cfg.distributed.backend, cfg.distributed, env, key="distributed.backend")
    backend.setup()
    try:
        if env.is_main:
            task.prepare_data()  # rank 0 preprocesses first; the others then hit its cache
        backend.barrier()
        if not env.is_main:
            task.prepare_data()
        plan = plan_run(cfg, task, env.world_size)
        if env.is_main:
            print("\n".join(plan.lines), flush=True)  # before anything is allocated
        trainer = Trainer(cfg, task, backend, run_dir)
        trainer.setup(plan)
        if env.is_main:
            print("\n".join(backend.describe()), flush=True)
        final = trainer.fit()
        extra = after_fit(trainer) if after_fit is not None else {}
        result = {
            "final": final,
            "history": trainer.history,
            "stopped_by": trainer.stopped_by,
            "memory": trainer.memory,
            **extra,
        }
    finally:
        if teardown:
            backend.teardown()
    if trainer.stopped_by:
        if env.is_main:
            run_record.finish(run_dir, result)  # before the handler below, which may end the process
        trainer.stop_signals.forward()  # under submitit: its requeue, now that the checkpoint is written
    return result


def _spawned_entry(rank: int, cfg_yaml: str, run_dir: str, world_size: int, port: int, result_file: str) -> None:
    """Body of a locally spawned rank: rank 0 hands its result back through ``result_file``; errors are reported with
    the rank and end the process non-zero."""
    faulthandler.register(signal.SIGQUIT)  # `kill -QUIT <pid>` dumps a hung rank's stacks (USR1/2 are stop signals)
    cfg = OmegaConf.create(cfg_yaml)
    env = dist_env.detect(spawned_rank=rank, spawned_world=world_size, spawned_port=port)
    try:
        result = run_rank(cfg, Path(run_dir), env)
    except ShardlabError:
        raise  # torch.multiprocessing hands it to the parent, which reports it in one line
    except Exception:
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    if rank == 0:
        handed = {key: result[key] for key in ("final", "stopped_by", "memory")}
        Path(result_file).write_text(json.dumps(handed))
    dist_env.end_finished_rank()


def launch_local(cfg: DictConfig, run_dir: Path, world_size: int) -> dict:
    """Start ``world_size`` processes on this machine (gloo on CPU, nccl on CUDA), wait for all of them, and return
    rank 0's result. A stop signal sent to this process reaches every rank, which then stop at an agreed step."""
    import torch.multiprocessing as mp

    port = dist_env.free_port()
    dist_env.set_local_rank_defaults(world_size)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    with tempfile.TemporaryDirectory(prefix="shardlab-") as tmp:
        result_file = str(Path(tmp) / "result.json")
        context = mp.start_processes(
            _spawned_entry,
            args=(cfg_yaml, str(run_dir), world_size, port, result_file),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )

        def forward(signum, frame):
            for process in context.processes:
                if process.is_alive():
                    os.kill(process.pid, signum)

        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as e:  # the rank's traceback as text; its last line is "module.Type: msg"
            last = str(e).strip().splitlines()[-1]
            name, _, message = last.partition(": ")
            user_error = getattr(errors, name.rsplit(".", 1)[-1], None)
            if isinstance(user_error, type) and issubclass(user_error, ShardlabError):
                raise user_error(f"(rank {e.error_index}) {message}") from None
            raise RankFailed(f"rank {e.error_index} failed: {last}") from None
        except mp.ProcessExitedException as e:
            raise RankFailed(f"rank {e.error_index} exited with code {e.exit_code}; see its message above") from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return json.loads(Path(result_file).read_text())


def print_plan(cfg: DictConfig, task) -> None:
    """dry_run: build on meta, print the size, the unit plan and the memory plan with its alternatives; allocate
    nothing."""
    import time

    import torch

    from shardlab.memory.plan import plan_run

    started = time.perf_counter()
    world = job_world_size(cfg, dist_env.detect().world_size)
    lines = plan_run(cfg, task, world, compare=True).lines
    if not torch.cuda.is_available():
        lines.append("  (planned for this CPU, where cpu_offload moves nothing; on GPUs it frees device memory)")
    lines.append(f"planned in {time.perf_counter() - started:.2f} s on the meta device (nothing allocated)")
    print("\n".join(lines), flush=True)


def format_final(metrics: dict[str, float]) -> str:
    from shardlab.logging import format_metrics

    return format_metrics(metrics)
