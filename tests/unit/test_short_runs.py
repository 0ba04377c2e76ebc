"""Short runs just work: ``optimization.max_steps=20`` passes every task's pre-flight, whatever its default warm-up,
by one rule (shardlab.optim.schedules.warmup_steps: the warm-up is clipped to the run, and the run says so)."""

from __future__ import annotations

import pytest
import torch

from shardlab.cli import checks
from shardlab.config import LRSchedulerConfig
from shardlab.optim.schedules import build_schedule, clipped_warmup_line, warmup_steps
from tests.conftest import compose_config

TASKS = ("lm", "sft", "image_classification", "swav", "simclr", "dino")


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("max_steps", [20, 1])
def test_a_short_run_of_every_task_passes_the_pre_flight(task, max_steps):
    cfg = compose_config([f"task={task}", f"optimization.max_steps={max_steps}"])
    checks.check(cfg, 1)  # raises ConfigError on any problem
    clipped = cfg.lr_scheduler.warmup_steps > max_steps
    assert (clipped_warmup_line(cfg.lr_scheduler, max_steps) is not None) == clipped


def test_every_task_default_warm_up_is_longer_than_a_20_step_try():
    """What the rule is for: were a default to fit, the test above would not show the clipping."""
    for task in TASKS:
        if task != "sft":  # SFT warms up over 10 steps
            assert compose_config([f"task={task}"]).lr_scheduler.warmup_steps > 20, task


@pytest.mark.parametrize("name", ["cosine", "constant", "inverse_sqrt"])
def test_a_warm_up_longer_than_the_run_is_clipped_to_it_and_said_so(name):
    cfg = LRSchedulerConfig(name=name, warmup_steps=30)
    assert warmup_steps(cfg, 20) == 20 and warmup_steps(cfg, 300) == 30
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = build_schedule(optimizer, cfg, 20)
    rates = []
    for _ in range(20):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx([(s + 1) / 21 for s in range(20)])  # linear over the whole run, toward the peak
    assert clipped_warmup_line(cfg, 20) == (
        "[lr] lr_scheduler.warmup_steps=30 is longer than the run (optimization.max_steps=20): warming up over all 20 "
        "steps (set lr_scheduler.warmup_steps=N below 20 for a decay)"
    )
    assert clipped_warmup_line(cfg, 30) is None
