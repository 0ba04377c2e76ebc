"""shardlab: train models that no longer fit, from Hydra configs, on PyTorch's FSDP2."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _pin_builtin_tasks() -> None:
    """Bind the name ``tasks`` to the built-in task plug-ins beside this package before anything imports it.

    They are the top-level package ``tasks`` (the layout's ``tasks/<name>/``), and Python puts the working directory
    first on sys.path: a user's own ``tasks.py`` or ``tasks/`` there would shadow them and every run would die at the
    first plug-in import. Importing shardlab (which every entry point, spawned rank and DataLoader worker does before
    it touches a task) loads ours by path instead. Where ``tasks`` was imported before shardlab, nothing changes."""
    if "tasks" in sys.modules:
        return
    init = Path(__file__).resolve().parent.parent / "tasks" / "__init__.py"
    if not init.is_file():  # an install without the built-in tasks: nothing to pin
        return
    spec = importlib.util.spec_from_file_location("tasks", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tasks"] = module
    spec.loader.exec_module(module)


_pin_builtin_tasks()
