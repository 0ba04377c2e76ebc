"""The run directory follows the experiment: keys that only change how a run executes do not move it."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from shardlab.cli.run_names import MAX_NAME, run_key_differences, run_name, sweep_dir_name
from shardlab.config import CONF_DIR
from shardlab.jobs.run_folders import checkpoint_dir_error, folder_errors


def hydra_dirs(overrides: list[str]) -> tuple[str, str]:
    """(run dir, sweep subdir of job 3) as Hydra resolves them for these overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    cfg.hydra.job.num = 3
    HydraConfig.instance().set_config(cfg)
    try:
        return str(cfg.hydra.run.dir), str(cfg.hydra.sweep.subdir)
    finally:
        HydraConfig.instance().cfg = None  # later tests must not see a Hydra run


def test_how_a_run_executes_does_not_move_its_directory():
    base = ["model=gpt_small", "optimizer.lr=3e-4"]
    run_dir, _ = hydra_dirs(base)
    for how in (
        ["distributed.world_size=2", "distributed.backend=fully_sharded"],
        ["distributed=ddp", "distributed.cpu_offload=false"],
        ["optimization.max_steps=5000", "checkpoint.interval_steps=50", "++checkpoint.resume=auto"],
        ["logging.interval_steps=1", "validation.num_batches=3", "data.cache_dir=/tmp/c", "dry_run=true"],
        ["optimization.max_nonfinite_steps=10", "distributed.on_lost_host=fail"],
        ["distributed.plan_device=h100_80gb", "distributed.verify_plan=true"],
    ):
        assert hydra_dirs([*base, *how])[0] == run_dir == "runs/lm/model=gpt_small,optimizer.lr=3e-4"


def test_what_defines_the_experiment_names_the_directory():
    assert hydra_dirs([])[0] == "runs/lm/default"
    assert hydra_dirs(["seed=2"])[0] == "runs/lm/seed=2"
    # The task names the folder above: task=swav trains in runs/swav/default; a sweep's points name it in theirs.
    named = hydra_dirs(["task=image_classification", "data.augment=false"])
    assert named == ("runs/image_classification/data.augment=false", "3_data.augment=false,task=image_classification")
    assert hydra_dirs(["task=swav"])[0] == "runs/swav/default"
    assert run_name(["data.path=/my/corpus"]) == "data.path=%2Fmy%2Fcorpus"
    init = "checkpoint.init_from=w.safetensors"
    assert run_name([init, "checkpoint.keep_last=3"]) == init  # other starting weights: another experiment


def test_different_values_never_share_a_folder():
    """Paths that differ only where a slash stood, and a value that spells an escape, each get their own name."""
    names = [
        run_name(["data.path=/a/b_c"]),
        run_name(["data.path=/a/b/c"]),
        run_name(["data.path=/a/b%2Fc"]),
        run_name(["data.path=_a_b_c"]),
        run_name(["data.tokenizer=/t/x.json", "data.path=/a"]),
        run_name(["data.tokenizer=/t/x.json,data.path=/a"]),
    ]
    assert names[:2] == ["data.path=%2Fa%2Fb_c", "data.path=%2Fa%2Fb%2Fc"]
    assert len(set(names)) == len(names)
    assert run_name(["optimizer.betas=[0.9,0.95]", "model=gpt_small"]) == "model=gpt_small,optimizer.betas=[0.9,0.95]"
    assert hydra_dirs(["data.path=/a/b_c"])[0] != hydra_dirs(["data.path=/a/b/c"])[0]


def test_run_key_differences_name_what_makes_another_experiment():
    saved = {"data": {"path": "/a/b_c", "cache_dir": "/c1"}, "optimizer": {"lr": 1e-3}, "seed": 1,
             "distributed": {"world_size": 2},
             "optimization": {"max_steps": 10, "batch_size": 8, "max_nonfinite_steps": 3}}  # fmt: skip
    same_run = {**saved, "distributed": {"world_size": 1}, "data": {"path": "/a/b_c", "cache_dir": "/c2"},
                "optimization": {"max_steps": 20, "batch_size": 8, "max_nonfinite_steps": 9}}  # fmt: skip
    assert run_key_differences(saved, same_run) == []  # how it runs, where it caches, how long: the same run
    other = {**same_run, "data": {"path": "/a/b/c", "cache_dir": "/c2"}, "seed": 2, "new_key": 1}
    assert run_key_differences(saved, other) == [("data.path", "/a/b_c", "/a/b/c"), ("seed", 1, 2)]


def test_a_user_dir_names_the_run_by_its_folder_not_by_where_it_lives():
    assert run_name(["task=spirals", "user_dir=/home/me/code/my_research"]) == "user_dir=my_research"
    assert run_name(["user_dir='/home/me/my code/my_research'"]) == "user_dir=my_research"
    moved = {"user_dir": "/home/me/code/my_research"}, {"user_dir": "/scratch/me/my_research"}
    assert run_key_differences(*moved) == []  # the same code, moved: the same run
    other = {"user_dir": "/home/me/code/my_research"}, {"user_dir": "/home/me/code/other_research"}
    assert run_key_differences(*other) == [("user_dir", *(d["user_dir"] for d in other))]


def test_sweep_points_keep_every_override_and_their_number():
    _, subdir = hydra_dirs(["optimizer.lr=1e-3", "distributed.world_size=2", "logging.progress_bar=false"])
    assert subdir == "3_distributed.world_size=2,optimizer.lr=1e-3"


def test_a_sweeps_folder_is_named_by_its_overrides_and_a_sweep_over_tasks_by_them_all():
    """The sweep's own config composes only the default task when task= is swept: such a sweep names its tasks."""
    assert sweep_dir_name("lm", ["optimizer.lr=1e-3,3e-3"]) == "lm/optimizer.lr=1e-3,3e-3"
    assert sweep_dir_name("swav", ["task=swav", "seed=1,2"]) == "swav/seed=1,2"  # the folder above names the task
    assert sweep_dir_name("lm", ["task=lm,swav"]) == "tasks/task=lm,swav"
    assert sweep_dir_name("lm", ["task=image_classification,simclr", "seed=1,2"]) != sweep_dir_name("lm", ["seed=1,2"])
    assert sweep_dir_name("lm", ["task=glob(*)"]) == "tasks/task=glob%28%2A%29"
    assert sweep_dir_name("lm", []) == "lm/default"


def test_long_names_are_cut_with_a_hash_of_the_whole_name():
    many = [f"model.key{i}={i}" for i in range(40)]
    name, other = run_name(many), run_name([*many[:-1], "model.key39=x"])
    assert len(name) == MAX_NAME and len(other) == MAX_NAME and name != other
    assert name[:100] == other[:100]


def test_a_run_whose_name_changed_is_pointed_at_its_former_folder(tmp_path, capsys):
    from shardlab.runner import point_at_former_folder

    overrides = ["data.path=/my/corpus"]
    former = tmp_path / "data.path=_my_corpus"
    (former / "checkpoints" / "step_00000010").mkdir(parents=True)
    point_at_former_folder(tmp_path / run_name(overrides), overrides, "checkpoints")
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"[run] note: {former} holds checkpoints of these overrides")
    point_at_former_folder(tmp_path / run_name(["seed=2"]), ["seed=2"], "checkpoints")  # a name that never changed
    assert capsys.readouterr().out == ""
    (tmp_path / "task=swav" / "checkpoints" / "step_00000060").mkdir(parents=True)  # named with its task, before
    point_at_former_folder(tmp_path / run_name(["task=swav"]), ["task=swav"], "checkpoints")
    assert capsys.readouterr().out.startswith(f"[run] note: {tmp_path / 'task=swav'} holds checkpoints")


def test_checkpoint_dir_error_refuses_only_paths_that_climb_out_of_the_run():
    for inside in ("checkpoints", "a/b", "sub/../ckpt", ".", "/scratch/me/ckpt", "/a/../b"):
        assert checkpoint_dir_error(inside) is None, inside
    for outside in ("..", "../x", "../../elsewhere", "a/../../b"):
        error = checkpoint_dir_error(outside)
        assert error.startswith(f"checkpoint.dir={outside} leaves the run folder") and "\n" not in error


@pytest.mark.parametrize(
    "run_dir, checkpoint_dir, key, found",
    [
        ("/etc", "checkpoints", "hydra.run.dir", "/etc, a system folder itself"),
        ("/work/runs/x", "/", "checkpoint.dir", "/, a system folder itself"),
        ("/work/runs/x", "/usr/share/ck", "checkpoint.dir", "/usr/share/ck, inside the system folder /usr"),
        ("/var/run/x", "checkpoints", "hydra.run.dir", "inside the system folder /var/run"),
        ("/tmp", "checkpoints", "hydra.run.dir", "/tmp, a system folder itself"),
        ("/tmp/x", "/root", "checkpoint.dir", "/root, a system folder itself"),
    ],
)
def test_system_folders_are_refused_as_run_or_checkpoint_folders(run_dir, checkpoint_dir, key, found):
    (error,) = folder_errors(run_dir, checkpoint_dir)
    assert error.startswith(f"{key}=") and found in error and "\n" not in error


def test_the_home_folder_itself_is_refused_and_folders_below_it_are_not(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    (error,) = folder_errors(tmp_path / "runs" / "x", str(tmp_path))
    assert f"checkpoint.dir={tmp_path} is {tmp_path.resolve()}, the home folder itself" in error
    assert folder_errors(tmp_path / "runs" / "x", "checkpoints") == []
    assert folder_errors("/tmp/runs/x", "/scratch/ck") == []


def test_a_checkpoint_dir_starting_with_a_tilde_is_refused_in_one_line():
    """Hydra leaves ``~`` as it is: the lock went to $HOME/ck and the checkpoints to <run>/~/ck."""
    (error,) = folder_errors("/work/runs/x", "~/ck")
    assert error.startswith("checkpoint.dir=~/ck starts with '~'") and "${oc.env:HOME}/ck" in error


def test_the_preflight_refuses_a_system_run_folder_before_anything_is_written():
    from shardlab.cli.preflight import preflight
    from shardlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^hydra.run.dir=/etc is /etc, a system folder itself"):
        preflight(["hydra.run.dir=/etc"])


def sweep_folder(overrides: list[str]) -> str:
    """multirun/<...> as NameTheSweep names it for this command line (Hydra splits it into task and hydra overrides)."""
    from shardlab.cli import run_names as run_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    run_dir.NameTheSweep().on_multirun_start(cfg)
    try:
        return run_dir._sweep_dir()
    finally:
        run_dir._sweep_name = None  # no multirun runs after this test


def test_a_sweep_on_another_launcher_or_shape_is_another_sweep_folder():
    """Launcher keys name a sweep: the same points on Slurm with 2 nodes never find the local sweep's checkpoints."""
    points = ["optimizer.lr=3e-3", "model=gpt_small"]  # composed as one point (Hydra's compose has no sweeps)
    local = sweep_folder(points)
    assert local == "lm/model=gpt_small,optimizer.lr=3e-3"
    slurm = sweep_folder([*points, "hydra/launcher=slurm"])
    two_nodes = sweep_folder([*points, "hydra/launcher=slurm", "hydra.launcher.nodes=2"])
    assert len({local, slurm, two_nodes}) == 3
    assert two_nodes == "lm/hydra.launcher.nodes=2,launcher=slurm,model=gpt_small,optimizer.lr=3e-3"
    assert "%" not in two_nodes  # sbatch reads % in an --output path as a filename pattern
    assert sweep_folder([*points, "hydra.verbose=true"]) == local  # Hydra's own keys do not name it
    # Where and how long the jobs wait do not: a resubmission to another partition continues the same sweep.
    waits = ["hydra.launcher.partition=multi", "hydra.launcher.timeout_min=30", "hydra.launcher.wait=false"]
    assert sweep_folder([*points, "hydra/launcher=slurm", "hydra.launcher.nodes=2", *waits]) == two_nodes
