"""Run one training job in this process, or start world_size local processes that each run it.

train.py (the CLI), the tests and the benchmarks all come through here, so they exercise the same code path. The job
is one floor above the trainer, so what builds runs lives here beside it:

- ``autotune``: distributed.backend=auto with auto_tune: a few real steps of each layout that fits, each trial put
  together by trainer.assemble, the fastest kept (``tune_layout`` below calls it on the ranks).
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

import shardlab.optim  # noqa: F401  (the built-in optimizers, registered before a user_dir's plug-ins)
from shardlab import errors
from shardlab.cli import checks
from shardlab.cli.checks import job_world_size, path_errors
from shardlab.cli.run_names import former_run_name, run_name
from shardlab.config import section_types, with_section_types
from shardlab.distributed import env as dist_env
from shardlab.distributed.units import model_on_meta
from shardlab.errors import ConfigError, DataError, HostLost, RankFailed, RunFolderInUse, ShardlabError, one_line
from shardlab.jobs import run_lock, run_record
from shardlab.jobs.preemption import (
    REQUEUE_SIGNALS,
    STOPPED_EXIT_CODE,
    StopSignals,
    requeue_slurm_job,
)
from shardlab.memory import budget as memory_budget
from shardlab.memory.plan import one_profile_per_run, plan_run
from shardlab.registry import BACKENDS, TASKS, load_plugins

__all__ = [
    "build_task",
    "launch_local",
    "point_at_former_folder",
    "prepare_data",
    "print_plan",
    "rank_task",
    "run_job",
    "run_rank",
]


def build_task(cfg: DictConfig, world_size: int | None = None, run_dir: Path | None = None, check_budget: bool = True):
    """The task for ``cfg``, after every config check (shardlab.cli.checks.check: one ConfigError for all), for tools
    and tests that compose a config and build its task themselves.

    ``run_dir``: also check that it and the checkpoint directory in it can be written. ``check_budget=False`` skips
    holding an explicit backend to distributed.memory_budget_gb; backend=auto is resolved either way."""
    world_size = job_world_size(cfg, world_size or dist_env.detect().world_size)
    task = checks.check(cfg, world_size, budget=check_budget)
    problems = path_errors(cfg, run_dir) if run_dir is not None else []
    if problems:
        raise ConfigError("; ".join(problems))
    choose_layout(cfg, task, world_size, check_budget)
    return task


def choose_layout(cfg: DictConfig, task, world_size: int, planned: bool = True) -> None:
    """backend=auto becomes a layout by the memory plan alone (written into ``cfg``; with auto_tune, the ranks measure
    later and this only checks that one fits). ``planned=False``: only where the ranks will not tune (a rank given
    backend=auto with auto_tune measures it itself, shardlab.runner.autotune). A choice, not a check: the checks
    (shardlab.cli.checks) hold an explicit backend to the budget."""
    if cfg.distributed.backend == "auto" and (planned or not cfg.distributed.auto_tune):
        chosen = memory_budget.resolve(cfg, task, world_size, model_on_meta(task))
        if chosen and dist_env.detect().is_main:
            print(chosen, flush=True)


def rank_task(cfg: DictConfig):
    """The task of a checked config, built without checking it again: a rank trusts the pre-flight of the process that
    started it (shardlab.cli.checks) and checks only what it alone sees (its data, devices and world)."""
    from shardlab.distributed import load_backends

    load_plugins(cfg.get("user_dir"))  # a spawned rank imports afresh: the plug-ins register again
    load_backends()
    return TASKS.build(cfg.task.name, cfg, key="task.name")


def run_job(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> float | None:
    """One run as the CLI starts it (also one sweep point, or one task of a Slurm job): plan only (dry_run), spawn
    distributed.world_size local ranks, or train as this launcher's rank. Global rank 0 keeps the run's status.json
    (shardlab.jobs.run_record) and prints the final validation. Returns the final validation loss."""
    env = dist_env.detect()
    record = env.is_main and not cfg.dry_run
    if record:  # held already when the CLI's checks took it (before Hydra wrote .hydra/); else taken here
        run_lock.take(run_dir, cfg.checkpoint.dir)  # before status.json: a refused job leaves the running one's alone
        run_record.start(run_dir, overrides, cfg.optimization.max_steps)
        point_at_former_folder(run_dir, overrides, cfg.checkpoint.dir)
    try:
        with one_profile_per_run():  # the plan of backend=auto's choice and the run's own: one profile
            ran = _run(cfg, run_dir, env)
        if ran is None:  # dry_run: the plan printed
            return None
        result, signals = ran
        if result.get("complete_at"):  # nothing trained: the final metrics stay the ones the run ended with
            result["final"] = ((run_record.read(run_dir) or {}).get("final") or {}) if record else {}
        if record:
            run_record.finish(run_dir, result)
            if result.get("complete_at"):
                print(complete_line(run_dir, result["complete_at"], cfg.optimization.max_steps), flush=True)
            elif result["final"] and not result["stopped_by"]:
                print(f"final validation: {format_final(result['final'])}", flush=True)
        if signals is not None and result["stopped_by"]:
            # the launcher of local ranks (on every node, the first node's): submitit's requeue, or Slurm's
            signals.forward(speaks_for_job=env.is_main)
    except BaseException as e:
        _record_failure(e, cfg, run_dir, env, record)
        raise
    finally:
        if record:
            run_lock.release(run_dir)
    if result["stopped_by"]:
        if record:
            print(f"stopped early on {result['stopped_by']}; rerun the same command to resume", flush=True)
        raise SystemExit(STOPPED_EXIT_CODE)
    return result["final"].get("loss") if result["final"] else None


def _run(cfg: DictConfig, run_dir: Path, env: dist_env.DistEnv) -> tuple[dict, StopSignals | None] | None:
    """run_job's work: the checked task and its layout, then the plan (dry_run: returns None), the local ranks
    spawned (their first one's result, and the stop signals this launcher received) or this rank's run."""
    world = job_world_size(cfg, env.world_size)
    task = checks.checked(cfg, world)  # by the CLI's pre-flight, before anything was written
    if task is None:  # a sweep point, or a config its caller composed: checked here, once
        task = build_task(cfg, world, run_dir)
    else:
        choose_layout(cfg, task, world)
    if cfg.dry_run:
        print_plan(cfg, task)
        return None
    local_ranks = dist_env.ranks_to_spawn(cfg.distributed.world_size, env)
    if local_ranks:
        prepare_data(task)  # once, here, so the ranks find it cached and data errors come back as one line
        return launch_local(cfg, run_dir, cfg.distributed.world_size, local_ranks)
    return run_rank(cfg, run_dir, env, task=task), None


def _record_failure(e: BaseException, cfg: DictConfig, run_dir: Path, env: dist_env.DistEnv, record: bool) -> None:
    """run_job's error ``e``, into status.json (``record``: rank 0's) or as this rank's note for rank 0; a lost host
    under distributed.on_lost_host=requeue asks Slurm for the requeue and ends the job with SystemExit."""
    # A broken connection to another host is a lost host only where no rank left an error of its own (a rank that
    # raised ends its process too, and its error, not a requeue that would meet it again, is the job's outcome).
    lost_host = isinstance(e, HostLost) and record and run_record.first_rank_error(run_dir) is None
    if record and run_lock.taken_over(run_dir):
        pass  # status.json is the job's that took the folder over now
    elif record and (run_record.read(run_dir) or {}).get("status") == "running":  # not a stop that saved
        # A RankFailed names the rank that failed and why: recorded at once, not after waiting for notes that
        # will not come (the told ranks leave none), during which torchrun stops this rank for its neighbour's exit.
        if isinstance(e, RankFailed) and (lost_host or not isinstance(e, HostLost)):
            run_record.fail(run_dir, one_line(e))
        else:
            run_record.fail_with_first_cause(run_dir, one_line(e), env.world_size)
    elif not record and not cfg.dry_run and not isinstance(e, (SystemExit, RankFailed, RunFolderInUse)):
        # rank 0 reports the first one. RankFailed is always another rank's failure, told to this one: no cause of
        # its own, and a job refused a folder in use would leave it in the running job's folder.
        run_record.note_rank_error(run_dir, env.rank, one_line(e))
    if lost_host and lost_host_requeues(cfg.distributed.on_lost_host):
        print(f"{one_line(e)}\n{requeue_slurm_job()}", flush=True)
        raise SystemExit(STOPPED_EXIT_CODE) from e  # no result: the submitter follows the job through its requeue


def lost_host_requeues(on_lost_host: str) -> bool:
    """A lost host requeues this job (distributed.on_lost_host=requeue, inside Slurm): the process speaking for the
    job asks for it once; rank 0's status says why it stopped."""
    return on_lost_host == "requeue" and bool(os.environ.get("SLURM_JOB_ID"))


def run_rank(
    cfg: DictConfig, run_dir: Path, env: dist_env.DistEnv, after_fit=None, teardown: bool = True, task=None
) -> dict:
    """Train on this rank; returns {'final': last validation metrics, 'history': logged records (rank 0)}.

    The steps, in order: the task (built and checked, unless run_job passes the one it built), backend=auto's layout
    (tuned on these ranks), the backend, then the run assembled (shardlab.trainer.assemble: process group, data, model
    on meta, plan, parallelize, materialize, optimizer, checkpointer, restore), and fit.
    ``after_fit(trainer) -> dict`` runs before the process group is torn down (tests and benchmarks inspect the
    trained model there); ``teardown=False`` keeps the group for another run in the same processes.
    """
    # A time-limit warning is recorded from here: one during start-up (tuning, data, restore) stops the run after its
    # first step, with a checkpoint and the requeue, where its default action would end the process unrequeued. The
    # other stop signals are recorded from the first step (Trainer.fit): before it there is nothing new to save.
    signals = StopSignals(interrupt=cfg.checkpoint.save_on_error)
    signals.install(only=REQUEUE_SIGNALS)
    try:
        with one_profile_per_run():  # backend=auto's plan, its trials and the run's assembly share one profile
            return _run_rank(cfg, run_dir, env, after_fit, teardown, task, signals)
    except BaseException:
        if signals.received in REQUEUE_SIGNALS:  # the warning still gets its requeue (submitit's, or Slurm's)
            signals.forward(speaks_for_job=env.is_main and not env.spawned)
        raise
    finally:
        signals.restore()


def _run_rank(cfg, run_dir: Path, env, after_fit, teardown: bool, task, signals: StopSignals) -> dict:
    from shardlab.distributed.network import collective_reason
    from shardlab.trainer import assemble, run_config

    if task is None:  # the checked config's task (run_job passes the one it checked)
        task = rank_task(cfg)
        choose_layout(cfg, task, env.world_size, planned=False)  # a caller's backend=auto without tuning
    else:  # built by the pre-flight from its own composition: it reads this rank's, which the layout is written into
        task.use_config(cfg)
    if cfg.distributed.backend == "auto":  # measured on these ranks, then written into cfg
        tune_layout(cfg, task, env, run_dir)
    # From here the run's config is typed (the dataclasses of shardlab.config, made once): the backend, the trainer,
    # its checkpointer and the task (handed it by assemble) read it.
    run_cfg = run_config(cfg)
    backend = BACKENDS.build(run_cfg.distributed.backend, run_cfg.distributed, env, key="distributed.backend")
    try:
        # The corpus cache makes one writer per cache and lets the other ranks wait for it; the ranks then agree
        # that they opened the same data.
        trainer = assemble(run_cfg, task, backend, run_dir, prepare_data=lambda: prepare_data(task), signals=signals)
        final = trainer.fit()
        extra = after_fit(trainer) if after_fit is not None else {}
        result = {
            "final": final,
            "history": trainer.history,
            "stopped_by": trainer.stopped_by,
            "memory": trainer.memory,
            "complete_at": str(trainer.complete_at) if trainer.complete_at is not None else None,
            **extra,
        }
    except RuntimeError as e:  # gloo names the peer whose connection broke: say which host that is
        if (lost := backend.network.lost_peer(e)) is None:
            raise
        raise HostLost(
            f"lost {lost}: its processes ended or its host went down ({collective_reason(e)}); a requeue resumes "
            "from the newest complete checkpoint (distributed.on_lost_host)"
        ) from e
    finally:
        if teardown:
            backend.teardown()
    if trainer.stopped_by:
        if env.is_main:
            run_record.finish(run_dir, result)  # before the handler below, which may end the process
        # Under submitit: its requeue, now that the checkpoint is written; local ranks leave that to their launcher.
        trainer.stop_signals.forward(speaks_for_job=env.is_main and not env.spawned)
    return result


def prepare_data(task) -> str:
    """This rank's data step: preprocess or open the task's data and check it against the config (before the first
    step, so a validation split too small for its batch is not found at the first validation); returns what the rank
    opened (Task.data_identity). The data is opened once per process (backend=auto's tuning opens it before the
    backend's setup); the validation batch is fitted and the data checked against the task's config at every call:
    the run's typed config, handed to the task after the tuning opened the data (Task.use_config), is fitted too."""
    if task.train_dataset is None:
        task.prepare_data()
    note = task.fit_validation_batch(checks.data_parallel_readers(task.cfg, job_world_size(task.cfg)))
    if note and dist_env.detect().is_main:
        print(note, flush=True)
    problems = task.data_errors()
    if problems:
        raise DataError("; ".join(problems))
    return task.data_identity()


def tune_layout(cfg: DictConfig, task, env: dist_env.DistEnv, run_dir: Path) -> None:
    """distributed.backend=auto with auto_tune: open the data and join the process group (as Backend.setup does), and
    let the ranks measure the layouts that fit (shardlab.runner.autotune); the choice is written into ``cfg``, and a
    choice measured now into the run's status.json."""
    from shardlab.distributed.base import join_process_group, pick_device
    from shardlab.runner import autotune

    join_process_group(
        env, pick_device(env.local_rank), cfg.distributed.timeout_s, lambda: prepare_data(task),
        cfg.distributed.init_timeout_s,
    )  # fmt: skip
    decision = autotune.tune(cfg, task, env, run_dir)
    if env.is_main:
        if decision.measured:
            run_record.update(run_dir, autotune=decision.measured)
        print(decision.report, flush=True)


def _spawned_entry(
    rank: int, cfg_yaml: str, types: dict[str, str], run_dir: str, world_size: int, port: int, result_file: str
) -> None:
    """Body of a locally spawned rank (``rank``: its index on this machine): the first hands its result back through
    ``result_file``; errors are reported with the rank and end the process non-zero. ``cfg_yaml`` is the composed
    config as text, ``types`` the schemas of its plug-in sections (shardlab.config.section_types), given back to it
    once the plug-ins are imported, so this rank's config is typed as its launcher's was."""
    faulthandler.register(signal.SIGQUIT)  # `kill -QUIT <pid>` dumps a hung rank's stacks (USR1/2 are stop signals)
    cfg = OmegaConf.create(cfg_yaml)
    load_plugins(cfg.get("user_dir"))  # a spawned rank imports afresh: the schemas' modules, a user_dir's too
    cfg = with_section_types(cfg, types)
    env = dist_env.detect(spawned_rank=rank, spawned_world=world_size, spawned_port=port)
    rank = env.rank
    try:
        result = run_rank(cfg, Path(run_dir), env)
    except Exception as e:
        if env.launcher != "local" and not isinstance(e, RankFailed):
            # Its own error, for rank 0 on another host: told from a lost host by this note (one machine's launcher
            # hears of it directly).
            run_record.note_rank_error(Path(run_dir), rank, one_line(e))
        if isinstance(e, ShardlabError):
            raise  # torch.multiprocessing hands it to the parent, which reports it in one line
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    if env.local_rank == 0:
        # complete_at too: a start of a run already at max_steps says so (run_job), on spawned ranks as in one process
        handed = {key: result.get(key) for key in ("final", "stopped_by", "memory", "complete_at")}
        Path(result_file).write_text(json.dumps(handed))
    dist_env.end_finished_rank()


def launch_local(
    cfg: DictConfig, run_dir: Path, world_size: int, nprocs: int | None = None
) -> tuple[dict, StopSignals]:
    """Start ``nprocs`` (default: all ``world_size``) ranks on this machine (gloo on CPU, nccl on CUDA), wait for all of
    them, and return the first one's result with the stop signals this process received. Fewer than ``world_size``:
    this process is one task of a multi-node job, its ranks those of its task (shardlab.distributed.env.detect). A
    stop signal sent to this process reaches every rank, which then stop at an agreed step; the signal is then this
    process's to forward (run_job), so a Slurm job whose tasks spawn their ranks is requeued like any other (submitit's
    handler is the one it reaches)."""
    import torch.multiprocessing as mp

    nprocs = nprocs or world_size
    first = dist_env.detect().rank * nprocs  # the global rank of this task's first one (0 on one machine)
    port = dist_env.free_port()
    dist_env.set_local_rank_defaults(nprocs)
    cfg_yaml, types = OmegaConf.to_yaml(cfg, resolve=True), section_types(cfg)
    with tempfile.TemporaryDirectory(prefix="shardlab-") as tmp:
        result_file = str(Path(tmp) / "result.json")
        context = mp.start_processes(
            _spawned_entry,
            args=(cfg_yaml, types, str(run_dir), world_size, port, result_file),
            nprocs=nprocs,
            join=False,
            start_method="spawn",
        )

        def to_ranks(signum: int) -> None:
            # A terminal's Ctrl-C reaches the ranks itself; the ranks' second SIGINT would interrupt them, so a
            # SIGINT is passed on as SIGTERM (also a stop signal).
            forwarded = signal.SIGTERM if signum == signal.SIGINT else signum
            for process in context.processes:
                if process.is_alive():
                    os.kill(process.pid, forwarded)

        signals = StopSignals(interrupt=cfg.checkpoint.save_on_error, on_signal=to_ranks)
        signals.install()
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as e:  # the rank's traceback as text; its last line is "module.Type: msg"
            last = str(e).strip().splitlines()[-1]
            name, _, message = last.partition(": ")
            user_error = getattr(errors, name.rsplit(".", 1)[-1], None)
            if isinstance(user_error, type) and issubclass(user_error, ShardlabError):
                raise user_error(f"(rank {first + e.error_index}) {message}") from None
            raise RankFailed(f"rank {first + e.error_index} failed: {last}") from None
        except mp.ProcessExitedException as e:
            raise RankFailed(
                f"rank {first + e.error_index} exited with code {e.exit_code}; see its message above"
            ) from None
        finally:
            signals.restore()
        return json.loads(Path(result_file).read_text()), signals


def point_at_former_folder(run_dir: Path, overrides: list[str], checkpoint_dir: str) -> None:
    """A run whose name changed (names began to be escaped, and stopped repeating ``task=``) finds nothing in its new
    folder: say where its checkpoints are, rather than letting it begin again unnoticed."""
    former = run_dir.with_name(former_run_name(overrides))
    if former == run_dir or run_dir.name != run_name(overrides):
        return
    if any((run_dir / checkpoint_dir).glob("step_*")) or not any((former / checkpoint_dir).glob("step_*")):
        return
    print(
        f"[run] note: {former} holds checkpoints of these overrides under the name an earlier shardlab gave them; "
        f"this run now lives in {run_dir}: move them here to continue that run",
        flush=True,
    )


def print_plan(cfg: DictConfig, task) -> None:
    """dry_run: build on meta, print the size, the unit plan and the memory plan with its alternatives; allocate
    nothing."""
    import time

    started = time.perf_counter()
    world = job_world_size(cfg, dist_env.detect().world_size)
    if precision_line := plan_precision(cfg):
        print(precision_line, flush=True)
    lines = plan_run(cfg, task, world, model_on_meta(task), compare=True).lines  # it says which device it is for
    lines += task.plan_lines()
    lines.append(f"planned in {time.perf_counter() - started:.2f} s on the meta device (nothing allocated)")
    print("\n".join(lines), flush=True)
    if cfg.distributed.get("verify_plan"):  # the real fully_shard on a fake process group; a mismatch raises
        from shardlab.memory.verify import verify_plan

        print("\n".join(verify_plan(cfg, task, world)), flush=True)


def plan_precision(cfg: DictConfig) -> str | None:
    """dry_run with distributed.precision=auto: a named plan_device's published rates decide, else this machine's."""
    from shardlab.distributed import precision
    from shardlab.distributed.base import pick_device
    from shardlab.memory import devices

    named = devices.DEVICES.get(cfg.distributed.get("plan_device", "auto"))
    if named is not None:
        return precision.for_named_device(cfg.distributed, named)
    return precision.resolve(cfg.distributed, pick_device(0))


def complete_line(run_dir: Path, checkpoint: str, max_steps: int) -> str:
    """What a start of a run that was already at optimization.max_steps prints instead of training: where it is, and
    the two ways to train more (checkpoint.resume=none is refused in a folder that holds a run)."""

    def shown(path) -> str:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd().resolve()) else str(path)

    another = Path(shown(run_dir)).parent / "<name>"
    return (
        f"run complete: {shown(run_dir)} has reached optimization.max_steps={max_steps} ({shown(checkpoint)}); "
        f"nothing trained. To train another run, name it: hydra.run.dir={another}; to train this one further, raise "
        "optimization.max_steps"
    )


def format_final(metrics: dict[str, float]) -> str:
    from shardlab.logging import format_metrics

    return format_metrics(metrics)
