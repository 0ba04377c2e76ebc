"""Errors one rank sees, every rank sees: the checkpoint's decisions and failures, agreed over all ranks.

Rank 0 alone changes the checkpoint folder (publish, prune, set aside, clean up) and decides what to resume. If it
failed alone and the others went on to a barrier, they would wait there until the collective timeout and die with a
message that names nothing. Here each such step ends in an exchange: the first failing rank's one-line message reaches
every rank, which all raise it at once, as DCP does for its own reads and writes. Text travels as bytes in
broadcasts; nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardlab.errors import CheckpointError, ConfigError, ShardlabError, first_cause


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def broadcast_text(text: str, src: int, device: torch.device) -> str:
    """Rank ``src``'s ``text`` on every rank (two broadcasts: its length, then its bytes)."""
    if not _distributed():
        return text
    mine = dist.get_rank() == src
    data = torch.tensor(list(text.encode()), dtype=torch.uint8) if mine else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    buf = data.to(device) if mine else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    return bytes(buf.cpu().tolist()).decode()


def first_error(message: str | None, device: torch.device) -> str | None:
    """The message of the lowest rank that has one (None where no rank has), the same on every rank."""
    if not _distributed():
        return message
    world = dist.get_world_size()
    lowest = torch.tensor([dist.get_rank() if message is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    src = int(lowest.item())
    if src == world:
        return None
    return broadcast_text(message or "", src, device)


ERROR_TYPES = {"ConfigError": ConfigError, "CheckpointError": CheckpointError}


def encode(error: BaseException, what: str) -> str:
    """An error as one line that ``raise_agreed`` turns back into the same typed error on every rank."""
    if isinstance(error, ShardlabError):
        kind = "ConfigError" if isinstance(error, ConfigError) else "CheckpointError"
        return f"{kind}:{error}"
    return f"CheckpointError:{what} failed ({first_cause(error)})"


def raise_agreed(agreed: str | None) -> None:
    if agreed is not None:
        kind, _, message = agreed.partition(":")
        raise ERROR_TYPES.get(kind, CheckpointError)(message)


def on_rank0(action: Callable[[], str], what: str, device: torch.device) -> str:
    """Run ``action`` on rank 0 alone and hand its text result to every rank; if it raised, every rank raises the
    same one-line error (typed ConfigError or CheckpointError, as rank 0 saw it). ``what`` names the step in the
    message of an unexpected error (an OSError: quota, permissions, a full disk)."""
    result, error = "", None
    if not _distributed() or dist.get_rank() == 0:
        try:
            result = action()
        except Exception as e:
            error = encode(e, what)
    raise_agreed(first_error(error, device))
    return broadcast_text(result, 0, device)


def agree(error: BaseException | None, what: str, device: torch.device) -> None:
    """Every rank raises the lowest failing rank's error (as one line) if any rank has one; the rank it came from
    raises its own typed exception (same message)."""
    mine = encode(error, what) if error is not None else None
    agreed = first_error(mine, device)
    if agreed is not None and agreed == mine and isinstance(error, ShardlabError):
        raise error
    raise_agreed(agreed)
