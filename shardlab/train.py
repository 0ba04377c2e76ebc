"""Entry point: `python -m shardlab.train [group=option ...] [key=value ...]`. Wiring only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from shardlab.cli import CONF_DIR, preflight, report_and_exit
from shardlab.config import register_schemas, validate
from shardlab.errors import ShardlabError
from shardlab.registry import load_plugins

register_schemas()
load_plugins()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from shardlab import runner
    from shardlab.distributed import env as dist_env

    try:
        task = runner.build_task(cfg)
        if cfg.dry_run:
            runner.print_plan(cfg, task)
            return
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        env = dist_env.detect()
        if env.launcher == "none" and cfg.distributed.world_size > 1:
            task.prepare_data()  # once, here, so the ranks find it cached and data errors come back as one line
            runner.launch_local(cfg, run_dir, cfg.distributed.world_size)
        else:
            result = runner.run_rank(cfg, run_dir, env)
            if env.is_main and result["final"]:
                print(f"final validation: {runner.format_final(result['final'])}", flush=True)
    except ShardlabError as e:
        report_and_exit(e)


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
