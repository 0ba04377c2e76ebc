"""The checks of a command line before anything runs, so that a mistake comes back as one line with a fix and exit
code 2, not a stack trace, before Hydra makes the run directory (the command line's own checks: before torch is
imported).

shardlab adds no composition of its own to a plain run's (Hydra composes it twice: for the run mode, then the run):
what the command line alone shows (renamed keys, group options) is checked before Hydra starts
(``check_command_line``); Hydra's composition errors are turned into one line (``composition_error``, the CLI has
Hydra raise them rather than print them); and the composed config is checked (every check of ``shardlab.cli.checks``,
once) by ``ComposedConfigChecks``, a Hydra callback that runs between the composition and the run directory
(``check_composed``), and that takes the run's lock before Hydra writes anything there (``hold_the_run``).
``preflight`` does all three in-process for tools and tests, composing through ``compose_config`` as every tool does.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import shardlab.optim  # noqa: F401  (registers the built-in optimizers and schedules with their schemas)
from shardlab.cli import checks
from shardlab.cli.checks import path_errors
from shardlab.cli.conf_options import group_options, option_package, options_of, task_default_options
from shardlab.cli.run_names import register_resolvers
from shardlab.config import CONF_DIR, register_schemas
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError, ShardlabError
from shardlab.jobs import run_lock
from shardlab.jobs.run_folders import checkpoint_dir_error, folder_errors
from shardlab.registry import load_plugins, unknown_name_message, user_dir

GROUPS = ("task", "model", "data", "optimizer", "lr_scheduler", "distributed")
HYDRA_FLAGS = (
    *("-m", "--multirun", "--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--version"),
    *("--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"),
)

RENAMED_KEYS = {"data.jsonl_field": "data.text_field"}
"""Keys shardlab renamed (old: new). Hydra would answer the old name with "Key 'jsonl_field' not in 'LMDataConfig'";
a command line that sets one is told the new name instead (configs saved under the old name still load: the task
reads either)."""


def renamed_key_errors(overrides: list[str]) -> list[str]:
    """One line per override of a renamed key, with the override spelled under its new name."""
    errors = []
    for item in overrides:
        key, sep, value = item.partition("=")
        new = RENAMED_KEYS.get(key.lstrip("+~"))
        if new:
            fix = f"{new}={value}" if sep else f"~{new}"
            errors.append(f"{key.lstrip('+~')} was renamed {new}; use {fix}")
    return errors


def check_group_choices(overrides: list[str]) -> None:
    user_conf = user_dir.conf_dir(user_dir.find(overrides))
    where = " and user_dir's conf/" if user_conf else ""
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.lstrip("+~")
        options = group_options(key, user_conf) if sep and key in GROUPS else []
        if options and "," not in value and value not in options:
            raise ConfigError(unknown_name_message(value, f"{key} option (conf/{key}/*.yaml{where})", options, key))


HOME_PREFIX = re.compile(r"(?:(?<=^)|(?<=,))~(?=/|,|$)")
"""A ``~`` that begins a value, or one of a sweep's comma-separated values, and names the home folder."""


def with_home_expanded(overrides: list[str]) -> list[str]:
    """The overrides with each value's leading ``~`` (``model.pretrained=~/models/x``) made the home folder, as the
    shell does for ``--flag ~/x`` but not after ``key=``; Hydra's grammar would refuse the ``~`` there
    (LexerNoViableAltException). A leading ``~`` of the key itself is Hydra's delete override and is kept."""
    expanded = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and not item.startswith("-") and value.startswith("~"):
            item = key + sep + HOME_PREFIX.sub(lambda _: os.path.expanduser("~"), value)
        expanded.append(item)
    return expanded


def with_user_dir(overrides: list[str]) -> list[str]:
    """The overrides with ``~`` expanded (``with_home_expanded``) and user_dir absolute, after importing its modules
    (beside the built-in plug-ins, registered first) and putting its conf/ on the search path of the Hydra that
    composes next."""
    overrides = user_dir.absolute(with_home_expanded(overrides))
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
    register_resolvers()
    overrides = with_user_dir(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def is_plain_run(argv: list[str]) -> bool:
    """A run (or a rank of one) rather than a sweep, help or config printout, which Hydra handles itself."""
    return not any(a.split("=")[0] in HYDRA_FLAGS or a == "hydra.mode=MULTIRUN" for a in argv)


def job_overrides(argv: list[str]) -> list[str]:
    """The overrides of the job's config, without Hydra's own (hydra.*, hydra/*)."""
    return [a for a in argv if not a.startswith("hydra.") and not a.startswith("hydra/")]


def check_command_line(argv: list[str]) -> None:
    """What the command line alone shows: renamed keys, unknown group options, and model=/data= options of another
    task."""
    overrides = job_overrides(argv)
    renamed = renamed_key_errors(overrides)
    if renamed:
        raise ConfigError("; ".join(renamed))
    check_group_choices(overrides)
    mismatched = task_section_errors(overrides)
    if mismatched:
        raise ConfigError("; ".join(mismatched))


def composition_error(error: BaseException) -> ConfigError:
    """A Hydra or OmegaConf composition error in one line: the first line of each cause names the key and the
    problem."""
    parts = []
    err: BaseException | None = error
    while err is not None:
        first = str(err).strip().splitlines()
        if first:
            parts.append(first[0].rstrip("."))
        err = err.__cause__
    return ConfigError(": ".join(dict.fromkeys(parts)) + " (see `python -m shardlab.train --help`)")


def check_composed(
    cfg: DictConfig, argv: list[str], run_dir: str | None = None, before_paths: Callable[[], None] | None = None
) -> None:
    """The composed config's values (every check of shardlab.cli.checks, once: the run that follows in this process
    finds them done), and the run and checkpoint directories, before Hydra creates the run directory (failing with a
    traceback where it cannot). ``run_dir``: the run's folder as Hydra resolved it (the callback); otherwise an
    explicit hydra.run.dir is checked, or the default's parent (runs/ here; ``build_task(run_dir=...)`` checks an
    exact one). ``before_paths``: run after the values pass and before the paths are probed (the callback takes
    the run's lock there: probing writes in the folder, which a refused job must leave as it was)."""
    checks.check(cfg)
    spelled = next((a.partition("=")[2] for a in argv if a.startswith("hydra.run.dir=")), "runs")
    if "${now:" in spelled.replace(" ", ""):
        raise ConfigError(
            f"hydra.run.dir={spelled} names the run's folder by the clock: a requeue or a rerun resolves it again and "
            "starts over in a new folder, and with a process per rank (torchrun, Slurm tasks) each rank resolves it "
            "at its own moment; leave the default (named by the experiment) or write the date out"
        )
    escape = checkpoint_dir_error(cfg.checkpoint.dir)
    if escape:
        raise ConfigError(escape)
    run_dir = run_dir or spelled
    where = folder_errors(run_dir, cfg.checkpoint.dir) if "${" not in run_dir else []
    if where:  # before the lock: a run refused a system folder writes nothing there
        raise ConfigError("; ".join(where))
    if before_paths is not None:
        before_paths()
    # A rank of a job of several processes keeps the run directory the check made: another rank may have passed its
    # checks already and be opening its log file there, and Hydra makes the directory next anyway.
    several_ranks = dist_env.detect().world_size > 1
    errors = path_errors(cfg, run_dir, keep_run_dir=several_ranks) if "${" not in run_dir else []
    if errors:
        raise ConfigError("; ".join(errors))


def resolved_run_dir(config: DictConfig) -> str:
    """hydra.run.dir as Hydra's run_job resolves it next (its ``${hydra:...}`` interpolations read HydraConfig, which
    run_job sets to this same config first)."""
    HydraConfig.instance().set_config(config)
    return os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))


def hold_the_run(config: DictConfig, run_dir: str) -> None:
    """Before Hydra writes anything in the run folder (``.hydra/``, its log file) and before the path checks probe
    it: global rank 0 takes the run's lock (shardlab.jobs.run_lock), so a job refused there changes nothing in a
    running job's folder. The other ranks leave ``.hydra/`` to rank 0: a rank of a job refused later must not write
    the running job's record either."""
    if config.get("dry_run"):
        dry_run_writes_nothing(config, run_dir)
    elif not dist_env.detect().is_main:
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.output_subdir = None
    else:
        run_lock.take(Path(run_dir), config.checkpoint.dir)


_dry_run_folders: list[Path] = []
"""The run folder of this process's dry run, and each missing folder above it, deepest first: Hydra makes them."""


def dry_run_writes_nothing(config: DictConfig, run_dir: str) -> None:
    """A dry run prints a plan and leaves nothing on disk: Hydra records no ``.hydra/`` and logs to no file, and the
    folders it makes for the run are removed after the plan (``remove_dry_run_folders``)."""
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = None
        logging = config.hydra.job_logging
        if logging is not None and "handlers" in logging and "file" in logging.handlers:
            logging.handlers.pop("file")
            logging.root.handlers = [h for h in logging.root.handlers if h != "file"]
    folder = Path(run_dir)
    _dry_run_folders[:] = []
    while not folder.exists() and folder != folder.parent:
        _dry_run_folders.append(folder)
        folder = folder.parent


def remove_dry_run_folders() -> None:
    """The folders Hydra made for a dry run, removed while they are empty (nothing else wrote there meanwhile)."""
    for folder in _dry_run_folders:
        try:
            folder.rmdir()
        except OSError:
            break
    _dry_run_folders[:] = []


# ---- a sweep point's record, written once the point holds its folder ------------------------------------------------
RECORD_SUBDIR = ".hydra"
"""Where Hydra records a job's config (hydra.output_subdir, by default)."""
RECORD_AFTER_LOCK = "SHARDLAB_RECORD_AFTER_LOCK"
"""Set in a sweep's hydra.job.env_set by ``record_after_lock``: the points' records are shardlab's to write."""


def record_after_lock(config: DictConfig) -> None:
    """A sweep (multirun): Hydra's run_job writes each point's ``.hydra/`` before the point's task function, where the
    lock is taken, so a point refused a folder in use (a sweep rerun while it still runs) rewrote the running point's
    record. The points compose from the sweep's Hydra overrides (every launcher: basic, submitit), which gain
    hydra.output_subdir=null and the marker, so that ``write_record_when_held`` writes the record after the lock."""
    if config.hydra.output_subdir != RECORD_SUBDIR:  # none, or elsewhere: as the user set it
        return
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.overrides.hydra.extend(["hydra.output_subdir=null", f"+hydra.job.env_set.{RECORD_AFTER_LOCK}=1"])


def write_record_when_held(config: DictConfig) -> None:
    """A sweep point's start (Hydra's on_job_start: its folder made, nothing written in it yet): global rank 0 takes
    the point's lock, then writes the record Hydra would have (config.yaml, hydra.yaml, overrides.yaml). Refused, it
    writes nothing: the task function takes the lock again and reports why, as for a single run."""
    from hydra.core.utils import _save_config  # Hydra's own writer: the record reads as Hydra writes it

    if not config.hydra.job.env_set.get(RECORD_AFTER_LOCK) or not dist_env.detect().is_main:
        return  # not a marked sweep point; or not rank 0, which leaves the record to rank 0 (hold_the_run)
    run_dir = Path(config.hydra.runtime.output_dir)
    if not config.get("dry_run"):
        try:
            run_lock.take(run_dir, config.checkpoint.dir)
        except ShardlabError:
            return
    task_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    hydra_cfg = OmegaConf.create({"hydra": OmegaConf.to_container(config.hydra)})  # a writable copy, unresolved
    hydra_cfg.hydra.output_subdir = RECORD_SUBDIR  # as Hydra would have recorded it, without shardlab's marker
    hydra_cfg.hydra.overrides.hydra = list(config.hydra.overrides.hydra)[:-2]
    hydra_cfg.hydra.job.env_set.pop(RECORD_AFTER_LOCK)
    _save_config(task_cfg, "config.yaml", run_dir / RECORD_SUBDIR)
    _save_config(hydra_cfg, "hydra.yaml", run_dir / RECORD_SUBDIR)
    _save_config(config.hydra.overrides.task, "overrides.yaml", run_dir / RECORD_SUBDIR)


class ConfigRefused(SystemExit):
    """The composed config failed its checks inside Hydra, which turns a callback's exceptions into warnings and goes
    on; a SystemExit passes through it to the CLI, which reports ``error``."""

    def __init__(self, error: ShardlabError) -> None:
        super().__init__(f"error: {error}")
        self.error = error


class ComposedConfigChecks(Callback):
    """Hydra callback (conf/config.yaml): ``check_composed`` on the config a run composed, called by Hydra after the
    composition and before it makes the run directory, so the run's composition is also the checked one. Hydra
    reports what fails after it as in any Hydra app. In a sweep it has each point's record written once the point
    holds its folder (``record_after_lock``, ``write_record_when_held``)."""

    reached = False
    """Whether a composition got this far in this process: an error before it was the composition's own."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        ComposedConfigChecks.reached = True
        try:
            run_dir = resolved_run_dir(config)
            # the command line Hydra composed (shardlab.train.cli set it)
            check_composed(config, sys.argv[1:], run_dir, before_paths=lambda: hold_the_run(config, run_dir))
        except Exception as e:  # any failure refuses the run: Hydra would only warn and go on unchecked
            raise ConfigRefused(e if isinstance(e, ShardlabError) else composition_error(e)) from None
        hydra_reports_errors_again()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        record_after_lock(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        write_record_when_held(config)


# ---- Hydra's errors, raised to the CLI until the composition is checked ----------------------------------------------
RAISED_BY_HYDRA = "HYDRA_FULL_ERROR"
"""Hydra's documented switch to raise its errors rather than print them (when exactly "1"). The CLI sets it while
Hydra composes, so that a composition error reaches the CLI and comes back as one line."""
_user_value: list[str | None] = []
"""The switch as the user had it, while the CLI holds it (empty otherwise)."""


@contextlib.contextmanager
def composition_errors_raised() -> Iterator[None]:
    """Hydra raises what fails while it composes; the user's own setting of the switch is put back after."""
    _user_value[:] = [os.environ.get(RAISED_BY_HYDRA)]
    os.environ[RAISED_BY_HYDRA] = "1"
    try:
        yield
    finally:
        hydra_reports_errors_again()


def hydra_reports_errors_again() -> None:
    """The switch as the user set it (or unset): once the composed config is checked, what fails is Hydra's to
    report, and no child process inherits the CLI's setting."""
    if _user_value:
        value = _user_value.pop()
        if value is None:
            os.environ.pop(RAISED_BY_HYDRA, None)
        else:
            os.environ[RAISED_BY_HYDRA] = value


def preflight(argv: list[str]) -> DictConfig | None:
    """The CLI's checks in-process: the command line, the composition (``compose_config``), the composed config.
    Returns the config, or None where Hydra handles things itself (sweeps, help)."""
    if not is_plain_run(argv):
        return None
    check_command_line(argv)
    try:
        cfg = compose_config(job_overrides(argv))
    except Exception as e:
        raise composition_error(e) from None
    check_composed(cfg, argv)
    return cfg
