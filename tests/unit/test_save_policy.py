"""When a run saves (shardlab/checkpoint/policy.py): steps, milestones, and the clock rank 0 reads."""

from __future__ import annotations

from types import SimpleNamespace

from shardlab.checkpoint import policy
from shardlab.checkpoint.policy import SavePolicy


def make(clock, interval_steps=0, keep_every_steps=0, interval_minutes=0.0, step=0) -> SavePolicy:
    c = SimpleNamespace(
        interval_steps=interval_steps, keep_every_steps=keep_every_steps, interval_minutes=interval_minutes
    )
    return SavePolicy.from_config(c, step)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_steps_and_milestones_are_due_and_nothing_else(monkeypatch):
    monkeypatch.setattr(policy.time, "monotonic", Clock())
    p = make(None, interval_steps=5, keep_every_steps=7)
    assert [s for s in range(1, 22) if p.due(s, overdue=False)] == [5, 7, 10, 14, 15, 20, 21]
    assert p.due(3, overdue=True), "a save the ranks agreed is overdue is due at any step"
    assert not any(make(None).due(s, overdue=False) for s in range(1, 50)), "all zero: never by the policy"


def test_the_clock_is_read_on_rank_zero_only_and_restarts_at_a_save_or_a_failed_one(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(policy.time, "monotonic", clock)
    p = make(clock, interval_minutes=2.0, step=4)
    clock.now += 119
    assert not p.overdue(is_main=True)
    clock.now += 1
    assert p.overdue(is_main=True) and not p.overdue(is_main=False)
    p.failed()
    assert not p.overdue(is_main=True) and p.unsaved(4) is False, "a failed save keeps the step saved last"
    clock.now += 120
    assert p.overdue(is_main=True)
    p.saved(9)
    assert not p.overdue(is_main=True) and p.unsaved(8) and not p.unsaved(9)
    assert not make(clock, step=0).overdue(is_main=True), "interval_minutes=0: never overdue"
