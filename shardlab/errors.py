"""Typed errors for user mistakes. The CLI prints their message (one line, no traceback) and exits non-zero.

`assert` stays for internal invariants; anything a user can cause by a config, a path or a file raises one of these.
"""

import re

_WORKER_WRAPPER = re.compile(r"Caught (\w+) in (DataLoader worker process \d+|pin memory thread[^\n]*)\.\nOriginal ")


def unwrapped(message: str) -> str:
    """``message`` without the traceback torch's DataLoader wraps a worker's error in: a worker's exception is raised
    again in the main process as ``type(error)("Caught DataError in DataLoader worker process 0.\\nOriginal
    Traceback ...\\nshardlab.errors.DataError: <the message>")``, so with data.num_workers > 0 the one line a user
    should see came as a traceback. The line the error was raised with, as with num_workers=0."""
    wrapped = _WORKER_WRAPPER.match(message)
    if not wrapped:
        return message
    name = wrapped.group(1)
    for line in reversed(message.splitlines()):  # the traceback's last line: "<module>.<name>: <the message>"
        original = re.match(rf"(?:[\w.]+\.)?{name}: (.*)$", line)
        if original:
            return original.group(1)
    return message


class ShardlabError(Exception):
    """Base class: a mistake the user can fix; the message says what and how."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (unwrapped(args[0]),)  # raised again by torch's DataLoader from a worker: its own line
        super().__init__(*args)


class ConfigError(ShardlabError):
    """A config value is unknown, of the wrong type, out of range, or incompatible with another."""


class DataError(ShardlabError):
    """A data path is missing, empty or unreadable."""


class CheckpointError(ShardlabError):
    """A checkpoint is corrupt, incomplete or does not match the model being trained."""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint of another task or model shape: refused, never fallen back from."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would run code when read (a pickle naming more than DCP's metadata classes): refused,
    never fallen back from, never set aside."""


class TrainingDiverged(ShardlabError):
    """The loss or the weights stopped being finite (optimization.max_nonfinite_steps): the run ends failed, and
    nothing non-finite is saved. Not a mistake in the command line, so exit code 1."""

    exit_code = 1


class RunFolderInUse(ShardlabError):
    """Another job holds the run directory's lock (shardlab.jobs.run_lock)."""


class RankFailed(ShardlabError):
    """A training process crashed (its traceback is printed above); not a config mistake, so exit code 1."""

    exit_code = 1


class MasterUnreachable(RankFailed):
    """This rank could not reach the job's master address and port (so it cannot tell the others either)."""


class HostLost(RankFailed):
    """A collective broke because another host of the job went away (its processes killed, the node down)."""


def first_cause(error: BaseException) -> str:
    """A one-line reason; DCP wraps each rank's exception (a BaseException subclass) in CheckpointException."""
    failures = getattr(error, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        error = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback) per rank
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def one_line(error: BaseException) -> str:
    """An error as status.json and the submitter report it: a shardlab error's own line, else its type and last line."""
    if isinstance(error, ShardlabError):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}".rstrip(": ")
