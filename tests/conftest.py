"""Shared fixtures: configs composed through Hydra exactly as the CLI composes them, on a small slice of the corpus."""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from shardlab.cli.preflight import compose_config  # noqa: F401  (the tests compose through the CLI's own helper)
from shardlab.cli.run_names import register_resolvers
from shardlab.config import register_schemas
from shardlab.registry import load_plugins

register_schemas()  # at import as well: some tests compose through Hydra directly (test_run_dir) or read registries
register_resolvers()  # as the CLI does: the run folder's name in conf/config.yaml needs them
load_plugins()

# Tiny models gain nothing from a second thread, and OpenMP threads that spin-wait on an oversubscribed 2-core machine
# (spawned ranks beside this process) slow every op ~50x. One thread each keeps the suite fast and steady.
torch.set_num_threads(1)

# A tiny LM on 1 MB of the embedded corpus: every step takes milliseconds, so parity checks run many configs.
TINY_LM = [
    "model.num_layers=2",
    "model.dim=64",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "data.max_corpus_mb=1",
    "optimization.batch_size=8",
    "optimization.max_steps=10",
    "lr_scheduler.warmup_steps=2",
    "validation.interval_steps=5",
    "validation.num_batches=2",
    "validation.batch_size=8",
    "checkpoint.interval_steps=0",
    "logging.interval_steps=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """One preprocessing of the test corpus slice per session, shared by every test and spawned rank."""
    return str(tmp_path_factory.mktemp("corpus_cache"))


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def research_root(tmp_path_factory) -> Path:
    """A directory outside the repository holding a copy of examples/ (the user_dir examples/my_research) and a link
    to tools/: where the tutorial's commands run. Its my_research is the one user_dir this pytest process imports
    (a package name maps to one folder per process)."""
    root = tmp_path_factory.mktemp("research")
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tools").symlink_to(ROOT / "tools")
    (root / "home").mkdir()  # HOME of the commands: the LM's default cache (~/.cache/shardlab) goes here
    return root


@pytest.fixture(scope="session")
def tiny_lm(corpus_cache):
    def make(*overrides: str):
        return compose_config([*TINY_LM, f"data.cache_dir={corpus_cache}", *overrides])

    return make


@pytest.fixture
def crash_lm_loss_at(monkeypatch):
    """``crash_lm_loss_at(n)``: the LM's n-th loss call raises RuntimeError("simulated crash"); returns a function
    that puts the real loss back."""
    from shardlab_tasks.lm.task import LanguageModelingTask

    original, calls = LanguageModelingTask.loss, {"n": 0}

    def arm(n: int):
        def crashing(self, model, batch, device):
            calls["n"] += device.type != "meta"  # the memory plan's shape-only forward is not a training call
            if calls["n"] == n and device.type != "meta":
                raise RuntimeError("simulated crash")
            return original(self, model, batch, device)

        monkeypatch.setattr(LanguageModelingTask, "loss", crashing)
        return lambda: monkeypatch.setattr(LanguageModelingTask, "loss", original)

    return arm


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


SESSION_ENVIRON = dict(os.environ)
"""The environment pytest started with: what cli_forks's commands start from."""


@pytest.fixture(scope="session")
def cli_forks(tmp_path_factory):
    """The trainer's CLI for commands that end before training (refusals, dry runs): one start per worker, a fork per
    command (tests/cli_forks.py). A session's, not a module's: a dozen files each ran ``python -m shardlab.train``
    once or twice for ~0.5 s of work behind ~3 s of imports. test_cli's test_a_fresh_interpreter_refuses_as_the_forks_do
    checks a fork shows what a fresh ``python -m`` shows."""
    from tests.cli_forks import CliForks

    # the session's environment, not that of the test that happens to ask first (a monkeypatched HOME, say)
    forks = CliForks(tmp_path_factory.mktemp("cli_forks"), SESSION_ENVIRON)
    yield forks
    forks.close()


@pytest.fixture(autouse=True)
def stop_signal_handlers_are_put_back():
    """Each test starts with the stop-signal handlers the session had: a run in this process that a test cut short
    can leave its StopSignals handler installed, which would swallow a later test's Ctrl-C."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def pytest_itemcollected(item):
    """Every test that needs the Slurm cluster starts whole jobs on it: an e2e test too (``-m e2e`` selects it)."""
    if item.get_closest_marker("slurm") and not item.get_closest_marker("e2e"):
        item.add_marker("e2e")


def pytest_collection_modifyitems(config, items):
    """Two sets leave the default suite, each run when ``-m`` names it:

    - ``slow`` (``-m slow``): the fault matrix's other cells, the sbatch requeue tests, compiled runs of real model
      sizes, world size 4 and the like, which together take hours on 2 cores.
    - ``e2e`` (``-m e2e``; ``-m slurm`` or ``-m slow`` name it too): whole jobs started as a user starts them, through
      torchrun, Hydra multirun and submitit, Slurm on one host and on two, the tutorial's and the docs' pages, the
      kill loop: the costliest tests per behaviour, each fresh interpreters that import torch and train. CI runs this
      pass after the default suite (.ci/run), so nothing leaves CI; ``-m "slow or not slow"`` runs everything.

    The default suite keeps the rest, one test of each behaviour: in this process, on ranks forked from a preloaded
    server (tests/distributed/harness.py), and the CLI's own path: its refusals, dry runs and single-process runs
    (tests/unit/test_cli.py) and a run on two local ranks it spawns (tests/distributed/test_memory_plan.py)."""
    markexpr = config.option.markexpr or ""
    left_out = [
        item
        for item in items
        if (item.get_closest_marker("slow") and "slow" not in markexpr)
        or (item.get_closest_marker("e2e") and not any(name in markexpr for name in ("e2e", "slurm", "slow")))
    ]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(map(id, left_out))
        items[:] = [item for item in items if id(item) not in dropped]
    _slurm_first(items)


def worker_group(nodeid: str) -> str:
    """Which tests one pytest-xdist worker runs together (``-n``; the scheduler below): a test file's tests, so its
    module fixtures (reference runs) are built once; and every test that needs the Slurm cluster, since the session
    that starts the cluster stops it at its end, and the multi-node tests take a host down under the others' feet.
    The workers' controller sees node ids only, not marks: the Slurm tests are those under tests/slurm/ and the fault
    matrix's Slurm cells (``_slurm_first`` holds every test marked slurm to that)."""
    path, _, rest = nodeid.partition("::")
    return "slurm" if path.startswith("tests/slurm/") or "[slurm_" in rest else path


def _slurm_first(items) -> None:
    """The Slurm group, the longest, first: it runs beside the rest rather than after it. Then the groups of more tests
    first (xdist's own order for load-scope scheduling, which the scheduler below keeps from reordering the Slurm
    group): the many one- or two-test files come last and even out the workers' ends."""
    for item in items:
        if item.get_closest_marker("slurm") and worker_group(item.nodeid) != "slurm":
            raise pytest.UsageError(f"{item.nodeid} needs Slurm: put it under tests/slurm/ (see worker_group)")
    sizes = collections.Counter(worker_group(item.nodeid) for item in items)
    items.sort(key=lambda item: (worker_group(item.nodeid) != "slurm", -sizes[worker_group(item.nodeid)]))  # stable


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_auto_num_workers(config):
        """``-n auto`` (pyproject's addopts): three workers on 2 cores, since much of a test is waiting (for spawned
        ranks to import torch, for Slurm's scheduler, for a timeout) and the others fill it (2 workers left a quarter
        of the cores idle); one per two cores above that, since a test's ranks take a core each."""
        return max(3, min(8, (os.cpu_count() or 2) // 2))

    def pytest_xdist_make_scheduler(config, log):
        """Work groups in the order the collection hook sorts them (_slurm_first): xdist's default for load-scope
        scheduling reorders every group by its number of tests, which put the Slurm group (few, long tests) mid-run,
        where it could outlast the rest."""
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False

        class ByWorkerGroup(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return worker_group(nodeid)

        return ByWorkerGroup(config, log)
