"""The command line as a user meets it: one-line errors with exit code 2, dry runs, kill-and-resume."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.runner import build_task, print_plan
from tests.conftest import TINY_LM, compose_config

ROOT = Path(__file__).resolve().parents[2]


def train_cli(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardlab.train", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def run_cli(*args: str) -> tuple[int, str, str]:
    proc = train_cli(*args)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def bad_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    (root / "binary").mkdir()
    (root / "binary" / "x.bin").write_bytes(b"\0" * 100)
    ckpt = root / "run" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "shardlab.json").write_text("{not json")
    (root / "afile").write_text("a file where a directory should go")
    return root


BAD_INPUTS = {
    "unknown task": (["task=lmm"], r"task: 'lmm' is not a known task option .* Did you mean 'lm'\?"),
    "unknown model": (["model=gpt_tyni"], r"Did you mean 'gpt_tiny'\?"),
    # The known list is read from conf/optimizer, so a new optimizer does not break this case.
    "unknown optimizer": (
        ["optimizer=adamm"],
        r"known: "
        + re.escape(", ".join(sorted(p.stem for p in (ROOT / "shardlab/conf/optimizer").glob("*.yaml"))))
        + r"\. Did you mean 'adamw'\?",
    ),
    "unknown scheduler": (["lr_scheduler=cosin"], r"Did you mean 'cosine'\?"),
    "unknown backend": (["distributed.backend=fuly_sharded"], r"Did you mean 'fully_sharded'\?"),
    "wrong type": (["optimization.batch_size=abc"], r"optimization.batch_size"),
    "negative lr": (["optimizer.lr=-0.1"], r"optimizer.lr must be > 0, got -0.1"),
    "zero batch": (["optimization.batch_size=0"], r"optimization.batch_size must be > 0, got 0"),
    "negative warmup": (["lr_scheduler.warmup_steps=-1"], r"lr_scheduler.warmup_steps must be >= 0, got -1"),
    "missing data path": (["data.path={root}/nope"], r"data.path: .*/nope does not exist"),
    "no text in data path": (["data.path={root}/binary"], r"data.path: .*/binary holds no text files"),
    "checkpoint dir cannot be created": (
        ["hydra.run.dir={root}/run2", "checkpoint.dir={root}/afile/ckpt", *TINY_LM],
        r"^error: checkpoint.dir: cannot create or write .*/afile/ckpt \(.*/afile is a file, not a directory\)",
    ),
    "run dir cannot be created": (["hydra.run.dir={root}/afile/run"], r"^error: hydra.run.dir: cannot create or write"),
    "checkpoint dir under /proc": (
        ["hydra.run.dir={root}/run3", "checkpoint.dir=/proc/shardlab-ckpt", *TINY_LM],
        r"^error: checkpoint.dir=/proc/shardlab-ckpt is /proc/shardlab-ckpt, inside the system folder /proc: .+; "
        r"choose a folder of its own",
    ),
    "no validation split with validation on": (
        ["hydra.run.dir={root}/run4", *TINY_LM, "data.valid_percent=0", "validation.interval_steps=5"],
        r"^error: the validation split is empty \(data.valid_percent=0 holds none out\): set "
        r"validation.interval_steps=0 to train on every record without validation, or raise data.valid_percent",
    ),
    "run dir named by the clock": (
        ["hydra.run.dir={root}/${{now:%H-%M-%S}}"],
        r"^error: hydra.run.dir=.*\$\{now:%H-%M-%S\} names the run's folder by the clock: a requeue or a rerun",
    ),
    "unknown key added with +": (
        ["+optimizer.foo=1"],
        r"optimizer.foo is not a known key of optimizer .*drop \+optimizer.foo",
    ),
    "degenerate model shape": (["model.num_layers=0"], r"model.num_layers must be >= 1, got 0"),
    "renamed key": (
        ["data.jsonl_field=content"],
        r"^error: data.jsonl_field was renamed data.text_field; use data.text_field=content$",
    ),
    "renamed key added with +": (["+data.jsonl_field=body"], r"^error: data.jsonl_field was renamed data.text_field; "),
    "corrupt checkpoint": (
        ["hydra.run.dir={root}/run", "checkpoint.resume={root}/run/checkpoints/step_00000004", *TINY_LM],
        r"shardlab.json is unreadable",
    ),
}


def bad_input_command(case: str, bad_paths: Path) -> tuple[list[str], Path, bool]:
    """BAD_INPUTS[case]'s command line, the run folder it names, and whether the case names its own."""
    args = [a.format(root=bad_paths) for a in BAD_INPUTS[case][0]]
    own_dir = any(a.startswith("hydra.run.dir=") for a in args)  # the cases about the folders name their own
    run = bad_paths / "runs" / re.sub(r"\W+", "_", case)
    return [*args, f"data.cache_dir={bad_paths}/cache", *([] if own_dir else [f"hydra.run.dir={run}"])], run, own_dir


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_one_line_error_and_nonzero_exit(case, bad_paths, cli_forks):
    pattern = BAD_INPUTS[case][1]
    command, run, own_dir = bad_input_command(case, bad_paths)
    done = cli_forks.run(*command)
    code, out, err = done.returncode, done.stdout, done.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (out, err)
    assert own_dir or not run.exists(), f"{case}: refused, but after its run folder was written"
    assert "[train]" not in out  # refused before the first step
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert re.search(pattern, lines[0]), lines[0]


REFUSED = {
    "out of range": (["optimizer.lr=-0.1"], {}),
    "mistyped key": (["optimization.bach_size=3"], {}),
    "unknown key": (["+optimizer.foo=1"], {}),
    "config named with -cn": (["-cn", "config", "optimizer.lr=-0.1"], {}),
    "user's HYDRA_FULL_ERROR=0": (["optimization.bach_size=3"], {"HYDRA_FULL_ERROR": "0"}),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_config_makes_no_run_directory(case, tmp_path, cli_forks):
    """Hydra composes the run; the composed config is checked before Hydra makes the run directory, and a composition
    error stops it before that too: one line, exit code 2, whatever Hydra's error switch says."""
    args, env = REFUSED[case]
    done = cli_forks.run(*args, f"hydra.run.dir={tmp_path}/run", env=env)
    err = done.stderr
    assert done.returncode == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


FRESH = ("unknown task", "negative lr", "run dir cannot be created", "user's HYDRA_FULL_ERROR=0")
"""A refusal before Hydra runs (the command line's own check), one by the composed config's checks, one of a folder,
and one under the user's Hydra error switch: each as a fresh interpreter shows it, against the fork the other cases
run in."""


@pytest.mark.parametrize("case", FRESH)
def test_a_fresh_interpreter_refuses_as_the_forks_do(case, bad_paths, cli_forks, tmp_path):
    if case in REFUSED:
        (args, env), run, own_dir = REFUSED[case], tmp_path / "run", False
        command = [*args, f"hydra.run.dir={run}"]
    else:
        (command, run, own_dir), env = bad_input_command(case, bad_paths), {}
    fresh = train_cli(*command, env=env)
    out, err = fresh.communicate(timeout=300)
    assert fresh.returncode == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert own_dir or not run.exists()
    forked = cli_forks.run(*command, env=env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, out, err)


def test_dry_run_prints_size_of_large_model_without_allocating_it(capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = compose_config(["model=gpt_1_3b", "dry_run=true", "distributed=fully_sharded", "distributed.world_size=8"])
    print_plan(cfg, build_task(cfg, world_size=1))
    out = capsys.readouterr().out
    assert "model: 1,315,819,520 parameters" in out
    assert re.search(r"blocks\.23 +Block +50,358,272", out)  # the unit plan, one line per FSDP unit
    # The memory plan: the chosen layout's breakdown, then every alternative with its per-rank peak.
    assert re.search(r"memory plan per rank \(fully_sharded, 4 samples per micro-batch\): peak ~[\d.]+ GiB", out)
    rows = {m[2]: float(m[3]) for m in re.finditer(r"^([* ]) (\S.*?) {2,}([\d.]+) ", out, re.MULTILINE)}
    for layout in ("ddp", "fully_sharded", "hybrid, shards of 2", "fully_sharded + act. ckpt"):
        assert layout in rows, f"{layout} missing from the alternatives: {sorted(rows)}"
    assert rows["ddp"] > 4 * rows["fully_sharded"]  # 1.3B x 20 bytes on every rank vs an eighth of the state
    assert rows["fully_sharded + act. ckpt"] < rows["fully_sharded"]
    assert re.search(r"^\* fully_sharded ", out, re.MULTILINE)  # the configured layout is marked
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 500, f"dry run allocated {grown_mib:.0f} MiB; the weights alone would be 5000"


def test_help_lists_groups_and_options():
    code, out, _ = run_cli("--help")
    assert code == 0
    for pattern in (r"^task: .*\blm\b", r"^model: .*\bgpt_1_3b\b", r"^distributed: .*\bfully_sharded\b"):
        assert re.search(pattern, out, re.MULTILINE), pattern


KILL_RUN = [
    "model.num_layers=2",
    "model.dim=128",
    "model.num_heads=4",
    "model.max_seq_len=64",
    "data.seq_len=64",
    "data.max_corpus_mb=1",
    "optimization.batch_size=8",
    "optimization.max_steps=40",
    "lr_scheduler.warmup_steps=4",
    "validation.interval_steps=20",
    "validation.num_batches=4",
    "checkpoint.interval_steps=10",
    "logging.interval_steps=10",
    "logging.tensorboard=false",
]


def final_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("final validation:"))


@pytest.mark.slow  # in CI's e2e pass, test_kill_loop.py kills the CLI twice mid-run: the same weights at the end
def test_killed_run_rerun_with_resume_auto_ends_like_an_uninterrupted_one(tmp_path, corpus_cache):
    common = [*KILL_RUN, f"data.cache_dir={corpus_cache}"]
    code, out, err = run_cli(*common, f"hydra.run.dir={tmp_path / 'whole'}")
    assert code == 0, err
    expected = final_line(out)

    run_dir = tmp_path / "killed"
    proc = train_cli(*common, f"hydra.run.dir={run_dir}")
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "step_00000010").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (run_dir / "checkpoints" / "step_00000040").exists(), "killed too late to test resuming"

    code, out, err = run_cli(*common, f"hydra.run.dir={run_dir}", "checkpoint.resume=auto")
    assert code == 0, err
    assert "resumed from" in out
    assert final_line(out) == expected


def test_train_log_holds_the_console_lines_and_the_logged_lr_is_the_steps_own(tmp_path, corpus_cache):
    code, out, err = run_cli(
        *KILL_RUN[:7], f"data.cache_dir={corpus_cache}", f"hydra.run.dir={tmp_path}", "optimization.max_steps=6",
        "lr_scheduler=constant", "lr_scheduler.warmup_steps=4", "optimizer.lr=1e-3", "logging.interval_steps=1",
        "validation.interval_steps=3", "logging.tensorboard=false",
    )  # fmt: skip
    assert code == 0, err
    console = [line for line in out.splitlines() if line.startswith(("[train]", "[valid]"))]
    logged = [line.split("] ", 1)[1] for line in (tmp_path / "train.log").read_text().splitlines()]
    assert len(console) == 8 and [line for line in logged if line.startswith(("[train]", "[valid]"))] == console
    lrs = [re.search(r"\| lr (\S+) \|", line).group(1) for line in console if line.startswith("[train]")]
    assert lrs == ["2.00e-04", "4.00e-04", "6.00e-04", "8.00e-04", "1.00e-03", "1.00e-03"]  # warmup (s+1)/5, then peak


def test_cli_runs_from_a_directory_holding_its_own_tasks_and_conf(tmp_path):
    """Python puts the working directory first on sys.path, and a project has its own tasks/ and conf/: neither may
    replace the built-in task plug-ins (``shardlab_tasks``) or shardlab's configs (``shardlab/conf``). Both in one
    folder, one run: either one taken would fail it (the module raises; the YAML holds no config)."""
    for shadow in ("tasks/__init__.py", "conf/config.yaml"):
        (tmp_path / shadow).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / shadow).write_text("raise RuntimeError('the user module was imported')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "shardlab.train", "task=image_classification", "dry_run=true"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "FSDP units" in proc.stdout or "model:" in proc.stdout
