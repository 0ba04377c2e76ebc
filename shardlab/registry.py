"""Name -> factory registries. Each config section names its implementation with a string looked up here.

Task plug-ins are found through the ``shardlab.tasks`` entry-point group (see pyproject.toml): the entry point names a
light module (dataclass configs only) that registers the task's factory; heavy imports happen inside the factory, so
the LM path never imports torchvision.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from shardlab.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories returning ``T``; unknown names raise a ConfigError with a did-you-mean."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories and self._factories[name] is not factory:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._factories[name] = factory
            return factory

        return decorator

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str, key: str | None = None) -> Callable[..., T]:
        """The factory for ``name``; ``key`` is the dotted config key quoted in the error message."""
        if name not in self._factories:
            raise ConfigError(unknown_name_message(name, self.kind, self.names(), key))
        return self._factories[name]

    def build(self, name: str, *args, key: str | None = None, **kwargs) -> T:
        return self.get(name, key)(*args, **kwargs)


def unknown_name_message(name: str, kind: str, known: list[str], key: str | None = None) -> str:
    where = f"{key}: " if key else ""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{where}'{name}' is not a known {kind}; known: {', '.join(known)}.{hint}"


def load_plugins() -> None:
    """Import every task plug-in's config module (cheap: dataclasses and ConfigStore entries only)."""
    for ep in entry_points(group="shardlab.tasks"):
        importlib.import_module(ep.value)


TASKS: Registry = Registry("task")
MODELS: Registry = Registry("model architecture")
OPTIMIZERS: Registry = Registry("optimizer")
LR_SCHEDULERS: Registry = Registry("lr scheduler")
BACKENDS: Registry = Registry("distributed backend")
