"""What a command line means before a run starts: its checks, its composition, and the run's name.

- ``preflight``: the checks of a command line before the run directory or torch (one line, exit code 2); the Hydra
  callback that checks a run's composed config and takes its lock before Hydra writes there; ``compose_config``, the
  composition every tool and test shares.
- ``checks``: every check of a composed config's values, in one place, run once per start (``check``);
  ``axis_checks``: the mesh's degrees beyond data parallelism.
- ``conf_options``: the options of each config group and the task plug-in each belongs to (did-you-mean lists, a
  model config of another task).
- ``run_names``: which overrides name a run directory (``runs/<task>/<name>``) and a sweep's, the resolvers and the
  Hydra callback that name them, and which keys of a checkpoint's config must match on resume.

The entry itself is shardlab.train (``python -m shardlab.train``): it hands the checked job to shardlab.runner. This
room sits below the runner and the trainer, which ask the same rules (a sweep point and a config a caller composed
are checked by ``runner.build_task``; a resume compares the keys that name the run), and above shardlab.jobs, whose
run lock the pre-flight takes. Light at import (no torch): the CLI answers a command line's mistakes before torch.
"""

from __future__ import annotations

__all__ = ["axis_checks", "checks", "conf_options", "preflight", "run_names"]
