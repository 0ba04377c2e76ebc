"""Command-line checks that run before Hydra does, so mistakes come back as one line with a fix, not a stack trace.

Hydra would reject a bad group option or a mistyped override too, but over several lines; composing the same
overrides here first lets shardlab answer in its own words (with a did-you-mean) and exit with code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from shardlab.config import path_errors, register_schemas
from shardlab.errors import ConfigError, ShardlabError
from shardlab.registry import load_plugins, unknown_name_message

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("task", "model", "data", "optimizer", "lr_scheduler", "distributed")
HYDRA_FLAGS = (
    "-m",
    "--multirun",
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
)


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_choices(overrides: list[str]) -> None:
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("+~")
        if sep and key in GROUPS and "," not in value and value not in group_options(key):
            raise ConfigError(unknown_name_message(value, f"{key} option (conf/{key}/*.yaml)", group_options(key), key))


def compose_config(overrides: list[str]) -> DictConfig:
    """The config ``overrides`` compose to, outside Hydra's app (pre-flight, tools, tests): schemas and task plug-ins
    registered first."""
    register_schemas()
    load_plugins()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def preflight(argv: list[str]) -> DictConfig | None:
    """Compose the job's config as Hydra will; returns None where Hydra should handle things itself (sweeps, help)."""
    if any(a.split("=")[0] in HYDRA_FLAGS for a in argv):
        return None
    overrides = [a for a in argv if not a.startswith("hydra.") and not a.startswith("hydra/")]
    check_group_choices(overrides)
    try:
        cfg = compose_config(overrides)
    except Exception as e:  # Hydra/OmegaConf errors: the first line of each cause names the key and the problem
        parts = []
        err: BaseException | None = e
        while err is not None:
            first = str(err).strip().splitlines()
            if first:
                parts.append(first[0].rstrip("."))
            err = err.__cause__
        raise ConfigError(": ".join(dict.fromkeys(parts)) + " (see `python -m shardlab.train --help`)") from None
    # Hydra creates the run directory before shardlab's code runs, failing with a traceback where it cannot: check an
    # explicit hydra.run.dir (or the default's parent, runs/ here) first. build_task checks the exact one again.
    run_dir = next((a.partition("=")[2] for a in argv if a.startswith("hydra.run.dir=")), "runs")
    errors = path_errors(cfg, run_dir) if "${" not in run_dir else []
    if errors:
        raise ConfigError("; ".join(errors))
    return cfg


def report_and_exit(error: ShardlabError) -> None:
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(getattr(error, "exit_code", 2))


def run_tool(main: Callable[[], object]) -> None:
    """Run a tools/ script's main the way the trainer's CLI runs: a user mistake is one line and exit code 2."""
    try:
        main()
    except ShardlabError as e:
        report_and_exit(e)
