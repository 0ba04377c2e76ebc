"""Typed errors for user mistakes. The CLI prints their message (one line, no traceback) and exits non-zero.

`assert` stays for internal invariants; anything a user can cause by a config, a path or a file raises one of these.
"""


class ShardlabError(Exception):
    """Base class: a mistake the user can fix; the message says what and how."""


class ConfigError(ShardlabError):
    """A config value is unknown, of the wrong type, out of range, or incompatible with another."""


class DataError(ShardlabError):
    """A data path is missing, empty or unreadable."""


class CheckpointError(ShardlabError):
    """A checkpoint is corrupt, incomplete or does not match the model being trained."""


class IncompatibleCheckpointError(CheckpointError):
    """A readable checkpoint of another task or model shape: refused, never fallen back from."""


class RankFailed(ShardlabError):
    """A training process crashed (its traceback is printed above); not a config mistake, so exit code 1."""

    exit_code = 1
