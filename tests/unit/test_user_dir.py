"""A user directory (user_dir=...): its modules register beside the built-ins, its conf/ composes like shardlab's, and
a mistake in it is one line naming the file, before training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from shardlab.cli.preflight import preflight
from shardlab.errors import ConfigError
from shardlab.registry import LR_SCHEDULERS, MODELS, OPTIMIZERS, TASKS
from tests.conftest import ROOT, compose_config


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardlab.train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def my_research(research_root) -> Path:
    return research_root / "examples" / "my_research"


def test_a_user_model_composes_like_a_builtin_from_a_relative_path(my_research, monkeypatch):
    monkeypatch.chdir(my_research.parent)
    cfg = compose_config(["user_dir=my_research", "model=gated_conv_tiny", "model.kernel_size=3"])
    assert cfg.user_dir == str(my_research)  # recorded absolute: every later process finds the same folder
    assert OmegaConf.get_type(cfg.model).__name__ == "GatedConvConfig"
    assert (cfg.model.arch, cfg.model.kernel_size, cfg.model.num_layers) == ("gated_conv", 3, 2)
    assert MODELS.get("gated_conv").__module__ == "my_research.gated_conv"
    assert TASKS.get("spirals").__module__ == "my_research.spirals"


def test_a_user_task_preset_brings_its_data_and_model_sections(my_research):
    cfg = compose_config([f"user_dir={my_research}", "task=spirals"])
    assert (cfg.task.name, cfg.model.arch, cfg.data.num_arms) == ("spirals", "spiral_mlp", 3)
    assert OmegaConf.get_type(cfg.data).__name__ == "SpiralsDataConfig"
    lm = compose_config([f"user_dir={my_research}", "task=gated_conv_lm"])
    assert (lm.task.name, lm.model.arch, lm.data.seq_len) == ("lm", "gated_conv", 64)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model=gated_conv_tny", r"^model: 'gated_conv_tny' is not a known model option \(conf/model/\*.yaml and "
         r"user_dir's conf/\); known: .*Did you mean 'gated_conv_tiny'\?"),
        ("model.kernel_sise=3", r"model.kernel_sise"),
        ("model.kernel_size=x", r"model.kernel_size"),
    ],
)  # fmt: skip
def test_the_preflight_checks_user_options_and_keys(my_research, override, message):
    with pytest.raises(ConfigError, match=message):
        preflight([f"user_dir={my_research}", *(["model=gated_conv_tiny"] if "." in override else []), override])


def test_help_and_cfg_job_show_the_user_options(research_root):
    shown = cli("user_dir=examples/my_research", "task=spirals", "--cfg", "job", cwd=research_root)
    assert shown.returncode == 0, shown.stderr[-2000:]
    config = OmegaConf.create(shown.stdout)
    assert (config.task.name, config.model.arch, config.data.num_arms) == ("spirals", "spiral_mlp", 3)
    assert config.user_dir == str(research_root / "examples" / "my_research")


# ---- mistakes: one line naming the file, before training -------------------------------------------------------------
def test_a_plugin_with_an_import_error_fails_before_training_naming_the_file(tmp_path):
    folder = write(tmp_path / "broken_research", {"model.py": "from dataclasses import dataclass\n\nimport einopz\n"})
    proc = cli("user_dir=broken_research", "optimization.max_steps=5", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == f"error: user_dir: {folder}/model.py:3: ModuleNotFoundError: No module named 'einopz'\n"
    assert proc.stdout == "" and not (tmp_path / "runs").exists()


def test_a_plugin_registering_lm_fails_before_training_naming_both_files(tmp_path):
    plugin = "from shardlab.registry import TASKS\n\n\n@TASKS.register('lm')\ndef build(cfg):\n    raise ValueError\n"
    folder = write(tmp_path / "clashing_research", {"my_lm.py": plugin})
    proc = cli(f"user_dir={folder}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "" and not (tmp_path / "runs").exists()
    builtin = ROOT / "shardlab_tasks" / "lm" / "config.py"
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(
        f"error: user_dir: task 'lm' is registered twice: by {folder}/my_lm.py:4 and by {builtin}:"
    ), proc.stderr
    assert proc.stderr.endswith("; give yours another name\n")


LION = """from dataclasses import dataclass

from shardlab.registry import OPTIMIZERS


@dataclass
class LionConfig:
    lr: float = 1e-4


@OPTIMIZERS.register("lion", dataclass=LionConfig)
def build_lion(model, cfg):
    raise AssertionError
"""
ARCH_WITHOUT_NAME = LION.replace("OPTIMIZERS", "MODELS").replace('"lion"', '"mixer"')


@pytest.mark.parametrize(
    "folder, files, message",
    [
        ("missing_research", None, r"^user_dir: .*/missing_research is not a directory"),
        ("my-research", {}, r"^user_dir: .*/my-research is imported as a package named after the folder, and "
         r"'my-research' is not a Python name; rename the folder"),
        ("json", {}, r"^user_dir: .*/json is imported as package 'json', a name already taken by .*json/__init__.py; "
         r"rename the folder"),
        ("shadowing_research", {"conf/model/gpt_tiny.yaml": "num_layers: 1\n"},
         r"^user_dir: .*/shadowing_research/conf/model/gpt_tiny.yaml has the name of a built-in config, which Hydra "
         r"would choose instead of yours; rename it"),
        ("syntax_research", {"a.py": "def f(:\n"}, r"^user_dir: .*/syntax_research/a.py:1: SyntaxError: "),
        ("lion_research", {"lion.py": LION}, r"^user_dir: optimizer 'lion' \(.*/lion_research/lion.py:11\): "
         r"LionConfig must extend OptimizerConfig"),
        ("mixer_research", {"mixer.py": ARCH_WITHOUT_NAME}, r"^user_dir: model architecture 'mixer' "
         r"\(.*/mixer_research/mixer.py:11\): LionConfig needs a field arch: str"),
    ],
)  # fmt: skip
def test_a_mistake_in_a_user_dir_is_one_line_naming_the_file(tmp_path, folder, files, message):
    if files is not None:
        write(tmp_path / folder, files).mkdir(exist_ok=True)
    with pytest.raises(ConfigError, match=message):
        compose_config([f"user_dir={tmp_path / folder}"])
    assert "lion" not in OPTIMIZERS.names() and "mixer" not in MODELS.names()  # nothing half-registered
    assert folder == "json" or folder not in sys.modules


def test_a_user_dir_cannot_be_swept(my_research):
    with pytest.raises(ConfigError, match=r"^user_dir=a,b: one user directory per command; it cannot be swept"):
        compose_config(["user_dir=a,b"])


def test_a_folder_without_init_or_conf_is_a_package_of_its_modules(tmp_path):
    module = "from shardlab.optim.schedules import build_schedule\nfrom shardlab.registry import LR_SCHEDULERS\n\n"
    module += "LR_SCHEDULERS.register('my_constant')(build_schedule)\n"
    helper = "from .schedule import build_schedule as imported_from_a_sibling  # noqa: F401\n"
    write(tmp_path / "schedules_research", {"schedule.py": module, "uses_sibling.py": helper})
    compose_config([f"user_dir={tmp_path / 'schedules_research'}"])
    assert sys.modules["schedules_research.uses_sibling"].imported_from_a_sibling is not None
    assert "my_constant" in LR_SCHEDULERS.names()


def test_a_slurm_job_imports_the_user_dir_before_unpickling_what_refers_to_it(my_research, tmp_path):
    """What submitit runs in a job (and again after a requeue): its pickle refers to the user's classes (the
    launcher's config and Hydra's ConfigStore hold their schemas), which a fresh process finds only once the folder
    is imported. Here the "launcher" is a user class and its argument a user object."""
    import cloudpickle
    import submitit

    from shardlab.jobs.submitit_launcher import AfterUserDir

    compose_config([f"user_dir={my_research}"])
    spirals = sys.modules["my_research.spirals"]
    job = AfterUserDir(str(my_research), spirals.SpiralsDataConfig)
    submission = submitit.helpers.DelayedSubmission(job, cloudpickle.dumps((4, 10, 5, 0.1, 7)))
    requeued = job.checkpoint(*submission.args)
    assert requeued.function is job and requeued.args == submission.args
    path = tmp_path / "submission.pkl"
    requeued.dump(path)
    code = (
        "import sys; from submitit.helpers import DelayedSubmission; "
        f"r = DelayedSubmission.load({str(path)!r}).result(); print(type(r).__module__, r.num_arms, r.seed)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["my_research.spirals", "4", "7"]
