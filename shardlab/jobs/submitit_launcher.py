"""Submitting a sweep through submitit (Slurm, or local processes): what hydra-submitit-launcher does, plus what a
researcher on a cluster needs from it.

- Every point of the sweep is submitted as one job array; the terminal shows each job's id, run directory and log.
- ``wait: true`` (default) follows every job to its end, reporting each as it finishes, a failed one with its
  one-line error (from the run's status.json); one failure does not stop the others. ``wait: false`` returns right
  after submission: submit and walk away, and come back with ``shardlab-sweep-summary <sweep dir>``.
- The sweep's ``sweep.json`` manifest lists every job, so a summary also shows jobs that have not started.
- In the job, a failed run raises, so Slurm records the job as FAILED (Hydra's run_job would report success).
- A run's ``user_dir`` is imported in the job before anything that refers to its classes is unpickled.

The Hydra plugin classes are in hydra_plugins/shardlab_launcher (Hydra loads launchers only from that namespace);
the logic is here.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf, open_dict

from shardlab.jobs import pending, run_record, sweep
from shardlab.jobs.sbatch_paths import escape_slurm_output_paths

log = logging.getLogger("shardlab.jobs.submitit_launcher")

SHARDLAB_KEYS = ("wait", "poll_s")
"""Launcher keys that shardlab consumes itself; every other key goes to submitit as hydra-submitit-launcher's do."""


def _executor(launcher: Any):
    """A submitit executor configured like hydra-submitit-launcher's (same keys, same meaning)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    kind, params = launcher._EXECUTOR, dict(launcher.params)
    init_keys = {"submitit_folder", "max_num_timeout"}
    executor = submitit.AutoExecutor(
        cluster=kind,
        folder=params["submitit_folder"],
        **({f"{kind}_max_num_timeout": params["max_num_timeout"]} if "max_num_timeout" in params else {}),
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{k if k in base else f"{kind}_{k}": v for k, v in params.items() if k not in init_keys}
    )
    escape_slurm_output_paths()
    return executor


def _run_dir(launcher: Any, overrides: list[str], num: int) -> Path:
    """The directory the job will run in, resolved as Hydra resolves it inside the job."""
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
    with open_dict(config.hydra.job):
        config.hydra.job.num = num
    saved = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
    finally:
        HydraConfig.instance().cfg = saved


def launch(launcher: Any, job_overrides, initial_job_idx: int) -> list[JobReturn]:
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    executor = _executor(launcher)
    nums = [initial_job_idx + i for i in range(len(job_overrides))]
    state = Singleton.get_state()
    args = [(list(o), "hydra.sweep.dir", n, f"job_id_for_{n}", state) for o, n in zip(job_overrides, nums, strict=True)]
    job = AfterUserDir(OmegaConf.select(launcher.config, "user_dir"), launcher)
    jobs = executor.map_array(job, [cloudpickle.dumps(a) for a in args])
    entries = []
    for job, overrides, num in zip(jobs, job_overrides, nums, strict=True):
        run_dir = _run_dir(launcher, overrides, num)
        entry = {
            "num": num,
            "job_id": job.job_id,
            "overrides": filter_overrides(list(overrides)),
            "run_dir": str(run_dir),
            "log": str(job.paths.stdout),
        }
        entries.append(entry)
        log.info(f"#{num} job {job.job_id}: {' '.join(entry['overrides']) or '(no overrides)'}")
        log.info(f"    run dir {run_dir}\n    log     {entry['log']}")
    sweep.write_manifest(sweep_dir, entries)
    if not launcher.wait:
        log.info(
            f"submitted {len(jobs)} job(s) ({', '.join(j.job_id for j in jobs)}); not waiting (wait=false). "
            f"Results: shardlab-sweep-summary {sweep_dir}"
        )
        return [_job_return(e, None) for e in entries]
    return _follow(jobs, entries, launcher.poll_s, ask_slurm=launcher._EXECUTOR == "slurm")


def _follow(jobs, entries: list[dict[str, Any]], poll_s: float, ask_slurm: bool = False) -> list[JobReturn]:
    """Wait for every job, reporting each as it ends; a failed or cancelled job never stops the wait for the others.
    ``ask_slurm``: a job pending for a reason that will not pass is reported (and, if it can never start, cancelled)
    at the poll that sees it (shardlab.jobs.pending)."""
    results: dict[int, JobReturn] = {}
    told: set[str] = set()
    while len(results) < len(jobs):
        for i, (job, entry) in enumerate(zip(jobs, entries, strict=True)):
            if i in results or not job.done():
                continue
            value, line = _outcome(job, entry)
            log.info(f"#{entry['num']} job {job.job_id} {line}")
            results[i] = _job_return(entry, value)
        if ask_slurm and len(results) < len(jobs):
            _report_stuck(jobs, entries, results, told, pending.run_command)
        if len(results) < len(jobs):
            time.sleep(poll_s)
    return [results[i] for i in range(len(jobs))]


def _report_stuck(jobs, entries: list[dict[str, Any]], results: dict[int, JobReturn], told: set[str], command) -> None:
    """Each waiting job that cannot start, once, in one line naming the launcher key to change; one whose wait can
    never end is cancelled and counted as failed (its status.json says why, for the sweep's summary)."""
    waiting = [(i, job) for i, job in enumerate(jobs) if i not in results and job.job_id not in told]
    stuck = pending.pending_jobs((job.job_id.split("_")[0] for _, job in waiting), command) if waiting else {}
    sizes: dict[str, int] | None = None
    for i, job in waiting:
        if job.job_id not in stuck:
            continue
        sizes = pending.partition_sizes(command) if sizes is None else sizes
        found = pending.why_it_cannot_start(stuck[job.job_id], sizes)
        if found is None:
            continue
        line, hopeless = found
        told.add(job.job_id)
        entry = entries[i]
        if not hopeless:
            log.info(f"#{entry['num']} job {job.job_id} is waiting: it {line}")
            continue
        job.cancel(check=False)
        run_record.fail(Path(entry["run_dir"]), f"cannot start: it {line}")
        log.info(f"#{entry['num']} job {job.job_id} cannot start, cancelled: it {line}")
        results[i] = _job_return(entry, math.nan)


def _outcome(job, entry: dict[str, Any]) -> tuple[float | None, str]:
    """(the job's return value, a one-line report) for a finished job."""
    status = run_record.read(Path(entry["run_dir"])) or {}
    try:
        ret = job.results()[0]  # task 0 (global rank 0) answers for the job
    except Exception as e:  # FailedJobError (the job raised) or UncompletedJobError (cancelled, killed, timed out)
        if status.get("status") == "stopped":  # a stop signal, a checkpoint, no requeue (e.g. scancel)
            return math.nan, (
                f"stopped at step {status.get('step')} on {status.get('stopped_by')} (Slurm: {job.state}); "
                f"the same sweep point resumes from its checkpoint in {entry['run_dir']}"
            )
        reason = status.get("error") or f"{type(e).__name__}: {_last_line(str(e))} (state {job.state})"
        return math.nan, f"failed: {reason}; log {entry['log']}"
    value = ret.return_value if isinstance(ret, JobReturn) else ret
    final = status.get("final") or {}
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in final.items())
    return value, f"{status.get('status', 'completed')} at step {status.get('step', '?')}: {metrics or 'no metrics'}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _job_return(entry: dict[str, Any], value: Any) -> JobReturn:
    ret = JobReturn(overrides=entry["overrides"], working_dir=entry["run_dir"])
    ret.status = JobStatus.COMPLETED  # failures are reported above and in the summary; Hydra must not stop on them
    ret._return_value = value
    return ret


class AfterUserDir:
    """What a job runs: the launcher called with one point's arguments, both unpickled only after the run's user_dir
    is imported. The launcher's config and Hydra's ConfigStore (in the arguments) hold the user's schema classes,
    which pickle by module name: unpickled first, the job would not find their module."""

    def __init__(self, user_dir: str | None, launcher: Any) -> None:
        self.user_dir = user_dir
        self.launcher = cloudpickle.dumps(launcher)

    def __call__(self, args: bytes) -> JobReturn:
        from shardlab.registry import load_plugins

        load_plugins(self.user_dir)
        return cloudpickle.loads(self.launcher)(*cloudpickle.loads(args))

    def checkpoint(self, args: bytes) -> Any:
        """submitit's requeue (time limit, preemption): the same call again, as hydra-submitit-launcher's."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, args)


def raise_if_failed(ret: JobReturn) -> JobReturn:
    """In the job: a failed run raises, so submitit records the error and Slurm the job as FAILED."""
    if ret.status == JobStatus.FAILED:
        raise ret._return_value
    return ret
