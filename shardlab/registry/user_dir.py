"""A user directory (``user_dir=path/to/my_research``): a researcher's own tasks, models, optimizers and schedules,
kept outside shardlab, trained by its CLI unchanged (fairseq's ``--user-dir``).

- Python: the directory is imported as a package named after it (``my_research``), by path, so its modules import
  each other (``from my_research.model import X``, or ``from .model import X``) and nothing is put on sys.path, where
  it could shadow ``tasks`` or an installed package. Its ``__init__.py`` (if any) and every top-level module whose
  name does not start with ``_`` are imported; their registrations sit beside the built-ins, imported before them.
- Configs: its ``conf/`` joins Hydra's search path after shardlab's (a SearchPathPlugin, hydra_plugins/
  shardlab_user_dir), so ``conf/model/my_model.yaml`` composes as ``model=my_model``, is listed by ``--help`` and
  checked by the pre-flight. The search path must be known before Hydra composes, so ``user_dir`` is read from the
  command line, never from a YAML file.
- The path is made absolute on the command line itself: the recorded config, every spawned rank, a Slurm job and its
  requeues, and a resume find the same directory wherever they start.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import keyword
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType

from shardlab.errors import ConfigError

KEY = "user_dir"

_PLAIN = re.compile(r"[\w./~+@%-]+")
"""Override values Hydra reads as they are; anything else is quoted."""


def resolve(path: str | Path) -> Path:
    """The user directory as an absolute path, after checking that it can be imported as a package."""
    root = Path(path).expanduser().absolute()
    if not root.is_dir():
        raise ConfigError(f"{KEY}: {root} is not a directory; give the folder holding your plug-in modules and conf/")
    name = root.name
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(
            f"{KEY}: {root} is imported as a package named after the folder, and '{name}' is not a Python name; "
            "rename the folder (letters, digits and _)"
        )
    return root


def import_user_dir(path: str | Path) -> ModuleType:
    """Import the user directory's package and its top-level modules (once per process); a mistake in them becomes
    one ConfigError naming the file and line."""
    root = resolve(path)
    name = root.name
    package = sys.modules.get(name)
    if package is not None and root.resolve() not in _locations(package):
        raise _name_taken(name, root, getattr(package, "__file__", None) or _locations(package) or "a module")
    if package is None:
        _check_name_is_free(name, root)
    try:
        if package is None:
            package = _new_package(name, root)
        for module in sorted(root.glob("*.py")):
            if not module.stem.startswith("_"):
                importlib.import_module(f"{name}.{module.stem}")
    except Exception as e:
        for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[loaded]
        raise _one_line(e, root) from None
    return package


def _locations(module: ModuleType) -> list[Path]:
    return [Path(p).resolve() for p in getattr(module, "__path__", None) or []]


def _check_name_is_free(name: str, root: Path) -> None:
    """Nothing else on sys.path is importable as ``name`` (the folder itself, found from the working directory, is
    fine)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    locations = [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
    if root.resolve() not in locations:
        raise _name_taken(name, root, spec.origin or (locations[0] if locations else name))


def _name_taken(name: str, root: Path, taken_by: object) -> ConfigError:
    return ConfigError(
        f"{KEY}: {root} is imported as package '{name}', a name already taken by {taken_by}; rename the folder"
    )


def _new_package(name: str, root: Path) -> ModuleType:
    init = root / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(root)])
    else:  # a folder of modules without __init__.py: a package all the same
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(root)]
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    if spec.loader is not None:
        spec.loader.exec_module(package)
    return package


def _one_line(error: Exception, root: Path) -> ConfigError:
    """``user_dir: <file>:<line>: <Type>: <message>``, at the deepest frame inside the user directory."""
    if isinstance(error, ConfigError):  # a registration refused (a clash, a bad schema): it names the file already
        return ConfigError(f"{KEY}: {error}")
    first_line = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, SyntaxError) and error.filename:
        where = f"{error.filename}:{error.lineno}"
        first_line = error.msg
    else:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if _inside(f.filename, root)]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else str(root)
    return ConfigError(f"{KEY}: {where}: {type(error).__name__}: {first_line}".rstrip(": "))


def _inside(file: str, root: Path) -> bool:
    try:
        return Path(file).resolve().is_relative_to(root.resolve())
    except OSError:
        return False


# ---- the command line and Hydra's search path ---------------------------------------------------------------------
_conf_on_search_path: Path | None = None
"""This process's user_dir conf/, which hydra_plugins/shardlab_user_dir adds to every config search path Hydra creates
(set from the command line by the CLI and compose_config; a Slurm job gets Hydra's search path pickled)."""


def find(overrides: list[str]) -> str | None:
    """The user directory a command line names, if any (``user_dir=...``; null or empty means none)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.lstrip("+~") == KEY:
            value = _unquote(value.strip())
            if "," in value or value.startswith(("choice(", "range(", "glob(")):
                raise ConfigError(f"{KEY}={value}: one user directory per command; it cannot be swept")
            return None if value in ("", "null") else value
    return None


def absolute(overrides: list[str]) -> list[str]:
    """``overrides`` with the user_dir made absolute (and checked), so every process that reads it, the recorded
    config and a requeued job find the same folder; unchanged without one."""
    value = find(overrides)
    if value is None:
        return list(overrides)
    root = _quote(str(resolve(value)))
    return [f"{KEY}={root}" if item.partition("=")[0].lstrip("+~") == KEY else item for item in overrides]


def put_conf_on_search_path(user_dir: str | None, builtin_conf: Path) -> None:
    """Hydra's search paths created from now on hold the user_dir's conf/ after ``builtin_conf`` (none without a
    user_dir or a conf/). A YAML file named like a built-in one would be silently ignored: refused instead."""
    global _conf_on_search_path
    conf = conf_dir(user_dir)
    shadowed = shadowed_configs(conf, builtin_conf) if conf else []
    if shadowed:
        raise ConfigError(
            f"{KEY}: {conf / shadowed[0]} has the name of a built-in config, which Hydra would choose instead of "
            f"yours; rename it (built-in: {builtin_conf / shadowed[0]})"
        )
    _conf_on_search_path = conf


def conf_on_search_path() -> Path | None:
    return _conf_on_search_path


def conf_dir(user_dir: str | None) -> Path | None:
    """The user directory's conf/, where it has one."""
    conf = Path(user_dir) / "conf" if user_dir else None
    return conf if conf is not None and conf.is_dir() else None


def shadowed_configs(conf: Path, builtin_conf: Path) -> list[str]:
    """The user's YAML files named like built-in ones (relative paths): Hydra would silently take the built-in."""
    mine = (p.relative_to(conf) for p in conf.rglob("*.yaml"))
    return sorted(str(p) for p in mine if (builtin_conf / p).exists())


def _quote(value: str) -> str:
    if _PLAIN.fullmatch(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].replace("\\'", "'").replace("\\\\", "\\")
    return value
