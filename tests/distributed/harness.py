"""Run several training configs in one set of spawned gloo ranks (a spawn costs seconds; a config, milliseconds).

Each rank runs every config in order through shardlab.runner.run_rank, keeping the process group between them;
rank 0's results come back to the test through a pickle file.

Ranks start from a fork server (multiprocessing's "forkserver"): one process per pytest process that imports torch
and shardlab once (PRELOAD), from which every later rank is forked. A rank started by "spawn" is a fresh interpreter
that imports them itself, ~4 s of CPU each: on 2 cores under the suite's load, 10 s for every set of 2 ranks, and
the default suite starts ~35 sets. The ranks run the same code either way, with the test's environment and working
directory at the call (``_started``: the server's are those of its own start). The process differs in one way,
what it shares with the server: pages the server imported are shared until written, so resident memory above a
rank's start is not what a fresh process would measure; the tests that hold the memory plan to that measurement
pass ``start_method="spawn"``. (shardlab's own launcher spawns its local ranks; the CLI tests cover that path.)
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from shardlab.distributed import env as dist_env

PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "shardlab.checkpoint.manager",
    "shardlab.distributed.ddp",
    "shardlab.distributed.fully_sharded",
    "shardlab.runner",
    "shardlab.trainer",
    "shardlab_tasks.lm.task",
    "tests.distributed.harness",
]
"""What the fork server imports once: most of what a rank imports by the end of its first config (the trainer pulls
in dynamo, FSDP2 and DCP; the harness pulls in the tests package, whose conftest registers shardlab's schemas and
plugins). Importing starts no thread, so forking after it is safe."""
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
# One intra-op thread in every process that imports this module: the fork server (PRELOAD ends with it), so every
# process forked from it, and a spawned rank, which imports it to unpickle its worker. Setting OMP_NUM_THREADS in a
# rank comes too late, torch being imported by then: a rank had as many threads as cores (measured: 2 here), and
# threads that spin against the other ranks on 2 cores slow every op (tests/conftest.py).
torch.set_num_threads(1)


def _started(environ: dict[str, str], cwd: str) -> None:
    """First thing in a rank: the test's environment and working directory at the call, as a spawned rank inherits
    them (a forked one has the server's, from whenever the server started); and "spawn" as the rank's own start
    method, a spawned rank's default, so the processes a rank starts (DataLoader workers) start as they would."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.chdir(cwd)
    multiprocessing.set_start_method("spawn", force=True)


def _worker(
    rank: int,
    world: int,
    port: int,
    cfg_yamls: list[str],
    run_dirs: list[str],
    prepare,
    inspect,
    out: str,
    environ: dict[str, str],
    cwd: str,
) -> None:
    _started(environ, cwd)
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
    start_method: str = "forkserver",
) -> list[dict]:
    """Train each config on ``world_size`` local ranks; rank 0's run_rank results, in order.

    ``inspect(trainer) -> dict`` (a module-level function, so it pickles) runs on every rank after each fit; its
    rank-0 result is merged into that config's result. ``prepare()`` runs once per rank before the first config
    (e.g. to patch a collective and record what reaches it). ``start_method="spawn"``: fresh interpreters, for
    measuring a rank's memory (the module's docstring).
    """
    tmp = tempfile.mkdtemp(prefix="shardlab-spawn-")
    run_dirs = run_dirs or [Path(tmp) / f"run{i}" for i in range(len(cfgs))]
    out = os.path.join(tmp, "results.pkl")
    yamls = [OmegaConf.to_yaml(c, resolve=True) for c in cfgs]
    mp.start_processes(
        _worker,
        args=(
            world_size,
            dist_env.free_port(),
            yamls,
            [str(d) for d in run_dirs],
            prepare,
            inspect,
            out,
            dict(os.environ),
            os.getcwd(),
        ),
        nprocs=world_size,
        join=True,
        start_method=start_method,
    )
    with open(out, "rb") as f:
        return pickle.load(f)


def _outcome_worker(
    rank: int,
    world: int,
    port: int,
    cfg_yaml: str,
    run_dir: str,
    prepare,
    out_dir: str,
    environ: dict[str, str],
    cwd: str,
) -> None:
    import json
    import time

    _started(environ, cwd)
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
        args=(
            world_size,
            dist_env.free_port(),
            OmegaConf.to_yaml(cfg, resolve=True),
            str(run_dir),
            prepare,
            out,
            dict(os.environ),
            os.getcwd(),
        ),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]
