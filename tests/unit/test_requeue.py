"""A requeue reruns the same command: with any resume setting, a run that finds its own checkpoints continues from
the newest one, never from where the setting says a new run begins; and it continues only its own run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError, ConfigError
from shardlab.runner import run_rank
from shardlab_commands import consolidate

CKPT = [
    "optimization.max_steps=12",
    "checkpoint.interval_steps=4",
    "checkpoint.keep_last=3",
    "validation.interval_steps=0",
]


def train_losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def assert_continues(resumed: dict, reference: dict, first_step: int) -> None:
    got, expected = train_losses(resumed), train_losses(reference)
    assert sorted(got) == list(range(first_step, 13)), "resumed at the newest checkpoint of its own run"
    assert torch.equal(torch.tensor([got[s] for s in sorted(got)]), torch.tensor([expected[s] for s in sorted(got)]))


@pytest.fixture(scope="module")
def reference(tiny_lm, tmp_path_factory):
    """An uninterrupted run keeping steps 4, 8 and 12: where explicit resumes begin, and the losses to match."""
    run_dir = tmp_path_factory.mktemp("reference")
    return run_dir, run_rank(tiny_lm(*CKPT), run_dir, dist_env.detect())


def crash_then_requeue(tiny_lm, run_dir, crash_lm_loss_at, crash_at_call: int, *setting: str) -> dict:
    """The same command twice: the first attempt dies in its ``crash_at_call``-th step, the second is the requeue."""
    restore_loss = crash_lm_loss_at(crash_at_call)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_rank(tiny_lm(*CKPT, *setting), run_dir, dist_env.detect())
    restore_loss()
    return run_rank(tiny_lm(*CKPT, *setting), run_dir, dist_env.detect())


def test_requeue_with_an_explicit_resume_path_continues_instead_of_going_back(
    tiny_lm, tmp_path, reference, crash_lm_loss_at, capsys
):
    ref_dir, ref = reference
    step4 = ref_dir / "checkpoints" / "step_00000004"
    # Begins at step 4, saves step 8, dies in step 10; the requeue goes on from 8, not back to 4.
    resumed = crash_then_requeue(tiny_lm, tmp_path, crash_lm_loss_at, 6, f"checkpoint.resume={step4}")
    assert_continues(resumed, ref, 9)
    assert "holds this run's own checkpoints (it began from checkpoint" in capsys.readouterr().out
    assert not list((tmp_path / "checkpoints").glob("*.superseded-*")), "nothing of its own run was set aside"
    line = json.loads((tmp_path / "checkpoints" / "step_00000012" / "shardlab.json").read_text())["line"]
    assert line["start"] == "checkpoint" and line["from"] == str(step4.resolve())


def test_requeue_with_a_resume_symlink_moved_on_since_continues_its_own_run(
    tiny_lm, tmp_path, reference, crash_lm_loss_at
):
    """resume=latest, a link the pretraining job moves on after this run began: the requeue is the same setting, so
    it continues this run from its own newest checkpoint rather than begin again from where the link points now."""
    ref_dir, ref = reference
    latest = tmp_path / "latest"
    latest.symlink_to(ref_dir / "checkpoints" / "step_00000004")
    restore_loss = crash_lm_loss_at(6)  # begins at 4, saves 8, dies in step 10
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_rank(tiny_lm(*CKPT, f"checkpoint.resume={latest}"), tmp_path / "run", dist_env.detect())
    restore_loss()
    latest.unlink()
    latest.symlink_to(ref_dir / "checkpoints" / "step_00000012")  # the link moves on
    resumed = run_rank(tiny_lm(*CKPT, f"checkpoint.resume={latest}"), tmp_path / "run", dist_env.detect())
    assert_continues(resumed, ref, 9)
    assert not list((tmp_path / "run" / "checkpoints").glob("*.superseded-*")), "nothing of its own run set aside"


def test_a_continuing_run_never_falls_back_to_an_older_runs_checkpoint_left_in_its_folder(tiny_lm, tmp_path, reference):
    """The folder keeps step 4 of the run before (keep_last); this run began from the reference's step 8 and saved
    step 12. Its step 12 torn, the requeue has nothing of its own to continue: it stops, naming it, rather than
    continue from the other run's step 4."""
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir / "checkpoints" / "step_00000004", run_dir / "checkpoints" / "step_00000004")
    begin = f"checkpoint.resume={ref_dir / 'checkpoints' / 'step_00000008'}"
    run_rank(tiny_lm(*CKPT, begin), run_dir, dist_env.detect())
    own = run_dir / "checkpoints" / "step_00000012"
    for shard in own.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"checkpoint {own} could not be loaded"):
        run_rank(tiny_lm(*CKPT, begin), run_dir, dist_env.detect())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000012"]


def test_requeue_with_resume_none_continues_its_own_run(tiny_lm, tmp_path, reference, crash_lm_loss_at):
    _, ref = reference
    resumed = crash_then_requeue(tiny_lm, tmp_path, crash_lm_loss_at, 7, "checkpoint.resume=none")
    assert_continues(resumed, ref, 5)


def test_requeue_with_init_from_continues_its_own_checkpoints(tiny_lm, tmp_path, reference, crash_lm_loss_at):
    ref_dir, _ = reference
    weights = consolidate.consolidate(ref_dir / "checkpoints" / "step_00000012", tmp_path / "w.safetensors")
    init = f"checkpoint.init_from={weights}"
    uninterrupted = run_rank(tiny_lm(*CKPT, init), tmp_path / "uninterrupted", dist_env.detect())
    resumed = crash_then_requeue(tiny_lm, tmp_path / "run", crash_lm_loss_at, 7, init)
    assert_continues(resumed, uninterrupted, 5)


def test_resume_none_refuses_a_folder_holding_a_run_that_began_elsewhere(tiny_lm, tmp_path, reference):
    ref_dir, _ = reference
    step8 = ref_dir / "checkpoints" / "step_00000008"
    run_rank(tiny_lm(*CKPT, f"checkpoint.resume={step8}"), tmp_path, dist_env.detect())
    with pytest.raises(ConfigError, match=r"checkpoint.resume=none but .* holds step_00000012 of a run that began "
                                          r"from checkpoint .*step_00000008, not from scratch") as e:  # fmt: skip
        run_rank(tiny_lm(*CKPT, "checkpoint.resume=none"), tmp_path, dist_env.detect())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("optimizer.lr=2e-3", "optimizer.lr"),
        ("seed=2", "seed"),
        ("data.max_corpus_mb=2", "data.max_corpus_mb"),
        ("lr_scheduler.name=constant", "lr_scheduler.name"),
    ],
)
def test_continuing_another_experiments_folder_is_refused_naming_the_key(tiny_lm, tmp_path, reference, override, key):
    ref_dir, _ = reference
    shutil.copytree(ref_dir / "checkpoints" / "step_00000012", tmp_path / "checkpoints" / "step_00000012")
    with pytest.raises(CheckpointError, match=f"belongs to a run with {key}=.* but this run has {key}=") as e:
        run_rank(tiny_lm(*CKPT, override), tmp_path, dist_env.detect())
    assert "\n" not in str(e.value)
    assert (tmp_path / "checkpoints" / "step_00000012").is_dir()  # refused, not set aside


def test_an_explicit_path_may_begin_a_new_experiment_from_another_runs_checkpoint(tiny_lm, tmp_path, reference):
    """Only continuing a run holds every key to the checkpoint's; beginning from it checks the model's shape."""
    ref_dir, _ = reference
    step8 = ref_dir / "checkpoints" / "step_00000008"
    begun = run_rank(tiny_lm(*CKPT, "optimizer.lr=2e-3", f"checkpoint.resume={step8}"), tmp_path, dist_env.detect())
    assert sorted(train_losses(begun)) == [9, 10, 11, 12]


def test_a_torchrun_worker_in_a_slurm_job_warns_when_its_agent_would_die_of_the_time_limit_warning(monkeypatch):
    """torchrun tells its workers which signals its agent handles; without USR1/USR2 the agent dies of Slurm's
    warning and srun ends the ranks with it, before they save."""
    from shardlab.jobs.preemption import torchrun_agent_warning

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")  # torchrun's default
    warning = torchrun_agent_warning()
    assert warning is not None and "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in warning
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2")
    assert torchrun_agent_warning() is None
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")
    assert torchrun_agent_warning() is None  # outside Slurm nobody sends the warning


def test_rank0_requeues_the_slurm_job_on_a_time_limit_warning_another_rank_got(monkeypatch, tmp_path):
    """``kill -USR2`` of one rank's process: the ranks agree to stop (trainer: the largest signal number over ranks),
    and global rank 0, which got nothing itself, still requeues the job it speaks for."""
    import os
    import signal

    from shardlab.jobs.preemption import StopSignals

    calls = tmp_path / "scontrol.calls"
    (tmp_path / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    signals = StopSignals()
    signals.install()
    signals.agree(int(signal.SIGUSR2))  # this rank received none
    assert signals.received is None and signals.name == "SIGUSR2 (on another rank)"
    signals.forward(speaks_for_job=True)
    assert calls.read_text().split() == ["requeue", "4242"]
