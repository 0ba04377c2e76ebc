"""Which overrides name a run: the run directory follows the experiment, not the way it is launched.

``runs/<task>/<name>`` is built from the command line's overrides minus the keys that only change how a run executes
(its launcher, world size, backend and sharding knobs, logging, validation cadence, checkpoint handling, its length,
where data is cached). So a run resumed on another world size or backend, or extended with a larger
optimization.max_steps, finds its own checkpoints instead of silently starting a fresh run elsewhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import PurePath

from omegaconf import OmegaConf

HOW_IT_RUNS = (
    "distributed",
    "logging",
    "validation",
    "checkpoint",
    "optimization.max_steps",
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


def run_name(overrides: Iterable[str], prefixes: Iterable[str] = HOW_IT_RUNS) -> str:
    """A directory name from the overrides that name the run: sorted ``key=value`` joined by commas; ``default``
    when none do. Slashes in values (paths) become underscores so one run is one directory."""
    prefixes = tuple(prefixes)
    kept = sorted(_shown(o) for o in overrides if not _excluded(_key(o), prefixes))
    name = ",".join(kept).replace("/", "_") or "default"
    if len(name) > MAX_NAME:
        name = f"{name[: MAX_NAME - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def register_resolvers() -> None:
    """``${shardlab_run_name:${hydra:overrides.task}}`` names a single run; ``${shardlab_sweep_name:<job num>,...}``
    a sweep point: its number, then every override, so points that differ only in how they run are told apart."""
    if not OmegaConf.has_resolver("shardlab_run_name"):
        OmegaConf.register_new_resolver("shardlab_run_name", lambda overrides: run_name(overrides))
        OmegaConf.register_new_resolver(
            "shardlab_sweep_name", lambda num, overrides: f"{num}_{run_name(overrides, ALWAYS_EXCLUDED)}"
        )
