"""The lm task's factory: data.format=preference trains with the DPO loss (shardlab_tasks/lm/dpo_task.py), every other
format with LanguageModelingTask. task.name stays lm either way, so checkpoint.init_from takes an SFT run's weights; the
choice lives here because the DPO task subclasses the LM one (the LM task choosing its own subclass was an import
cycle)."""

from __future__ import annotations

from omegaconf import DictConfig

from shardlab.config import TrainConfig
from shardlab.task import setting


def build_lm_task(cfg: DictConfig | TrainConfig):
    """The task of ``cfg``: a composed or recorded DictConfig, or a typed config (shardlab.task's docstring)."""
    if setting(cfg.data, "format") == "preference":
        from shardlab_tasks.lm.dpo_task import PreferenceTask

        return PreferenceTask(cfg)
    from shardlab_tasks.lm.task import LanguageModelingTask

    return LanguageModelingTask(cfg)
