"""Run several training configs in one set of spawned gloo ranks (a spawn costs seconds; a config, milliseconds).

Each rank runs every config in order through shardlab.runner.run_rank, keeping the process group between them;
rank 0's results come back to the test through a pickle file.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp
from omegaconf import OmegaConf

from shardlab.distributed import env as dist_env


def _worker(
    rank: int, world: int, port: int, cfg_yamls: list[str], run_dirs: list[str], prepare, inspect, out: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from shardlab.runner import run_rank

    if prepare is not None:
        prepare()
    env = dist_env.detect(spawned_rank=rank, spawned_world=world, spawned_port=port)
    results = []
    for i, (cfg_yaml, run_dir) in enumerate(zip(cfg_yamls, run_dirs, strict=True)):
        result = run_rank(
            OmegaConf.create(cfg_yaml), Path(run_dir), env, after_fit=inspect, teardown=i == len(cfg_yamls) - 1
        )
        results.append(result)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)
    dist_env.end_finished_rank()


def run_spawned(
    cfgs: list,
    world_size: int,
    run_dirs: list[Path] | None = None,
    inspect: Callable | None = None,
    prepare: Callable | None = None,
) -> list[dict]:
    """Train each config on ``world_size`` local ranks; rank 0's run_rank results, in order.

    ``inspect(trainer) -> dict`` (a module-level function, so it pickles) runs on every rank after each fit; its
    rank-0 result is merged into that config's result. ``prepare()`` runs once per rank before the first config
    (e.g. to patch a collective and record what reaches it).
    """
    tmp = tempfile.mkdtemp(prefix="shardlab-spawn-")
    run_dirs = run_dirs or [Path(tmp) / f"run{i}" for i in range(len(cfgs))]
    out = os.path.join(tmp, "results.pkl")
    yamls = [OmegaConf.to_yaml(c, resolve=True) for c in cfgs]
    mp.start_processes(
        _worker,
        args=(world_size, dist_env.free_port(), yamls, [str(d) for d in run_dirs], prepare, inspect, out),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    with open(out, "rb") as f:
        return pickle.load(f)


def _outcome_worker(rank: int, world: int, port: int, cfg_yaml: str, run_dir: str, prepare, out_dir: str) -> None:
    import json
    import time

    os.environ["OMP_NUM_THREADS"] = "1"
    from shardlab.runner import run_rank

    if prepare is not None:
        prepare(rank)
    env = dist_env.detect(spawned_rank=rank, spawned_world=world, spawned_port=port)
    started, outcome = time.monotonic(), {}
    try:
        result = run_rank(OmegaConf.create(cfg_yaml), Path(run_dir), env)
        outcome = {"error": None, "steps": [r["step"] for r in result["history"] if r["split"] == "train"]}
    except BaseException as e:  # noqa: B036  (what each rank ended with is the point)
        outcome = {"error": f"{type(e).__name__}: {e}"}
    outcome["seconds"] = time.monotonic() - started
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    dist_env.end_finished_rank()


def run_spawned_outcomes(cfg, world_size: int, run_dir: Path, prepare: Callable | None = None) -> list[dict]:
    """Train ``cfg`` on ``world_size`` local ranks and return how each rank ended: {"error": "Type: message" or
    None, "steps": train steps logged (rank 0), "seconds": time in run_rank}; ``prepare(rank)`` runs first in each
    rank (a module-level function). For checking that a failure one rank
    sees reaches every rank, at once and in the same words."""
    import json

    out = tempfile.mkdtemp(prefix="shardlab-outcomes-")
    mp.start_processes(
        _outcome_worker,
        args=(world_size, dist_env.free_port(), OmegaConf.to_yaml(cfg, resolve=True), str(run_dir), prepare, out),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
