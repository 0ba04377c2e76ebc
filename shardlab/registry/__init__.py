"""Name -> factory registries. Each config section names its implementation with a string looked up here.

Registering a factory with ``dataclass=`` also registers its config schema (fairseq's ``register_x(name,
dataclass=...)``): the schema is stored in Hydra's ConfigStore as ``schema/<section>/<name>``, which a YAML option in
``conf/<section>/`` names in its defaults, so a plug-in is one module. The built-ins register the same way, from light
modules (dataclasses and registrations only; heavy imports happen inside the factories, so the LM path never imports
torchvision):

- tasks and their models: ``shardlab_tasks/<name>/config.py``, found through the ``shardlab.tasks`` entry-point group
  (pyproject.toml), registered with ``register_lazy`` (the factory is imported when first built);
- optimizers and schedules: ``shardlab/optim/__init__.py``, the same way;
- a user directory's modules (``user_dir=``, shardlab/registry/user_dir.py), imported after the built-ins.

An optimizer also declares, where it is registered, the state it keeps per parameter (``state_tensors=``: how many
fp32 tensors of the parameter's shape, or a function of its config), which the memory plan asks for
(``Registry.state_tensors``) instead of guessing from the name.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Generic, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from shardlab.config import LRSchedulerConfig, OptimizerConfig, TaskConfig
from shardlab.errors import ConfigError
from shardlab.registry import user_dir
from shardlab.registry.user_dir import import_user_dir

T = TypeVar("T")
StateTensors = int | Callable[..., int] | None
"""An optimizer's state per parameter: a count of fp32 tensors of the parameter's shape, or a function of its config
returning one (sgd: one momentum buffer when momentum > 0)."""

__all__ = [
    "BACKENDS",
    "LR_SCHEDULERS",
    "MODELS",
    "OPTIMIZERS",
    "TASKS",
    "Registry",
    "load_plugins",
    "plugin_packages",
    "unknown_name_message",
    "user_dir",
]


class Registry(Generic[T]):
    """Maps names to factories returning ``T``; unknown names raise a ConfigError with a did-you-mean.

    ``section``: the config section whose schema a registration's ``dataclass`` is (model, task, optimizer, ...).
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
        self._factories: dict[str, Callable[..., T] | str] = {}
        """A factory, or the ``module:attribute`` it is imported from on first use (register_lazy)."""
        self._origins: dict[str, str] = {}
        """Where each name was registered (file:line), for the message of a clash."""
        self._state_tensors: dict[str, StateTensors] = {}
        """What each optimizer declared with ``state_tensors=``."""

    def register(
        self, name: str, dataclass: type | None = None, data: type | None = None, state_tensors: StateTensors = None
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: ``factory`` (a function or a class) builds ``name``. ``dataclass``: the schema of its config
        section, stored as ``schema/<section>/<name>``; ``data`` (tasks): the schema of the data section, stored as
        ``schema/data/<name>``; ``state_tensors`` (optimizers): the fp32 tensors of a parameter's shape it keeps per
        parameter (Adam: 2), or a function of the optimizer's config returning that count."""

        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            self._add(name, factory, origin(factory), dataclass, data, state_tensors)
            return factory

        return decorator

    def register_lazy(
        self,
        name: str,
        target: str,
        dataclass: type | None = None,
        data: type | None = None,
        state_tensors: StateTensors = None,
    ) -> None:
        """Register ``name`` (and its schemas, as ``register``) from a light module, the factory being imported from
        ``target`` ("package.module:attribute") when first used: the built-ins keep torch and torchvision out of
        start-up this way."""
        caller = inspect.currentframe().f_back
        self._add(name, target, f"{caller.f_code.co_filename}:{caller.f_lineno}", dataclass, data, state_tensors)

    def _add(
        self,
        name: str,
        entry: Callable[..., T] | str,
        where: str,
        dataclass: type | None,
        data: type | None,
        state_tensors: StateTensors = None,
    ):
        previous = self._factories.get(name)
        if previous is not None and not _same(previous, entry):
            raise ConfigError(
                f"{self.kind} '{name}' is registered twice: by {where} and by {self._origins[name]}; "
                "give yours another name"
            )
        if data is not None and self.section != "task":
            raise ConfigError(f"{self.kind} '{name}' ({where}): data= is a task's data section; drop it")
        if state_tensors is not None and self.section != "optimizer":
            raise ConfigError(f"{self.kind} '{name}' ({where}): state_tensors= is an optimizer's state; drop it")
        if state_tensors is not None and not callable(state_tensors) and not _count(state_tensors):
            raise ConfigError(
                f"{self.kind} '{name}' ({where}): state_tensors={state_tensors!r} must be a count of tensors (an int "
                ">= 0) or a function of the optimizer's config returning one"
            )
        for section, schema, name_key, base in (
            (self.section, dataclass, self.name_key, self.base),
            ("data", data, None, None),
        ):
            if schema is not None:
                self._store_schema(section, name, schema, f"{self.kind} '{name}' ({where})", name_key, base)
        if previous is None or isinstance(previous, str):  # a lazy entry gives way to the object it names
            self._factories[name] = entry
            self._origins[name] = where
        if state_tensors is not None:
            self._state_tensors[name] = state_tensors

    def _store_schema(
        self, section: str | None, name: str, dataclass: type, where: str, name_key: str | None, base: type | None
    ) -> None:
        if section is None:
            raise ConfigError(f"{where}: a {self.kind} has no config schema of its own; drop dataclass=")
        fields = getattr(dataclass, "__dataclass_fields__", None)
        if fields is None:
            raise ConfigError(f"{where}: {getattr(dataclass, '__name__', dataclass)!r} is not a dataclass")
        if base is not None and not issubclass(dataclass, base):
            raise ConfigError(
                f"{where}: {dataclass.__name__} must extend {base.__name__} (every {section}.* key the framework "
                f"reads), e.g. class {dataclass.__name__}({base.__name__})"
            )
        node = OmegaConf.structured(dataclass)
        if name_key is not None:
            if name_key not in fields:
                raise ConfigError(
                    f"{where}: {dataclass.__name__} needs a field {name_key}: str ({section}.{name_key} names the "
                    f"{self.kind} to build)"
                )
            node[name_key] = name
        ConfigStore.instance().store(group=f"schema/{section}", name=name, node=node, provider=where)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def module_of(self, name: str) -> str:
        """The module that defines ``name``'s factory, without importing it (a lazy entry names it)."""
        entry = self._factories[name]
        return entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")

    def get(self, name: str, key: str | None = None) -> Callable[..., T]:
        """The factory for ``name`` (imported now if registered lazily); ``key`` is the dotted config key quoted in
        the error message."""
        if name not in self._factories:
            raise ConfigError(unknown_name_message(name, self.kind, self.names(), key))
        entry = self._factories[name]
        if isinstance(entry, str):  # "module:attribute", imported now
            entry = pkgutil.resolve_name(entry)
            self._factories[name] = entry
        return entry

    def build(self, name: str, *args, key: str | None = None, **kwargs) -> T:
        return self.get(name, key)(*args, **kwargs)

    def state_tensors(self, name: str, cfg: object) -> int | None:
        """The fp32 tensors of a parameter's shape that optimizer ``name`` keeps per parameter, given its config
        ``cfg`` (the optimizer section), as its registration declared; None where it declared nothing."""
        declared = self._state_tensors.get(name)
        count = declared(cfg) if callable(declared) else declared
        if count is not None and not _count(count):
            raise ConfigError(
                f"optimizer.name: '{name}' ({self._origins[name]}) declares {count!r} state tensors per parameter "
                "for this config; its state_tensors function must return an int >= 0"
            )
        return count


def _count(value: object) -> bool:
    """Whether ``value`` is a count of tensors (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _target(entry: Callable | str) -> str:
    return entry if isinstance(entry, str) else f"{getattr(entry, '__module__', '')}:{entry.__qualname__}"


def _same(a: Callable | str, b: Callable | str) -> bool:
    """The same definition executed again (its module imported twice), or a lazy entry and the object it names, is
    no clash; any other factory is (two lambdas of one module differ by their line)."""
    if _target(a) != _target(b):
        return False
    if isinstance(a, str) or isinstance(b, str):
        return True
    return getattr(getattr(a, "__code__", None), "co_firstlineno", 0) == getattr(
        getattr(b, "__code__", None), "co_firstlineno", 0
    )


def origin(factory: Callable) -> str:
    """Where ``factory`` is defined, as ``file:line``."""
    try:
        file = inspect.getsourcefile(factory) or inspect.getfile(factory)
    except TypeError:
        return getattr(factory, "__module__", repr(factory))
    code = getattr(factory, "__code__", None)
    if code is not None:
        return f"{Path(file)}:{code.co_firstlineno}"
    try:
        return f"{Path(file)}:{inspect.getsourcelines(factory)[1]}"  # a class: the line of its first decorator
    except (OSError, TypeError):
        return str(Path(file))


def unknown_name_message(name: str, kind: str, known: list[str], key: str | None = None) -> str:
    where = f"{key}: " if key else ""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{where}'{name}' is not a known {kind}; known: {', '.join(known)}.{hint}"


def plugin_packages() -> set[str]:
    """The packages of the installed task plug-ins (entry points: shardlab_tasks.lm,
    shardlab_tasks.image_classification, ...); a user_dir's package is not one of them."""
    return {ep.value.rpartition(".")[0] for ep in entry_points(group="shardlab.tasks")}


def package_of(module: str) -> str:
    """The installed task plug-in holding ``module``, from any depth of its sub-packages (shardlab_tasks.lm.models.model
    is shardlab_tasks.lm's); else the module's own package (a user_dir's)."""
    holders = [package for package in plugin_packages() if module.startswith(package + ".")]
    return max(holders, key=len) if holders else module.rpartition(".")[0]


def load_plugins(user_dir: str | None = None) -> None:
    """Import every task plug-in's config module (cheap: dataclasses and registrations only), then the modules of
    ``user_dir`` (a directory of the user's own plug-ins) where one is given; idempotent."""
    for ep in entry_points(group="shardlab.tasks"):
        importlib.import_module(ep.value)
    if user_dir:
        import_user_dir(user_dir)


TASKS: Registry = Registry("task", section="task", name_key="name", base=TaskConfig)
"""A task's ``dataclass`` is the schema of its own task.* keys (extending TaskConfig), ``data`` its data section's."""
MODELS: Registry = Registry("model architecture", section="model", name_key="arch")
OPTIMIZERS: Registry = Registry("optimizer", section="optimizer", name_key="name", base=OptimizerConfig)
LR_SCHEDULERS: Registry = Registry("lr scheduler", section="lr_scheduler", name_key="name", base=LRSchedulerConfig)
BACKENDS: Registry = Registry("distributed backend")
