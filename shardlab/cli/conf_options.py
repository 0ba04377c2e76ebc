"""The options of each config group (conf/<group>/<option>.yaml, and a user_dir's conf/), and the task plug-in each
one's schema comes from: what the pre-flight's did-you-mean lists and what the checks tell apart (a model config of
another task)."""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from shardlab.config import CONF_DIR
from shardlab.registry import package_of


def group_options(group: str, user_conf: Path | None = None) -> list[str]:
    """The options of conf/<group> (and of a user_dir's conf/<group>)."""
    return sorted(p.stem for conf in (CONF_DIR, user_conf) if conf for p in (conf / group).glob("*.yaml"))


def option_package(group: str, option: str) -> str | None:
    """The task plug-in package (e.g. ``shardlab_tasks.lm``) whose schema conf/<group>/<option>.yaml builds on, if
    any."""
    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        return None
    for entry in OmegaConf.load(path).get("defaults", []):
        if isinstance(entry, str) and entry.startswith("/schema/"):
            node = ConfigStore.instance().load(f"schema/{entry.removeprefix('/schema/').split('@')[0]}.yaml").node
            return package_of(OmegaConf.get_type(node).__module__)
    return None


def options_of(group: str, package: str) -> list[str]:
    """The conf/<group> options of one task plug-in package."""
    return [option for option in group_options(group) if option_package(group, option) == package]


def task_default_options(task: str) -> dict[str, str]:
    """The options conf/task/<task>.yaml picks for the other groups (e.g. {"model": "regnet_cifar"}); {} without one."""
    path = CONF_DIR / "task" / f"{task}.yaml"
    if "," in task or not path.is_file():
        return {}
    defaults = {}
    for entry in OmegaConf.load(path).get("defaults", []):
        if isinstance(entry, DictConfig):
            defaults.update({k.removeprefix("override /"): v for k, v in entry.items()})
    return defaults


def task_section_package(task: str, group: str) -> str | None:
    """The plug-in package whose ``group`` schema a task reads: that of the option its conf/task file picks (SwAV
    reads the vision task's model and its own data), or None where the task's conf does not say."""
    option = task_default_options(task).get(group)
    return option_package(group, option) if option else None
