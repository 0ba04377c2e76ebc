"""Entry point: `python -m shardlab.train [group=option ...] [key=value ...]`. Wiring only."""

from __future__ import annotations

import math
import os
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from shardlab.cli import CONF_DIR, preflight, report_and_exit
from shardlab.config import register_schemas, validate
from shardlab.errors import ShardlabError
from shardlab.registry import load_plugins

register_schemas()
load_plugins()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra's task function: one run (or one sweep point); returns its final validation loss for sweepers."""
    from shardlab import runner

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        return runner.run_job(cfg, run_dir, list(hydra_cfg.overrides.task))
    except Exception as e:
        if hydra_cfg.mode != RunMode.MULTIRUN:
            if isinstance(e, ShardlabError):
                report_and_exit(e)
            raise
        # A sweep point that fails must not stop the others: it is recorded as failed in its status.json (rank 0
        # did), reported here in its own words, and in the summary at the end.
        print(f"error: {e}" if isinstance(e, ShardlabError) else traceback.format_exc(), file=sys.stderr, flush=True)
        if os.environ.get("SUBMITIT_EXECUTOR"):
            raise  # a submitit job: the job itself must fail (the launcher raises it past Hydra's run_job)
        return math.nan


def cli() -> None:
    try:
        cfg = preflight(sys.argv[1:])
        if cfg is not None:  # generic checks now, before torch is even imported; task checks follow in main
            validate(cfg, int(os.environ.get("WORLD_SIZE", 0)) or None)
    except ShardlabError as e:
        report_and_exit(e)
    main()


if __name__ == "__main__":
    cli()
