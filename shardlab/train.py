"""Entry point: `python -m shardlab.train [group=option ...] [key=value ...]`.

The command line is composed here once before Hydra runs (``preflight``), so a mistake comes back as one line with a
fix and exit code 2, not a stack trace; then Hydra's task function hands the job to shardlab.runner. Tools and tests
compose configs through the same ``compose_config``.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import shardlab.optim  # noqa: F401  (registers the built-in optimizers and schedules with their schemas)
from shardlab.config import (
    CONF_DIR,
    group_options,
    option_package,
    options_of,
    path_errors,
    register_schemas,
    task_default_options,
    validate,
)
from shardlab.errors import ConfigError, ShardlabError, one_line
from shardlab.registry import load_plugins, unknown_name_message, user_dir

GROUPS = ("task", "model", "data", "optimizer", "lr_scheduler", "distributed")
HYDRA_FLAGS = (
    *("-m", "--multirun", "--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--version"),
    *("--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"),
)

register_schemas()
load_plugins()


# ---- before Hydra: compose the overrides and answer mistakes in one line ---------------------------------------------
def check_group_choices(overrides: list[str]) -> None:
    user_conf = user_dir.conf_dir(user_dir.find(overrides))
    where = " and user_dir's conf/" if user_conf else ""
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("+~")
        options = group_options(key, user_conf) if sep and key in GROUPS else []
        if options and "," not in value and value not in options:
            raise ConfigError(unknown_name_message(value, f"{key} option (conf/{key}/*.yaml{where})", options, key))


def with_user_dir(overrides: list[str]) -> list[str]:
    """The overrides with user_dir absolute, after importing its modules (beside the built-in plug-ins, registered
    first) and putting its conf/ on the search path of the Hydra that composes next; unchanged without a user_dir."""
    overrides = user_dir.absolute(overrides)
    user_dir.put_conf_on_search_path(user_dir.find(overrides), CONF_DIR)
    load_plugins(user_dir.find(overrides))
    return overrides


def task_section_errors(overrides: list[str]) -> list[str]:
    """model=/data= options of another task than the chosen one (conf/task/<task>.yaml picks its own defaults):
    found before composing, where the mismatch would fail on the task's own keys with a message naming neither."""
    chosen = {k.lstrip("+~"): v for k, _, v in (o.partition("=") for o in overrides) if k.lstrip("+~") in GROUPS}
    task = chosen.get("task", "lm")
    defaults = task_default_options(task)
    errors = []
    for group in ("model", "data"):
        option = chosen.get(group)
        if option is None or "," in option or group not in defaults:
            continue
        own, theirs = option_package(group, defaults[group]), option_package(group, option)
        if own and theirs and own != theirs:
            errors.append(
                f"{group}={option} is a {group} config of another task ({theirs}); task={task} reads its own: "
                f"{group}={' | '.join(options_of(group, own))}"
            )
    return errors


def compose_config(overrides: list[str]) -> DictConfig:
    """The config ``overrides`` compose to, outside Hydra's app (pre-flight, tools, tests): schemas, task plug-ins and
    a user_dir's registered first."""
    register_schemas()
    overrides = with_user_dir(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def preflight(argv: list[str]) -> DictConfig | None:
    """Compose the job's config as Hydra will; returns None where Hydra should handle things itself (sweeps, help)."""
    if any(a.split("=")[0] in HYDRA_FLAGS for a in argv):
        return None
    overrides = [a for a in argv if not a.startswith("hydra.") and not a.startswith("hydra/")]
    check_group_choices(overrides)
    mismatched = task_section_errors(overrides)
    if mismatched:
        raise ConfigError("; ".join(mismatched))
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


def tell_peers(error: BaseException) -> None:
    """A rank of a multi-rank job failed before joining the others: tell them, or they wait minutes for it."""
    from shardlab.distributed import env as dist_env

    env = dist_env.detect()
    if env.world_size > 1:
        from shardlab.distributed.join import tell_peers_before_joining

        tell_peers_before_joining(env, one_line(error))


def report_and_exit(error: ShardlabError, tell: bool = False) -> None:
    print(f"error: {error}", file=sys.stderr, flush=True)
    if tell:  # after the message: reaching the other ranks may take seconds
        tell_peers(error)
    sys.exit(getattr(error, "exit_code", 2))


def run_tool(main: Callable[[], object]) -> None:
    """Run a tools/ script's main the way the trainer's CLI runs: a user mistake is one line and exit code 2."""
    try:
        main()
    except ShardlabError as e:
        report_and_exit(e)


# ---- Hydra's task function -------------------------------------------------------------------------------------------
@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One run (or one sweep point); returns its final validation loss for sweepers."""
    from shardlab import runner

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        return runner.run_job(cfg, run_dir, list(hydra_cfg.overrides.task))
    except Exception as e:  # tell_peers is a no-op for a rank that has joined: its failures reach the others anyway
        if hydra_cfg.mode != RunMode.MULTIRUN:
            if isinstance(e, ShardlabError):
                report_and_exit(e, tell=True)
            tell_peers(e)
            raise
        # A sweep point that fails must not stop the others: it is recorded as failed in its status.json (rank 0
        # did), reported here in its own words, and in the summary at the end.
        print(f"error: {e}" if isinstance(e, ShardlabError) else traceback.format_exc(), file=sys.stderr, flush=True)
        tell_peers(e)
        if os.environ.get("SUBMITIT_EXECUTOR"):
            raise  # a submitit job: the job itself must fail (the launcher raises it past Hydra's run_job)
        return math.nan


def cli() -> None:
    try:
        sys.argv[1:] = with_user_dir(sys.argv[1:])  # before Hydra reads the command line: it composes with it
        cfg = preflight(sys.argv[1:])
        if cfg is not None:  # generic checks now, before torch is even imported; task checks follow in main
            validate(cfg, int(os.environ.get("WORLD_SIZE", 0)) or None)
    except ShardlabError as e:
        report_and_exit(e, tell=True)
    main()


if __name__ == "__main__":
    cli()
