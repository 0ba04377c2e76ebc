"""Everything the config and the data allow to be checked, checked before the first step, each in one line naming
the keys and the fix: directories by creating them, the splits against their batch sizes, another task's model or
data config, keys the chosen architecture ignores. (Through the CLI: tests/unit/test_cli.py's BAD_INPUTS.)"""

from __future__ import annotations

import os
import re
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardlab.cli.checks import path_errors
from shardlab.cli.preflight import preflight
from shardlab.errors import ConfigError, DataError
from shardlab.jobs.run_folders import writable_dir_problem
from shardlab.runner import build_task, prepare_data
from tests.conftest import TINY_LM, compose_config


# ---- directories: created, written in, and removed again ---------------------------------------------------------
def test_a_directory_under_proc_is_refused_although_root_passes_every_access_check():
    problem = writable_dir_problem(Path("/proc/shardlab-checkpoints/run"))
    assert problem is not None and problem.startswith("creating it failed: ")
    if os.geteuid() == 0:
        assert os.access("/proc", os.W_OK)  # what the old check asked, and why it let /proc through


def test_a_directory_below_a_regular_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert (
        writable_dir_problem(tmp_path / "afile" / "ckpt" / "deeper")
        == f"{tmp_path / 'afile'} is a file, not a directory"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_directory_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert writable_dir_problem(locked / "ckpt").startswith("creating it failed: Permission denied")
        assert writable_dir_problem(locked).startswith("writing a file in it failed: Permission denied")
    finally:
        locked.chmod(stat.S_IRWXU)


def test_the_check_leaves_the_filesystem_as_it_found_it(tmp_path):
    cfg = compose_config(["checkpoint.dir=ckpt/deep"])
    assert path_errors(cfg, tmp_path / "new" / "run") == []
    assert list(tmp_path.iterdir()) == []  # created, probed, removed
    (tmp_path / "run").mkdir()
    assert path_errors(cfg, tmp_path / "run") == [] and list((tmp_path / "run").iterdir()) == []


def test_ranks_that_check_one_new_run_directory_at_once_all_pass(tmp_path):
    """Every rank checks the job's run directory before Hydra makes it; one rank's clean-up removed the directory
    under another's probe ("writing a file in it failed: No such file or directory", a CI failure of a 4-rank run), or
    between an exists() and an is_dir() that another rank's mkdir then answered ("is a file, not a directory")."""
    target = tmp_path / "runs" / "new"
    with ThreadPoolExecutor(8) as pool:
        problems = list(pool.map(lambda _: writable_dir_problem(target), range(400)))
    assert [p for p in problems if p is not None] == []


def test_ranks_of_one_job_never_remove_the_run_directory_another_is_starting_in(tmp_path, monkeypatch):
    """Four torchrun ranks check one new run directory; each then does what Hydra does once its checks pass: make the
    directory and open its log file there. A rank's clean-up removed the directory between another's mkdir and its
    open (a CI failure: "Unable to configure handler 'file'" on two ranks, the other node waiting for them)."""
    from shardlab.cli import checks
    from shardlab.cli.preflight import check_composed

    # The race is in the directory probe: the config's value checks (the same config 800 times) only slow it down.
    monkeypatch.setattr(checks, "check", lambda cfg: None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = compose_config(["distributed.backend=fully_sharded"])

    def start_rank(run_dir: Path, rank: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        check_composed(cfg, [f"hydra.run.dir={run_dir}"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"train_rank{rank}.log").open("a").close()

    with ThreadPoolExecutor(4) as pool:
        for job in range(200):  # the old check failed ~7 of 200 such jobs here
            barrier = threading.Barrier(4)
            starts = [pool.submit(start_rank, tmp_path / f"run{job}", rank, barrier) for rank in range(4)]
            for start in starts:
                start.result()


def test_a_checkpoint_dir_that_climbs_out_of_the_run_is_refused_in_one_line_before_anything_is_written(
    tmp_path, corpus_cache, cli_forks
):
    """checkpoint.dir=../../elsewhere: every run would share that folder (resume, save and prune each other's
    checkpoints) while each held only its own run's lock. It used to be accepted."""
    run = tmp_path / "runs" / "a"
    args = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={run}", "checkpoint.dir=../../elsewhere",
            "optimization.max_steps=3"]  # fmt: skip
    proc = cli_forks.run(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: checkpoint.dir=../../elsewhere leaves the run folder through '..'")
    assert list(tmp_path.iterdir()) == [], "nothing written: no run folder, no lock"


def test_a_checkpoint_dir_inside_the_run_or_named_outright_passes(tmp_path):
    for ok in ("checkpoints", "sub/../ckpt", str(tmp_path / "scratch")):
        preflight([f"checkpoint.dir={ok}", f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^checkpoint.dir=a/../../b leaves the run folder"):
        preflight(["checkpoint.dir=a/../../b", f"hydra.run.dir={tmp_path / 'run'}"])


def test_checkpoint_dir_errors_name_the_key_and_the_fix(tmp_path):
    cfg = compose_config(["checkpoint.dir=/proc/ckpt"])
    (error,) = path_errors(cfg, tmp_path)
    assert re.fullmatch(
        r"checkpoint.dir: cannot create or write .*/proc/ckpt \(creating it failed: .+\); choose a writable directory",
        error,
    )


# ---- the data against the batch sizes (after it is opened, before the process group and the first step) ---------
def test_an_lm_validation_split_smaller_than_one_validation_batch_gets_a_batch_that_fits_it(tiny_lm, capsys):
    cfg = tiny_lm("validation.batch_size=100000")
    task = build_task(cfg, 1)
    prepare_data(task)
    held = len(task.valid_dataset)
    assert 0 < held < 100000 and cfg.validation.batch_size == held
    lines = capsys.readouterr().out.splitlines()  # after the corpus's preprocessing lines where this test made it
    assert lines[-1] == (
        f"validation.batch_size=100000 lowered to {held}: the validation split holds {held} blocks of data.seq_len=32 "
        "tokens"
    ), lines
    assert task.fit_validation_batch(readers=held + 1) is None  # fewer than one sample a rank: data_errors refuses
    cfg.validation.batch_size = held + 1
    assert task.data_errors() == [
        f"validation.batch_size ({held + 1}) is more than the {held} blocks of data.seq_len=32 tokens of the "
        "validation split; lower validation.batch_size or raise data.valid_percent, lower data.seq_len, or add text "
        "to data.path"
    ]


def test_a_training_split_smaller_than_one_global_batch_is_refused():
    cfg = compose_config(["task=image_classification", "data.num_train=20", "data.image_size=8"])
    with pytest.raises(DataError, match=r"^optimization.batch_size \(64\) is more than the 20 samples of the training "
                       r"split; lower optimization.batch_size or raise data.num_train"):  # fmt: skip
        prepare_data(build_task(cfg, 1))


def test_splits_that_hold_a_batch_pass_and_report_what_was_opened(tiny_lm):
    task = build_task(tiny_lm(), 1)
    opened = prepare_data(task)
    assert re.fullmatch(r"[\d,]+ train / [\d,]+ valid tokens \([0-9a-f]{24}\)", opened), opened


# ---- model and data configs of the other task; keys the architecture ignores -----------------------------------
OTHER_TASK = {
    "vision task, LM model": (
        ["task=image_classification", "model=gpt_tiny"],
        r"^model=gpt_tiny is a model config of another task \(shardlab_tasks.lm\); task=image_classification reads its "
        r"own: model=regnet_cifar",
    ),
    "LM task, vision model": (
        ["model=regnet_y_400mf"],
        r"^model=regnet_y_400mf is a model config of another task \(shardlab_tasks.image_classification\); task=lm "
        r"reads its own: model=gpt_125m \| gpt_1_3b",
    ),
    "vision task, LM data": (
        ["task=image_classification", "data=lm"],
        r"^data=lm is a data config of another task \(shardlab_tasks.lm\); task=image_classification reads its own: "
        r"data=image$",
    ),
    "LM task, vision data": (["data=image"], r"^data=image is a data config of another task"),
}


@pytest.mark.parametrize("case", OTHER_TASK)
def test_a_model_or_data_config_of_the_other_task_is_refused_in_one_line(case):
    overrides, pattern = OTHER_TASK[case]
    with pytest.raises(ConfigError) as caught:
        preflight(overrides)
    assert re.search(pattern, str(caught.value)) and "\n" not in str(caught.value), str(caught.value)


def test_the_other_tasks_model_is_refused_when_composed_without_the_cli_too():
    """Tools and tests compose and build tasks directly: build_task checks the sections' schemas itself."""
    cfg = compose_config(["task=image_classification", "model=gpt_tiny"])
    with pytest.raises(ConfigError, match=r"^model: task image_classification cannot read a GPTConfig \(a model "
                       r"config of shardlab_tasks.lm\); use one of its own: model=regnet_cifar \| "):  # fmt: skip
        build_task(cfg, 1)


IGNORED = {
    "cifar shape on a torchvision flavor": (
        ["task=image_classification", "model=regnet_y_400mf", "model.depth=10", "model.w_0=32"],
        r"model.depth, model.w_0 shape arch=regnet_cifar only; arch=regnet takes its shape from model.flavor "
        r"\(regnet_y_400mf\): drop them or use model=regnet_cifar",
    ),
    "flavor on regnet_cifar": (
        ["task=image_classification", "model.flavor=regnet_y_16gf"],
        r"model.flavor \(regnet_y_16gf\) names a torchvision RegNet, which arch=regnet_cifar does not read",
    ),
    "architecture of the other task": (
        ["task=image_classification", "model.arch=gpt"],
        # (a user_dir's architectures, registered by other tests, may be listed too: the task checks their shape)
        r"model.arch: 'gpt' is not a known model architecture of task image_classification; known: (\w+, )*regnet, "
        r"regnet_cifar",
    ),
    "negative corpus cap": (["data.max_corpus_mb=-1"], r"data.max_corpus_mb must be >= 0 \(0 = all\), got -1.0"),
    "no fake classes": (
        ["task=image_classification", "data.source=fake", "data.num_fake_classes=0"],
        r"data.num_fake_classes must be >= 1, got 0",
    ),
}


@pytest.mark.parametrize("case", IGNORED)
def test_keys_the_model_ignores_and_values_no_run_can_use_are_refused_before_anything_starts(case):
    overrides, pattern = IGNORED[case]
    with pytest.raises(ConfigError) as caught:
        build_task(compose_config(overrides), 1)
    assert re.search(pattern, str(caught.value)), str(caught.value)


def test_an_unwritable_cache_dir_is_one_line_naming_the_key(tmp_path):
    cfg = compose_config(["data.cache_dir=/proc/shardlab-cache", "data.max_corpus_mb=1"])
    with pytest.raises(DataError, match=r"^data.cache_dir: cannot write /proc/shardlab-cache/.*\.lock to preprocess"):
        prepare_data(build_task(cfg, 1))


def test_only_global_rank_0_records_the_run_and_holds_its_lock(tmp_path, monkeypatch):
    """Every rank of a torchrun or Slurm job runs Hydra: the others leave .hydra/ to rank 0, which writes it once it
    holds the lock, so a rank of a refused job writes nothing in a running job's folder either."""
    from hydra import compose, initialize_config_dir

    from shardlab.cli.preflight import hold_the_run, resolved_run_dir
    from shardlab.config import CONF_DIR
    from shardlab.jobs import run_lock

    run = tmp_path / "run"
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=[f"hydra.run.dir={run}"], return_hydra_config=True)
        assert resolved_run_dir(cfg) == str(run)
        try:
            hold_the_run(cfg, str(run))
            assert (cfg.hydra.output_subdir is None) == (rank == 1)
            assert (run / run_lock.LOCK_FILE).is_file() == (rank == 0)
        finally:
            run_lock.release(run)
