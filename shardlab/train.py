"""Entry point: `python -m shardlab.train [group=option ...] [key=value ...]`.

Hydra composes the command line (twice: once for the run mode, once for the run); shardlab.cli.preflight checks it
before and after, so a mistake comes back as one line with a fix and exit code 2, not a stack trace, before the run
directory exists, and takes the run's lock before Hydra writes its record there (a job refused a folder in use
changes nothing in it). Hydra's task function then hands the job to shardlab.runner.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from shardlab.cli.preflight import (
    ComposedConfigChecks,
    ConfigRefused,
    check_command_line,
    composition_error,
    composition_errors_raised,
    hydra_reports_errors_again,
    is_plain_run,
    remove_dry_run_folders,
    with_user_dir,
)
from shardlab.cli.run_names import register_resolvers
from shardlab.config import CONF_DIR, register_schemas
from shardlab.errors import MasterUnreachable, ShardlabError, one_line
from shardlab.jobs import run_lock
from shardlab.registry import load_plugins

register_schemas()
register_resolvers()  # the run folder's name (conf/config.yaml's hydra.run.dir), before Hydra composes it
load_plugins()


def tell_peers(error: BaseException) -> None:
    """A rank of a multi-rank job failed before joining the others: tell them, or they wait minutes for it."""
    from shardlab.distributed import env as dist_env

    env = dist_env.detect()
    if env.world_size > 1:
        from shardlab.distributed.join import cannot_tell_peers, tell_peers_before_joining

        if isinstance(error, MasterUnreachable):
            cannot_tell_peers()  # their store is out of this rank's reach: trying would only wait EARLY_CONNECT_S
        else:
            tell_peers_before_joining(env, one_line(error))


def report_and_exit(error: ShardlabError, tell: bool = False) -> None:
    print(f"error: {error}", file=sys.stderr, flush=True)
    if tell:  # after the message: reaching the other ranks may take seconds
        tell_peers(error)
    sys.exit(getattr(error, "exit_code", 2))


def run_tool(main: Callable[[], object]) -> None:
    """Run a tools/ script's main the way the trainer's CLI runs: a user mistake is one line and exit code 2. A tool
    is one process by design: DCP's warning that it loads or saves without torch.distributed is not news to its user."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    try:
        main()
    except ShardlabError as e:
        report_and_exit(e)


# ---- Hydra's task function -------------------------------------------------------------------------------------------
@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One run (or one sweep point); returns its final validation loss for sweepers."""
    from shardlab import runner

    hydra_reports_errors_again()  # done by the checks already, unless the config dropped hydra.callbacks
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        result = runner.run_job(cfg, run_dir, list(hydra_cfg.overrides.task))
        if cfg.get("dry_run"):
            remove_dry_run_folders()  # a plan writes nothing
        return result
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
        plain_run = is_plain_run(sys.argv[1:])
        if plain_run:
            check_command_line(sys.argv[1:])
    except ShardlabError as e:
        report_and_exit(e, tell=True)
    try:
        if not plain_run:  # sweeps, help, --cfg: Hydra's own (a run named by -cn/-cp/-cd: the callback checks it)
            main()
            return
        with composition_errors_raised():
            main()
    except ConfigRefused as refused:  # by ComposedConfigChecks, before the run directory exists
        report_and_exit(refused.error, tell=True)
    except SystemExit as e:
        # Hydra reports what fails between the checks and the run (making the run directory, opening its log file)
        # and exits 1; the other ranks would wait minutes for this one. (A failure told already is not told again.)
        if e.code not in (0, None):
            tell_peers(RuntimeError(f"the run did not start (exit code {e.code}; the reason is in this rank's output)"))
        raise
    except Exception as e:
        if ComposedConfigChecks.reached:
            tell_peers(e)
            raise
        report_and_exit(composition_error(e), tell=True)
    finally:  # the run's lock, taken by the checks, if Hydra failed before the run could release it
        run_lock.release_all()


if __name__ == "__main__":
    cli()
