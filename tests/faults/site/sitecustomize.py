"""Test-only fault injection for real processes (tests/faults): on PYTHONPATH only in the fault-matrix tests.

Every Python process of a launch (the launcher, torchrun's workers, spawned ranks, Slurm tasks) imports this at
start. With SHARDLAB_FAULT set, it arranges for tests/faults/inject.py to patch shardlab.trainer right after that
module is imported, so the fault fires inside training, on the chosen rank and step; without it, it does nothing.
"""

import os

if os.environ.get("SHARDLAB_FAULT"):
    import importlib.abc
    import importlib.util
    import sys

    class _PatchTrainerOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "shardlab.trainer":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_then_patch(module):
                exec_module(module)
                from tests.faults import inject

                inject.install(module)

            spec.loader.exec_module = exec_then_patch
            return spec

    sys.meta_path.insert(0, _PatchTrainerOnImport())
