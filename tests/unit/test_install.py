"""What `pip install` puts on a machine (issue 50): the wheel holds every config, the commands the docs use and
shardlab's own top-level names only. The wheel is built once, from a copy of the checkout's tracked files (setuptools
writes build/ into the tree it builds), and read as a zip: no venv, a few seconds. tools/check_wheel.sh installs it
into a fresh venv and runs it from an empty folder (CI, after the suite)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shardlab.config import CONF_DIR
from shardlab_commands import COMMANDS

pytestmark = pytest.mark.slow
"""~40 s (a wheel built): .ci/run's tools/check_wheel.sh builds, installs and runs the wheel after the suite, so the
default suite leaves this quicker read of its file list to -m slow."""

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"shardlab", "shardlab_tasks", "shardlab_commands", "hydra_plugins"}
"""The top-level names the wheel may install: shardlab's own, and the namespace Hydra finds its plug-ins in."""
HYDRA_PLUGINS = {"hydra_plugins/shardlab_launcher", "hydra_plugins/shardlab_user_dir"}
"""hydra_plugins is a namespace other distributions share (hydra-submitit-launcher's): ours only, no __init__.py."""


def tracked_files() -> list[str]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout: the wheel is built from the tracked files")
    return [f for f in done.stdout.split("\0") if f and (REPO / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    pytest.importorskip("setuptools", minversion="64")  # built without isolation: this environment's setuptools
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("shardlab-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_shardlabs_own_top_level_names_only(wheel):
    names = wheel.namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == PACKAGES, f"top-level names besides shardlab's own: {sorted(tops - PACKAGES)}"
    plugins = {n.rsplit("/", 1)[0] for n in names if n.startswith("hydra_plugins/")}
    assert plugins == HYDRA_PLUGINS and "hydra_plugins/__init__.py" not in names


def test_the_wheel_holds_every_config_of_the_checkout(wheel):
    shipped = {n.removeprefix("shardlab/conf/") for n in wheel.namelist() if n.startswith("shardlab/conf/")}
    configs = {p.relative_to(CONF_DIR).as_posix() for p in CONF_DIR.rglob("*.yaml")}
    assert "config.yaml" in configs and "hydra/launcher/slurm.yaml" in configs
    assert shipped == configs


def test_the_wheel_puts_each_command_on_the_path_and_registers_the_task_plug_ins(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parsed = configparser.ConfigParser(delimiters=("=",))
    parsed.read_string(wheel.read(entry_points).decode())
    scripts = dict(parsed["console_scripts"])
    assert scripts == {name: f"shardlab_commands.{module}:cli" for name, module in COMMANDS.items()}
    assert dict(parsed["shardlab.tasks"]) == {
        "lm": "shardlab_tasks.lm.config",
        "image_classification": "shardlab_tasks.image_classification.config",
        "self_supervised": "shardlab_tasks.self_supervised.config",
    }


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_answers_help_with_its_own_name(name, monkeypatch, capsys):
    """The console script calls ``cli()`` with the command's name as argv[0]: --help names it and exits 0."""
    module = __import__(f"shardlab_commands.{COMMANDS[name]}", fromlist=["cli"])
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{name}", "--help"])
    with pytest.raises(SystemExit) as done:
        module.cli()
    assert done.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {name} ")
