"""A job that spans several hosts needs a checkpoint folder they all see.

Each rank writes its own shards of every checkpoint into checkpoint.dir, and rank 0 publishes the step. On node-local
storage (a node's /tmp, local scratch) each host would hold only its ranks' part of every checkpoint, rank 0 would
publish steps whose other shards lie on other disks, and a resume on any other layout would find them incomplete. So
before the model is built, rank 0 writes a marker file there and every rank looks for it; a rank that cannot see it
stops the whole job, in one line naming its host and the folder.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab.checkpoint.agreement import agree, broadcast_text
from shardlab.errors import ConfigError

VISIBLE_WITHIN_S = 10.0
"""How long a rank looks for rank 0's marker: a network file system may show another client's new file only after
its attribute cache expires (NFS's acdirmax defaults to 60 s, but a lookup of a name not cached goes to the server)."""


def require_shared_folder(folder: Path, hosts: list[str], device: torch.device) -> None:
    """Raise the same ConfigError on every rank if a rank does not see what rank 0 writes into ``folder``
    (checkpoint.dir); ``hosts``: each rank's host. Nothing to check (and nothing written) on one host."""
    if len(set(hosts)) <= 1:
        return
    rank = dist.get_rank()
    token = broadcast_text(secrets.token_hex(8) if rank == 0 else "", 0, device)
    marker = folder / f".shardlab-shared-{token}"
    error = None
    if rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"written by rank 0 on {hosts[0]} to check that every host sees this folder\n")
        except OSError as e:
            error = ConfigError(f"checkpoint.dir {folder}: rank 0 on {hosts[0]} cannot write there ({e.strerror})")
    agree(error, "checking checkpoint.dir", device)
    seen = _appears(marker)
    flags = torch.zeros(len(hosts), dtype=torch.int32, device=device)
    flags[rank] = int(seen)
    dist.all_reduce(flags)
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = [r for r, flag in enumerate(flags.tolist()) if not flag]
    if blind:
        where = sorted({hosts[r] for r in blind})
        raise ConfigError(
            f"checkpoint.dir {folder} is not shared between the job's hosts: {', '.join(where)} (rank"
            f"{'s' if len(blind) > 1 else ''} {', '.join(map(str, blind))}) cannot see the file rank 0 on {hosts[0]} "
            "wrote there, so each host would hold only part of every checkpoint; put the run (hydra.run.dir / "
            "hydra.sweep.dir) or checkpoint.dir on a file system every node mounts"
        )


def _appears(marker: Path) -> bool:
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while not marker.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
