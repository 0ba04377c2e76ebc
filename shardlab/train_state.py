"""Everything a resume restores besides the weights and the optimizer state, in one object.

Like torchtitan's Stateful trainer: ``state_dict()`` returns the counters and the state of the objects attached in
``components`` (the LR schedule, the loss scaler); ``load_state_dict()`` reads the same keys back. The checkpoint
manager writes that dict into ``shardlab.json`` (JSON, never a pickle) and hands it back on resume without knowing its
fields. A counter missing from an older checkpoint gets its default, so adding one never breaks a resume.

Randomness needs no state here: dropout and augmentation are seeded from (seed, global sample offset), so
``samples_seen`` is all a resumed run needs to draw the same numbers (shardlab.data).

A new resumable counter is one field below and, if it advances per step, one line in ``end_step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from shardlab.errors import CheckpointError


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken."""
    samples_seen: int = 0
    """Global training samples consumed: the data position, independent of the world size."""
    skipped_steps: int = 0
    """Optimizer steps skipped for non-finite gradients (fp16 overflow, or a diverged run)."""
    components: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Objects with state_dict()/load_state_dict() saved beside the counters, by key: ``scheduler`` (the LR
    schedule) and ``grad_scaler`` (fp16's loss scaler, None without one)."""
    tensors: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Objects with state_dict()/load_state_dict() whose state is tensors, by key: ``task`` (Task.training_state's,
    e.g. SwAV's feature queue). The checkpoint manager saves them through DCP beside the model, not in shardlab.json,
    so a DTensor sharded over the ranks reshards to another world size."""

    def end_step(self, samples: int, skipped: bool) -> None:
        """One optimizer step is done: ``samples`` global samples were consumed, ``skipped`` if its update was not
        applied (non-finite gradients)."""
        self.step += 1
        self.samples_seen += samples
        self.skipped_steps += int(skipped)

    def counters(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in self._counter_fields()}

    def _counter_fields(self):
        return [f for f in fields(self) if f.name not in ("components", "tensors")]

    def state_dict(self) -> dict[str, Any]:
        """The counters and every component's state, JSON-serializable (None for an absent component)."""
        return {
            **self.counters(),
            **{key: obj.state_dict() if obj is not None else None for key, obj in self.components.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``'s keys; a counter an older checkpoint lacks takes its default. A component's
        state holding a number that is not finite (JSON's ``Infinity`` in ``scheduler.base_lrs`` resumed at ``lr inf``)
        is refused before anything is restored."""
        for key in self.components:
            if (found := nonfinite(state.get(key), key)) is not None:
                raise CheckpointError(
                    f"the checkpoint's training state holds {found[0]} = {found[1]!r}, not a finite number; a run "
                    "resumes only from finite state: resume from another checkpoint"
                )
        for f in self._counter_fields():
            setattr(self, f.name, int(state.get(f.name, f.default)))
        for key, obj in self.components.items():
            if obj is not None and state.get(key) is not None:
                obj.load_state_dict(state[key])


def nonfinite(value: Any, key: str) -> tuple[str, float] | None:
    """The dotted key and value of the first float in ``value`` (nested dicts and lists) that is NaN or infinite."""
    todo = [(value, key)]
    while todo:
        item, where = todo.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return where, item
        if isinstance(item, dict):
            todo.extend((v, f"{where}.{k}") for k, v in reversed(item.items()))
        elif isinstance(item, (list, tuple)):
            todo.extend((v, f"{where}.{i}") for i, v in reversed(list(enumerate(item))))
    return None
