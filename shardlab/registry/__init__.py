"""Name -> factory registries. Each config section names its implementation with a string looked up here.

Registering a factory with ``dataclass=`` also registers its config schema (fairseq's ``register_x(name,
dataclass=...)``): the schema is stored in Hydra's ConfigStore as ``schema/<section>/<name>``, which a YAML option in
``conf/<section>/`` names in its defaults, so a plug-in is one module. The built-ins register the same way, from light
modules (dataclasses and registrations only; heavy imports happen inside the factories, so the LM path never imports
torchvision):

- tasks: ``tasks/<name>/config.py``, found through the ``shardlab.tasks`` entry-point group (pyproject.toml);
- optimizers and schedules: ``shardlab/optim/__init__.py``;
- a user directory's modules (``user_dir=``, shardlab/registry/user_dir.py), imported after the built-ins.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Generic, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from shardlab.config import LRSchedulerConfig, OptimizerConfig
from shardlab.errors import ConfigError
from shardlab.registry import user_dir
from shardlab.registry.user_dir import import_user_dir

T = TypeVar("T")

__all__ = [
    "BACKENDS",
    "LR_SCHEDULERS",
    "MODELS",
    "OPTIMIZERS",
    "TASKS",
    "Registry",
    "load_plugins",
    "unknown_name_message",
    "user_dir",
]


class Registry(Generic[T]):
    """Maps names to factories returning ``T``; unknown names raise a ConfigError with a did-you-mean.

    ``section``: the config section whose schema a registration's ``dataclass`` is (model, data, optimizer, ...).
    ``name_key``: the field of that section holding the registered name (model.arch, optimizer.name); its default in
    the stored schema becomes the name, so a YAML option need not repeat it. ``base``: the class every dataclass must
    extend, where the section's type is fixed (optimizer: OptimizerConfig)."""

    def __init__(
        self, kind: str, section: str | None = None, name_key: str | None = None, base: type | None = None
    ) -> None:
        self.kind = kind
        self.section = section
        self.name_key = name_key
        self.base = base
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str, dataclass: type | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: ``factory`` builds ``name``; ``dataclass`` (optional) is the schema of its config section,
        stored as ``schema/<section>/<name>``."""

        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            previous = self._factories.get(name)
            if previous is not None and _identity(previous) != _identity(factory):
                raise ConfigError(
                    f"{self.kind} '{name}' is registered twice: by {origin(factory)} and by {origin(previous)}; "
                    "give yours another name"
                )
            if dataclass is not None:
                self._store_schema(name, dataclass, factory)
            self._factories[name] = factory
            return factory

        return decorator

    def _store_schema(self, name: str, dataclass: type, factory: Callable) -> None:
        where = f"{self.kind} '{name}' ({origin(factory)})"
        if self.section is None:
            raise ConfigError(f"{where}: a {self.kind} has no config schema of its own; drop dataclass=")
        fields = getattr(dataclass, "__dataclass_fields__", None)
        if fields is None:
            raise ConfigError(f"{where}: dataclass={getattr(dataclass, '__name__', dataclass)!r} is not a dataclass")
        if self.base is not None and not issubclass(dataclass, self.base):
            raise ConfigError(
                f"{where}: {dataclass.__name__} must extend {self.base.__name__} (every {self.section}.* key the "
                f"framework reads), e.g. class {dataclass.__name__}({self.base.__name__})"
            )
        node = OmegaConf.structured(dataclass)
        if self.name_key is not None:
            if self.name_key not in fields:
                raise ConfigError(
                    f"{where}: {dataclass.__name__} needs a field {self.name_key}: str ({self.section}.{self.name_key} "
                    f"names the {self.kind} to build)"
                )
            node[self.name_key] = name
        ConfigStore.instance().store(
            group=f"schema/{self.section}", name=name, node=node, provider=getattr(factory, "__module__", None)
        )

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str, key: str | None = None) -> Callable[..., T]:
        """The factory for ``name``; ``key`` is the dotted config key quoted in the error message."""
        if name not in self._factories:
            raise ConfigError(unknown_name_message(name, self.kind, self.names(), key))
        return self._factories[name]

    def build(self, name: str, *args, key: str | None = None, **kwargs) -> T:
        return self.get(name, key)(*args, **kwargs)


def _identity(factory: Callable) -> tuple[str, str, int]:
    """The same definition executed again (its module imported twice) is no clash; any other factory is."""
    code = getattr(factory, "__code__", None)
    line = code.co_firstlineno if code is not None else 0
    return getattr(factory, "__module__", ""), getattr(factory, "__qualname__", repr(factory)), line


def origin(factory: Callable) -> str:
    """Where ``factory`` is defined, as ``file:line`` (the file alone for a class or a builtin)."""
    try:
        file = inspect.getsourcefile(factory) or inspect.getfile(factory)
    except TypeError:
        return getattr(factory, "__module__", repr(factory))
    code = getattr(factory, "__code__", None)
    return f"{Path(file)}:{code.co_firstlineno}" if code is not None else str(Path(file))


def unknown_name_message(name: str, kind: str, known: list[str], key: str | None = None) -> str:
    where = f"{key}: " if key else ""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{where}'{name}' is not a known {kind}; known: {', '.join(known)}.{hint}"


def load_plugins(user_dir: str | None = None) -> None:
    """Import every task plug-in's config module (cheap: dataclasses and registrations only), then the modules of
    ``user_dir`` (a directory of the user's own plug-ins) where one is given; idempotent."""
    for ep in entry_points(group="shardlab.tasks"):
        importlib.import_module(ep.value)
    if user_dir:
        import_user_dir(user_dir)


TASKS: Registry = Registry("task", section="data")
"""A task's dataclass is the schema of its data section (data.*): the task's own settings."""
MODELS: Registry = Registry("model architecture", section="model", name_key="arch")
OPTIMIZERS: Registry = Registry("optimizer", section="optimizer", name_key="name", base=OptimizerConfig)
LR_SCHEDULERS: Registry = Registry("lr scheduler", section="lr_scheduler", name_key="name", base=LRSchedulerConfig)
BACKENDS: Registry = Registry("distributed backend")
