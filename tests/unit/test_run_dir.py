"""The run directory follows the experiment: keys that only change how a run executes do not move it."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from shardlab.jobs.run_dir import MAX_NAME, run_name
from shardlab.train import CONF_DIR


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
    ):
        assert hydra_dirs([*base, *how])[0] == run_dir == "runs/lm/model=gpt_small,optimizer.lr=3e-4"


def test_what_defines_the_experiment_names_the_directory():
    assert hydra_dirs([])[0] == "runs/lm/default"
    assert hydra_dirs(["seed=2"])[0] == "runs/lm/seed=2"
    assert hydra_dirs(["task=image_classification", "data.augment=false"])[0] == (
        "runs/image_classification/data.augment=false,task=image_classification"
    )
    assert run_name(["data.path=/my/corpus"]) == "data.path=_my_corpus"
    init = "checkpoint.init_from=w.safetensors"
    assert run_name([init, "checkpoint.keep_last=3"]) == init  # other starting weights: another experiment


def test_a_user_dir_names_the_run_by_its_folder_not_by_where_it_lives():
    assert run_name(["task=spirals", "user_dir=/home/me/code/my_research"]) == "task=spirals,user_dir=my_research"
    assert run_name(["user_dir='/home/me/my code/my_research'"]) == "user_dir=my_research"


def test_sweep_points_keep_every_override_and_their_number():
    _, subdir = hydra_dirs(["optimizer.lr=1e-3", "distributed.world_size=2", "logging.progress_bar=false"])
    assert subdir == "3_distributed.world_size=2,optimizer.lr=1e-3"


def test_long_names_are_cut_with_a_hash_of_the_whole_name():
    many = [f"model.key{i}={i}" for i in range(40)]
    name, other = run_name(many), run_name([*many[:-1], "model.key39=x"])
    assert len(name) == MAX_NAME and len(other) == MAX_NAME and name != other
    assert name[:100] == other[:100]
