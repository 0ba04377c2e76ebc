"""A corpus cache's own JSON files (meta.json, the shard plan and records, the build lock), read through the project's
one reader (shardlab/files/regular_file.py): a cache folder is shared between runs and users, and what sits there
under one of these names may be a FIFO (a reader blocks for ever), a link to /dev/zero (a reader grows without end) or
a file someone edited. Each is refused in one line naming the file and the fix (delete the cache to preprocess it
again); shardlab never writes such a thing there itself."""

from __future__ import annotations

import os
from pathlib import Path

from shardlab.errors import DataError
from shardlab.files.regular_file import MiB, NotAFile, describe_os_error, open_file, read_json_file, stat_file

CACHE_JSON_MAX_BYTES = 256 * MiB
"""The largest JSON file of a cache read: a plan or record lists its files' paths (a million files of ~200 bytes)."""


def read_cache_json(path: Path, cache: Path, *, missing_ok: bool = False) -> dict | None:
    """The JSON object in the cache file ``path`` of the cache folder ``cache``; None if it is missing and
    ``missing_ok``; otherwise a DataError naming it, and telling to delete ``cache``."""
    fix = f"delete {cache} to preprocess again"
    try:
        value = read_json_file(path, max_bytes=CACHE_JSON_MAX_BYTES)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise DataError(f"{path} is missing; {fix}") from None
    except NotAFile as e:
        raise DataError(f"{path} {e.reason}; {fix}") from None
    except OSError as e:
        raise DataError(f"{path} {describe_os_error(path, e)}; {fix}") from None
    except ValueError as e:
        raise DataError(f"{path} is not JSON ({_first_line(e)}); {fix}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path} holds a JSON {type(value).__name__}, not the object shardlab writes; {fix}")
    return value


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:200] if str(error) else type(error).__name__


def open_cache_file(path: Path, cache: Path):
    """The cache file ``path`` (a token file) open for reading as a binary file object, refused as ``read_cache_json``
    refuses: a link, a FIFO or a device where a token file should be."""
    try:
        fd, _ = open_file(path)
    except NotAFile as e:
        raise DataError(f"{path} {e.reason}; delete {cache} to preprocess again") from None
    except FileNotFoundError:
        raise DataError(f"{path} is missing; delete {cache} to preprocess again") from None
    except OSError as e:
        raise DataError(f"{path} {describe_os_error(path, e)}; delete {cache} to preprocess again") from None
    return os.fdopen(fd, "rb")


def token_file_size(path: Path, cache: Path) -> int | None:
    """The size of the cache's token file ``path`` (None if it is missing), checked as a regular file of the cache
    without opening it: a link, FIFO or device under its name is refused before numpy maps it by name."""
    try:
        return stat_file(path).st_size
    except FileNotFoundError:
        return None
    except NotAFile as e:
        raise DataError(f"{path} {e.reason}; delete {cache} to preprocess again") from None
    except OSError as e:
        raise DataError(f"{path} {describe_os_error(path, e)}; delete {cache} to preprocess again") from None
