"""shardlab-plot and sweep_summary --plot: learning curves of several runs in one PNG, read from their train.log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardlab.config import LoggingConfig
from shardlab.errors import DataError, ShardlabError
from shardlab.jobs import run_record
from shardlab.logging import RunLogger

pytest.importorskip("matplotlib")

from shardlab_commands import plot, sweep_summary  # noqa: E402

POINTS = [("1e-3", 64), ("3e-3", 64), ("1e-3", 128), ("3e-3", 128)]


def loss_at(step: int, lr: str, dim: int) -> float:
    return 6.0 / (1 + step * float(lr) * dim / 10)


def write_point(sweep: Path, num: int, lr: str, dim: int, resumed: bool = False) -> Path:
    """A sweep point as a run leaves it: .hydra/{overrides,config}.yaml, status.json, and train.log written by the
    trainer's own RunLogger (so the test reads the format the trainer writes). ``resumed``: the run died after step
    80, resumed from its step-40 checkpoint and has logged 50 and 60 again since (other losses: other batches)."""
    run_dir = sweep / f"{num}_optimizer.lr={lr},model.dim={dim}"
    overrides = [f"optimizer.lr={lr}", f"model.dim={dim}", "data.seq_len=64", "optimization.max_steps=100"]
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    config = {"optimization": {"batch_size": 16, "update_freq": 2}, "data": {"seq_len": 64}}
    (run_dir / ".hydra" / "config.yaml").write_text(json.dumps(config))  # YAML reads JSON
    run_record.start(run_dir, overrides, max_steps=100)
    cfg = LoggingConfig(progress_bar=False, tensorboard=False)
    attempts = [range(10, 90, 10), range(50, 70, 10)] if resumed else [range(10, 110, 10)]
    for n, steps in enumerate(attempts):
        log = RunLogger(cfg, run_dir, is_main=True, total_steps=100, start_step=steps[0] - 10)
        for step in steps:
            lost = n < len(attempts) - 1 and step > 40  # trained after the last checkpoint, then lost: other losses
            log.log("train", step, {"loss": loss_at(step, lr, dim) + (0.5 if lost else 0), "lr": 1e-3})
            if step % 20 == 0:
                log.log("valid", step, {"loss": loss_at(step, lr, dim) + 0.1, "ppl": 3.0})
        log.close()
    return run_dir


@pytest.fixture
def sweep(tmp_path):
    folder = tmp_path / "multirun" / "lm" / "optimizer.lr=1e-3,3e-3"
    for num, (lr, dim) in enumerate(POINTS):
        write_point(folder, num, lr, dim, resumed=num == 2)
    return folder


def test_a_four_point_sweep_is_one_png_with_four_curves_labelled_by_their_differing_overrides(sweep, tmp_path):
    out = tmp_path / "curves.png"
    fig = plot.plot_runs([sweep], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = [f"optimizer.lr={lr} model.dim={dim}" for lr, dim in POINTS]
    train_step, train_tokens, valid_step, valid_tokens = fig.axes
    assert [t.get_text() for t in train_step.get_legend().get_texts()] == labels
    assert fig._suptitle.get_text() == "common: data.seq_len=64"  # max_steps names no run: how long, not what
    for ax in fig.axes:
        assert [line.get_label() for line in ax.get_lines()] == labels
    for num, (line, (lr, dim)) in enumerate(zip(train_step.get_lines(), POINTS, strict=True)):
        # The resumed point (2): steps 50 and 60 as logged after the resume, and not the lost attempt's 70 and 80.
        steps = list(range(10, 70 if num == 2 else 110, 10))
        assert list(line.get_xdata()) == steps
        assert list(line.get_ydata()) == pytest.approx([loss_at(s, lr, dim) for s in steps], rel=1e-3)
    tokens_per_step = 16 * 2 * 64
    assert list(train_tokens.get_lines()[0].get_xdata()) == [s * tokens_per_step for s in range(10, 110, 10)]
    assert list(valid_tokens.get_lines()[3].get_xdata()) == [s * tokens_per_step for s in range(20, 120, 20)]
    assert list(valid_step.get_lines()[1].get_ydata()) == pytest.approx(
        [loss_at(s, "3e-3", 64) + 0.1 for s in range(20, 120, 20)], rel=1e-3
    )
    assert valid_tokens.get_xlabel() == "tokens" and valid_step.get_ylabel() == "validation loss"
    assert train_step.get_yscale() == "log"  # the losses span 5.6 / 1.2 > 3x: a log axis shows the late steps
    assert train_step.get_xscale() == "linear"  # steps 10-100: one decade


def test_sweep_summary_plot_flag_draws_the_same_png_beside_its_table(sweep, tmp_path, capsys):
    out = tmp_path / "summary.png"
    sweep_summary.main([str(sweep), "--plot", str(out)])
    captured = capsys.readouterr()
    assert "optimizer.lr=3e-3 model.dim=128" in captured.out  # the table still prints
    assert f"{out}: learning curves of 4 points" in captured.err and out.stat().st_size > 10_000


def test_runs_named_one_by_one_are_labelled_by_what_differs_and_a_run_without_a_log_is_refused(sweep, tmp_path):
    runs = sorted(p for p in sweep.iterdir() if p.is_dir())
    fig = plot.plot_runs([runs[0], runs[3]], tmp_path / "two.png")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == [
        "optimizer.lr=1e-3 model.dim=64",
        "optimizer.lr=3e-3 model.dim=128",
    ]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty holds no train.log, nor do its sweep points: has the run"):
        plot.plot_runs([tmp_path / "empty"], tmp_path / "none.png")


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_train_log_that_is_no_regular_file_is_refused_in_one_line_not_waited_on(tmp_path, kind):
    import os

    log = tmp_path / "train.log"
    if kind == "fifo":
        os.mkfifo(log)
    else:
        log.symlink_to("/dev/zero")
    with pytest.raises(ShardlabError) as refused:
        plot.read_log(log)
    assert str(log) in str(refused.value) and "\n" not in str(refused.value)
