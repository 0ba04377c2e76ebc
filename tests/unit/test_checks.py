"""Every config check in one place (shardlab.cli.checks), run once per start, before anything is written: ranks
trust the checked config and check only what they alone see (issue #29, item 7)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

COUNTED = """

# ---- added by tests/unit/test_checks.py: each call of the task's checks and of the generic sections' (validate, which
# asks nonfinite_errors first) leaves a line naming the check and its process
import os as _os

import shardlab.cli.checks as _checks


def _counted(name, check):
    def counted(*args, **kwargs):
        with open(_os.environ["SHARDLAB_TEST_CHECK_LOG"], "a") as log:
            log.write(f"{name} {_os.getpid()}\\n")
        return check(*args, **kwargs)

    return counted


SpiralsTask.config_errors = _counted("task", SpiralsTask.config_errors)
_checks.nonfinite_errors = _counted("validate", _checks.nonfinite_errors)
"""

SPIRALS = [
    "task=spirals",
    "optimization.max_steps=2",
    "lr_scheduler.warmup_steps=0",
    "optimization.batch_size=8",
    "validation.batch_size=8",
    "validation.num_batches=1",
    "data.num_train=64",
    "data.num_valid=16",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "shardlab.train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def counted_research(tmp_path) -> tuple[Path, Path]:
    """A copy of examples/my_research whose spirals task logs each call of its config checks (a subprocess imports it,
    so the copy may keep the package's name); returns (the user_dir, the log)."""
    folder = tmp_path / "my_research"
    shutil.copytree(ROOT / "examples" / "my_research", folder, ignore=shutil.ignore_patterns("__pycache__"))
    with open(folder / "spirals.py", "a") as spirals:
        spirals.write(COUNTED)
    return folder, tmp_path / "checks.log"


def checks_made(log: Path) -> list[str]:
    """The checks the processes made, as (check, process id) lines."""
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.slow  # two CLI runs, one of them starting 2 ranks: ~40 s on a busy 2-core machine
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_checks_run_once_per_start_in_the_starting_process_and_never_on_its_ranks(
    counted_research, tmp_path, ranks
):
    user_dir, log = counted_research
    layout = ["distributed.backend=ddp", f"distributed.world_size={ranks}"] if ranks > 1 else []
    done = cli(
        f"user_dir={user_dir}", *SPIRALS, *layout, f"hydra.run.dir={tmp_path / 'run'}",
        env={"SHARDLAB_TEST_CHECK_LOG": str(log)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final validation" in done.stdout
    # Each check once, in the starting process; before, the launcher validated twice (pre-flight, build_task) and
    # every rank checked everything once more.
    made = checks_made(log)
    assert sorted(line.split()[0] for line in made) == ["task", "validate"], made
    assert len({line.split()[1] for line in made}) == 1, made


def test_the_run_finds_the_preflights_check_done_and_checks_a_config_it_was_not_given(tiny_lm, tmp_path, monkeypatch):
    """In-process, as the CLI's Hydra callback and task function run: the pre-flight checks, run_job reuses its task."""
    from shardlab import runner
    from shardlab.cli import checks
    from shardlab.cli.preflight import check_composed
    from shardlab_tasks.lm.task import LanguageModelingTask

    calls, validated = [], []
    own_checks, own_finite = LanguageModelingTask.config_errors, checks.nonfinite_errors
    monkeypatch.setattr(LanguageModelingTask, "config_errors", lambda self: calls.append(self) or own_checks(self))
    monkeypatch.setattr(checks, "nonfinite_errors", lambda cfg: validated.append(cfg) or own_finite(cfg))
    cfg = tiny_lm("dry_run=true")
    check_composed(cfg, [], str(tmp_path / "run"))
    runner.run_job(cfg, tmp_path / "run", [])  # the plan of a dry run, from the checked task
    assert (len(calls), len(validated)) == (1, 1)
    assert checks.checked(cfg, 1) is calls[0]
    other = tiny_lm("dry_run=true", "optimization.max_steps=3")  # not the config checked: checked by run_job
    runner.run_job(other, tmp_path / "run", [])
    assert (len(calls), len(validated)) == (2, 2)


@pytest.mark.parametrize("group, world, refused", [(3, 4, True), (8, 4, True), (2, 4, False), (0, 4, False)])
def test_a_bn_group_that_does_not_divide_the_world_is_refused_before_any_rank_starts(group, world, refused):
    """Found by every rank once its process group was up, before; now by the checks, from the job's world size."""
    from shardlab.cli import checks
    from shardlab.errors import ConfigError
    from tests.conftest import compose_config

    cfg = compose_config(
        ["task=image_classification", "distributed.backend=ddp", f"distributed.world_size={world}"]
        + [f"model.sync_bn_group_size={group}", "optimization.batch_size=8", "validation.batch_size=8"]
    )
    if refused:
        with pytest.raises(ConfigError, match=rf"^model.sync_bn_group_size \({group}\) must divide the world size"):
            checks.check(cfg)
    else:
        checks.check(cfg)


def test_planning_for_this_machines_gpu_without_one_is_refused_by_the_checks(tiny_lm):
    """Every rank's plan found it, once its process group was up; the checks know this machine's GPUs first."""
    from shardlab.cli import checks
    from shardlab.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"^distributed.plan_device=cuda plans for this machine's GPU, but it has none"
    ):
        checks.check(tiny_lm("distributed.plan_device=cuda"), num_cuda_devices=0)
    checks.check(tiny_lm("distributed.plan_device=h100_80gb"), num_cuda_devices=0)  # a named GPU plans anywhere


def test_skipping_a_unit_the_model_lacks_is_refused_by_the_checks(tiny_lm):
    """The units exist only in the model: every rank found a wrong distributed.ac_skip_units index when it wrapped its
    model, after the run folder was written; the checks build the model on meta and ask first."""
    from shardlab.cli import checks
    from shardlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^distributed.ac_skip_units=\[99\] names units \[99\], but the task has"):
        checks.check(tiny_lm("distributed.activation_checkpointing=full", "distributed.ac_skip_units=[99]"))
    checks.check(tiny_lm("distributed.activation_checkpointing=full", "distributed.ac_skip_units=[0,-1]"))


# ---- a bad value leaves the run folder as it was -------------------------------------------------------------------
def snapshot(folder: Path) -> dict[str, tuple[bytes | None, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def test_values_found_after_status_json_or_at_the_optimizer_before_now_leave_the_run_folder_untouched(
    tmp_path, cli_forks
):
    """model.num_heads, a task's own check, came after status.json and the lock; optimizer.name after the weights were
    materialized on every rank. Both now come in one line, before the run folder is touched."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("model:\n  num_heads: 4\n")
    (run / "status.json").write_text('{"status": "completed"}\n')
    (run / "checkpoints" / "step_10").mkdir(parents=True)
    (run / "checkpoints" / "step_10" / ".metadata").write_bytes(b"kept")
    before = snapshot(run)
    bad = ("model.num_heads=3", "optimizer.name=adamv")
    done = cli_forks.run("model.num_layers=1", "model.dim=64", "data.max_corpus_mb=1", *bad, f"hydra.run.dir={run}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    assert "model.num_heads (3) must divide model.dim (64)" in done.stderr
    assert "optimizer.name: 'adamv' is not a known optimizer; known: adamw, cpu_adam, lars, sgd" in done.stderr
    assert snapshot(run) == before  # no lock, no .hydra/ rewrite, no status.json: the checks ran before all of them


# ---- the rule: the pure checks are made in one place -----------------------------------------------------------------
CHECKS_CALLED_ONLY_BY = {
    "validate": {"shardlab/cli/checks.py"},
    # SSL's extend its parent's; the LM's asks its architecture's (model.arch) as a part of its own
    "config_errors": {"shardlab/cli/checks.py", "shardlab_tasks/self_supervised/task.py", "shardlab_tasks/lm/task.py"},
    "world_errors": {"shardlab/cli/checks.py"},
    "compile_errors": {"shardlab/cli/checks.py"},
    "foreign_section_errors": {"shardlab/cli/checks.py"},
    "architecture_errors": {"shardlab/cli/checks.py"},
}
"""Each pure check is asked by shardlab.cli.checks.check alone (a subclass may extend its parent's): a module that asks
one itself runs it a second time per start, or on a rank."""

RAISES_CONFIG_ERROR = {
    # the pure checks, and what reads only the command line or the registries
    "shardlab/cli/checks.py": "the checks",
    "shardlab/cli/preflight.py": "the command line and its composition, before Hydra starts",
    "shardlab/registry/__init__.py": "unknown and clashing names (a lookup the checks make first)",
    "shardlab/registry/user_dir.py": "the user_dir folder and its imports, before the config composes",
    "shardlab_tasks/lm/task.py": "model.arch of another kind, asked by the LM's config_errors",
    "shardlab_tasks/lm/hf/export_hf.py": "a tool's own command line and the model it exports",
    "shardlab_tasks/lm/harness.py": "a tool's own command line (evaluate --lm-eval) and the extra it needs installed",
    "shardlab_tasks/lm/evaluation.py": "shardlab-evaluate's command line (--split, the data.sources given again)",
    "shardlab_tasks/image_classification/evaluation.py": "shardlab-evaluate's command line (--split, the data probed)",
    # what only a rank, its machine, its data or the folder's contents show
    "shardlab/distributed/base.py": "backend=single on a rank of a world it finds at start (run_rank's callers)",
    "shardlab/distributed/sync_bn.py": "the process group's size (the checks ask the task's world_errors first)",
    "shardlab/distributed/env.py": "the Slurm tasks this job was given",
    "shardlab/optim/cpu_adam.py": "the device the parameters were placed on",
    "shardlab/trainer.py": "the values an optimizer plug-in put in its param groups, once built",
    "shardlab/jobs/run_lock.py": "the run folder, when the lock is taken",
    "shardlab/runner/__init__.py": "whether the disk lets a tool's run folder be written (build_task's run_dir)",
    "shardlab/checkpoint/resume/line.py": "the checkpoints the folder holds",
    "shardlab/checkpoint/shared.py": "whether the hosts share the checkpoint folder",
    "shardlab/memory/plan.py": "the rank's machine's GPU for distributed.plan_device=cuda (the checks ask first)",
    "shardlab/distributed/activation_checkpointing.py": "the model's units for ac_skip_units (the checks ask first)",
    "shardlab/memory/budget.py": "the memory plan against distributed.memory_budget_gb (asked by the checks)",
    "shardlab/runner/autotune.py": "the layouts measured on the ranks",
    "shardlab/memory/verify.py": "the real fully_shard against the plan (a dry run's)",
    "shardlab/memory/fake_group.py": "the installed torch and the process, for verify_plan's fake process group",
    "shardlab_tasks/lm/corpus/tokenizer.py": "the tokenizer file the data names",
    "shardlab_tasks/lm/corpus/shards.py": (
        "the shard plan a cache being preprocessed already follows (shardlab-preprocess --shards)"
    ),
    "shardlab_tasks/lm/finetuning/sft_template.py": (
        "the chat template file data.chat_template names (or the tokenizer's folder holds)"
    ),
    "shardlab/checkpoint/export_folder.py": "a tool's --out, against the folders on disk it would replace",
    "shardlab_tasks/image_classification/task.py": "the classes the data holds",
    "shardlab_tasks/image_classification/model.py": (
        "model.flavor, at the model's build (its config_errors checks it first)"
    ),
}
"""Where a ConfigError may be raised, and why there: a new one elsewhere is either a pure config value, which belongs
in shardlab.cli.checks (or a task's config_errors), or something only a rank, its data or its machine shows, to add
here with its reason."""


def python_files() -> list[Path]:
    return sorted(p for folder in ("shardlab", "shardlab_tasks") for p in (ROOT / folder).rglob("*.py"))


def called_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and getattr(func.value, "id", None) != "self":  # not a method's own
                names.add(func.attr)  # (the trainer's self.validate is its validation pass)
            elif isinstance(func, ast.Name):
                names.add(func.id)
    return names


def test_each_pure_check_is_asked_from_the_checks_module_alone():
    callers: dict[str, set[str]] = {name: set() for name in CHECKS_CALLED_ONLY_BY}
    for path in python_files():
        for name in called_names(ast.parse(path.read_text())) & set(CHECKS_CALLED_ONLY_BY):
            callers[name].add(str(path.relative_to(ROOT)))
    for name, where in callers.items():
        assert "shardlab/cli/checks.py" in where, name
        assert where <= CHECKS_CALLED_ONLY_BY[name], f"{name} is asked outside shardlab/cli/checks.py: {where}"


def test_config_errors_are_raised_only_where_the_rule_allows():
    raising = set()
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ConfigError":
                raising.add(str(path.relative_to(ROOT)))
    assert "shardlab/cli/checks.py" in raising
    assert raising <= set(RAISES_CONFIG_ERROR), (
        "a module raises ConfigError without a reason in RAISES_CONFIG_ERROR: move a pure config check into "
        "shardlab/cli/checks.py (or the task's config_errors), or name what only a rank or its machine shows there"
    )
