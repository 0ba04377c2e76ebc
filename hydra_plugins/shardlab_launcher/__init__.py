"""shardlab's submitit launchers for Hydra (`hydra/launcher=slurm` or `local`; presets: shardlab/conf/hydra/launcher/).

Hydra only loads launcher classes from the ``hydra_plugins`` namespace, so they are declared here; the logic is in
shardlab/jobs/submitit_launcher.py. The configs extend hydra-submitit-launcher's with the keys shardlab consumes itself.
(No `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where dataclasses
cannot resolve string annotations.)
"""

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher


@dataclass
class ShardlabSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.shardlab_launcher.ShardlabSlurmLauncher"
    wait: bool = True
    poll_s: float = 5.0


@dataclass
class ShardlabLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.shardlab_launcher.ShardlabLocalLauncher"
    wait: bool = True
    poll_s: float = 2.0


ConfigStore.instance().store(group="hydra/launcher", name="shardlab_slurm_schema", node=ShardlabSlurmConf)
ConfigStore.instance().store(group="hydra/launcher", name="shardlab_local_schema", node=ShardlabLocalConf)


class _Shardlab:
    def __init__(self, **params: Any) -> None:
        from shardlab.jobs.submitit_launcher import SHARDLAB_KEYS

        self.wait = bool(params.get("wait", True))
        self.poll_s = float(params.get("poll_s", 5.0))
        super().__init__(**{k: v for k, v in params.items() if k not in SHARDLAB_KEYS})

    def launch(self, job_overrides, initial_job_idx):
        from shardlab.jobs.submitit_launcher import launch

        return launch(self, job_overrides, initial_job_idx)

    def __call__(self, *args: Any, **kwargs: Any):
        from shardlab.jobs.submitit_launcher import raise_if_failed

        return raise_if_failed(super().__call__(*args, **kwargs))


class ShardlabSlurmLauncher(_Shardlab, SlurmLauncher):
    pass


class ShardlabLocalLauncher(_Shardlab, LocalLauncher):
    pass
