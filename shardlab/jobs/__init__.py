"""A run as a job: where it writes, what it reports, how it is launched, stopped and requeued.

- ``run_folders``: where a run may write (no system folder, no ``~``, no ``..`` out of the run folder) and whether it
  can (a folder made and written in, then left as it was).
- ``run_lock``: one job per run folder (and per checkpoint folder outside it), across hosts and requeues.
- ``run_record``: ``status.json`` in a run directory: running, completed, stopped or failed, and the final metrics.
- ``preemption``: stop signals (Slurm's time limit, preemption, ``scancel``), agreed across ranks, then handed to
  submitit's requeue.
- ``pending``: the Slurm jobs a sweep still waits on, and why they wait.
- ``submitit_launcher``: Hydra multirun through submitit (``hydra/launcher=slurm`` or ``local``); its Hydra plugin
  classes are declared in hydra_plugins/shardlab_launcher. ``sbatch_paths``: its log paths escaped for sbatch.
- ``sweep``: the summary table of a sweep (``summary.json``, ``summary.csv``, shardlab-sweep-summary).

Light on purpose (no torch): the CLI's pre-flight (shardlab.cli), Hydra's launcher plugin and the callbacks import
these before any training. What a command line means (its checks, the run's name) is shardlab.cli's; what builds and
times runs (autotune's trials) sits above the trainer, in shardlab.runner.
"""

from __future__ import annotations

__all__ = [
    "pending",
    "preemption",
    "run_folders",
    "run_lock",
    "run_record",
    "sbatch_paths",
    "submitit_launcher",
    "sweep",
]
