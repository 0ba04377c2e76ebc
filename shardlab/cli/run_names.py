"""Which overrides name a run: the run directory follows the experiment, not the way it is launched.

``runs/<task>/<name>`` is built from the command line's overrides minus the keys that only change how a run executes
(its launcher, world size, backend and sharding knobs, logging, validation cadence, checkpoint handling, its length,
where data is cached, how many non-finite losses in a row end it). So a run resumed on another world size or backend,
or extended with a larger optimization.max_steps, finds its own checkpoints instead of silently starting a fresh run
elsewhere.

Names cannot collide for different values: characters outside a safe set are percent-escaped (``data.path=/a/b_c``
is ``data.path=%2Fa%2Fb_c``, ``/a/b/c`` is ``data.path=%2Fa%2Fb%2Fc``), so common overrides keep short readable
names and distinct raw values keep distinct folders. The same rule says which keys of a checkpoint's saved config
must equal the run's before it continues that run (``run_key_differences``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import PurePath
from typing import Any
from urllib.parse import quote

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

HOW_IT_RUNS = (
    "distributed",
    "logging",
    "validation",
    "checkpoint",
    "optimization.max_steps",
    "optimization.max_nonfinite_steps",
    "data.cache_dir",
    "data.num_workers",
    "data.num_preprocess_workers",
    "dry_run",
)
"""Override keys (and every key below them) that do not name a run."""

NAMES_A_RUN = ("checkpoint.init_from",)
"""Keys below HOW_IT_RUNS that still name a run: a run started from other weights is another experiment."""

ALWAYS_EXCLUDED = ("logging.progress_bar", "checkpoint.resume", "dry_run")
"""Not even a sweep point's directory depends on these."""

QUOTES = "'\""
NAMED_BY_FOLDER = ("user_dir",)
"""Path keys that name a run by their last folder only (user_dir=my_research), not by where that folder lives."""


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _shown(override: str) -> str:
    override = override.lstrip("+~")
    key, _, value = override.partition("=")
    if key in NAMED_BY_FOLDER:
        return f"{key}={PurePath(value.strip(QUOTES)).name}"
    return override


def _excluded(key: str, prefixes: Iterable[str]) -> bool:
    return key not in NAMES_A_RUN and any(key == p or key.startswith(p + ".") for p in prefixes)


MAX_NAME = 120
"""Longer names are cut and end in a hash of the whole name (file systems refuse names over 255 bytes)."""


SAFE = "=,.+-_[]:@~"
"""Kept as they are in a name (with letters and digits); every other character, ``%`` and ``/`` included, is
percent-escaped, which keeps the mapping one-to-one. Hydra's grammar allows a bare comma only inside a list or a
quoted string (whose quotes are escaped), so the commas that join overrides stay unambiguous."""


def _cut(name: str) -> str:
    return f"{name[: MAX_NAME - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}" if len(name) > MAX_NAME else name


NAMED_BY_PARENT = ("task",)
"""Group choices the run's parent folder already names (runs/<task>/<run name>): not repeated in the run name."""


def run_name(
    overrides: Iterable[str], prefixes: Iterable[str] = HOW_IT_RUNS, parent: Iterable[str] = NAMED_BY_PARENT
) -> str:
    """A directory name from the overrides that name the run: sorted ``key=value`` joined by commas, escaped
    (``SAFE``); ``default`` when none do. ``parent``: keys the folder above already names (a sweep's points share
    one folder, so theirs name the task)."""
    prefixes, parent = tuple(prefixes), tuple(parent)
    kept = sorted(_shown(o) for o in overrides if not _excluded(_key(o), prefixes) and _key(o) not in parent)
    return _cut(quote(",".join(kept), safe=SAFE)) or "default"


def former_run_name(overrides: Iterable[str]) -> str:
    """The name shardlab gave the same overrides before names were escaped (slashes became underscores, so paths
    could collide) and while they repeated the task: only to point a user at a run that now lives under run_name's
    name."""
    kept = sorted(o.lstrip("+~") for o in overrides if not _excluded(_key(o), HOW_IT_RUNS))
    return _cut(",".join(kept).replace("/", "_")) or "default"


def names_the_run(key: str) -> bool:
    """Whether config key ``key`` (dotted) is part of what the experiment is, by the same rule as the directory."""
    return not _excluded(key, HOW_IT_RUNS)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_key_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], ignore: Iterable[str] = ()
) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key that names the run and differs between two full configs
    (a checkpoint's and this run's); keys only one side has (added or dropped by a shardlab version) are not
    compared, nor ``ignore`` (dotted keys that may change on resume, like a model's dropout)."""
    old, new = _flatten(saved), _flatten(current)
    skip = set(ignore)
    return [
        (k, old[k], new[k])
        for k in sorted(old.keys() & new.keys())
        if k not in skip and names_the_run(k) and _compared(k, old[k]) != _compared(k, new[k])
    ]


def _compared(key: str, value: Any) -> Any:
    """A value as the run's name shows it: a user_dir moved elsewhere is still the same run's code."""
    return PurePath(str(value).strip(QUOTES)).name if key in NAMED_BY_FOLDER and value else value


SWEEP_SYNTAX = (",", "(")
"""What makes an override a sweep over several values: a list (task=lm,swav) or a function (glob(*), range(...))."""


def sweep_dir_name(task: str, sweep_overrides: Iterable[str]) -> str:
    """``<task>/<the sweep's overrides>`` (``optimizer.lr=1e-3,3e-3``, sweep syntax and all): the same command names
    the same sweep folder, so rerunning it resumes every point there, as rerunning a single run does. A sweep over
    tasks (``task=lm,swav``) is ``tasks/<every override, task= too>``: its config's task is only the default."""
    overrides = list(sweep_overrides)
    if any(_key(o) == "task" and any(c in o.partition("=")[2] for c in SWEEP_SYNTAX) for o in overrides):
        return f"tasks/{run_name(overrides, ALWAYS_EXCLUDED, parent=())}"
    return f"{task}/{run_name(overrides, ALWAYS_EXCLUDED)}"


_sweep_name: str | None = None
"""The running multirun's sweep_dir_name, set by NameTheSweep before Hydra first resolves hydra.sweep.dir."""


class NameTheSweep(Callback):
    """Hydra callback (conf/config.yaml): names the multirun's folder from its own config, whose overrides are the
    command line's. ``${shardlab_sweep_dir:}`` is a cached resolver, so Hydra copies the value into every job's
    config, and into the jobs submitit pickles, where the overrides are the point's alone (Hydra's ``${now:}`` reaches
    the jobs the same way)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweep_name
        overrides = [*config.hydra.overrides.task, *launcher_overrides(config.hydra.overrides.hydra)]
        _sweep_name = sweep_dir_name(config.hydra.runtime.choices.task, overrides)


LAUNCHER_KEYS_NAMING_A_SWEEP = (
    "hydra/launcher",
    "hydra.launcher.nodes",
    "hydra.launcher.tasks_per_node",
    "hydra.launcher.gpus_per_node",
    "hydra.launcher.gpus_per_task",
)
"""The launcher and the job's shape name a sweep's folder: ``hydra/launcher=slurm hydra.launcher.nodes=2`` is another
sweep than the same points run here, so it trains there instead of finding the first sweep's finished checkpoints.
Where and how long its jobs wait (partition, timeout_min, wait, poll_s, resources) do not: a resubmission to another
partition or with a longer time limit continues the same sweep. Hydra's other ``hydra.*`` keys do not either."""


def launcher_overrides(hydra_overrides: Iterable[str]) -> list[str]:
    """The command line's overrides of LAUNCHER_KEYS_NAMING_A_SWEEP, for the sweep folder's name; the launcher group
    as ``launcher=slurm``, shorter than its slash escaped as ``%2F`` (a ``%`` in a sweep folder is escaped for sbatch:
    shardlab/jobs/sbatch_paths.py)."""
    named = [o for o in hydra_overrides if _key(o) in LAUNCHER_KEYS_NAMING_A_SWEEP]
    return [f"launcher={o.partition('=')[2]}" if _key(o) == "hydra/launcher" else o for o in named]


def _sweep_dir() -> str:
    if _sweep_name is None:
        raise ValueError("${shardlab_sweep_dir:} names a multirun's folder, and no multirun has started")
    return _sweep_name


def register_resolvers() -> None:
    """``${shardlab_run_name:${hydra:overrides.task}}`` names a single run; ``${shardlab_sweep_dir:}`` a sweep, by
    the command line's overrides; ``${shardlab_sweep_name:<job num>,...}`` a sweep point: its number, then every
    override, so points that differ only in how they run are told apart."""
    if not OmegaConf.has_resolver("shardlab_run_name"):
        OmegaConf.register_new_resolver("shardlab_run_name", lambda overrides: run_name(overrides))
        OmegaConf.register_new_resolver("shardlab_sweep_dir", _sweep_dir, use_cache=True)
        OmegaConf.register_new_resolver(
            "shardlab_sweep_name", lambda num, overrides: f"{num}_{run_name(overrides, ALWAYS_EXCLUDED, parent=())}"
        )
