"""A run as a job: where it runs, what it reports, how it is launched, stopped and requeued.

- ``checks``: every check of a composed config's values, in one place, run once per start (``check``).
- ``preflight``: the checks of a command line before the run directory or torch (one line, exit code 2); the Hydra
  callback that checks a run's composed config.
- ``run_dir``: which overrides name a run directory (``runs/<task>/<name>``).
- ``run_record``: ``status.json`` in a run directory: running, completed, stopped or failed, and the final metrics.
- ``preemption``: stop signals (Slurm's time limit, preemption, ``scancel``), agreed across ranks, then handed to
  submitit's requeue.
- ``submitit_launcher``: Hydra multirun through submitit (``hydra/launcher=slurm`` or ``local``); its Hydra plugin
  classes are declared in hydra_plugins/shardlab_launcher.
- ``sweep``: the summary table of a sweep (``summary.json``, ``summary.csv``, shardlab-sweep-summary).

Light on purpose (no torch): the CLI, Hydra's launcher plugin and the callbacks import these before any training.
What builds and times runs (autotune's trials) sits above the trainer, in shardlab.runner.
"""

from __future__ import annotations

__all__ = ["checks", "preemption", "preflight", "run_dir", "run_record", "submitit_launcher", "sweep"]
