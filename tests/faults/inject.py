"""Faults fired inside real training processes, on one rank at one step, once per fault directory.

``SHARDLAB_FAULT`` (JSON): {"event": "pause" | "error" | "save_fails", "rank": global rank, "step": train step,
"dir": a folder shared with the test}. Every rank writes its pid to ``dir/pid.rank<r>``, so the test can signal or
kill any of them.

- pause: the rank stops inside the step's forward until a stop signal reaches it or the test writes ``dir/go`` (at
  most 120 s), writing ``dir/paused`` first: the test delivers its event (a signal, a kill, ``scontrol requeue``)
  at a known step.
- error: the rank raises RuntimeError in the step's forward.
- save_fails: the rank's publish of that step's checkpoint raises OSError(ENOSPC), as on a full disk.

A fault fires once (``dir/fired``): a requeued or rerun job goes on undisturbed.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

SPEC = json.loads(os.environ.get("SHARDLAB_FAULT", "{}"))
DIR = Path(SPEC.get("dir", "."))
current = {"trainer": None}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _fire_once() -> bool:
    try:
        os.close(os.open(DIR / "fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _at_fault(step: int) -> bool:
    return _rank() == SPEC["rank"] and step == SPEC["step"] and _fire_once()


def install(trainer_module) -> None:
    Trainer = trainer_module.Trainer
    setup = Trainer.setup

    def setup_and_record(self, plan, *args, **kwargs):
        current["trainer"] = self
        (DIR / f"pid.rank{self.backend.env.rank}").write_text(str(os.getpid()))
        return setup(self, plan, *args, **kwargs)

    Trainer.setup = setup_and_record
    if SPEC["event"] in ("pause", "error"):
        from shardlab_tasks.lm.task import LanguageModelingTask

        loss = LanguageModelingTask.loss

        def loss_with_fault(self, model, batch, device):
            trainer = current["trainer"]
            if model.training and device.type != "meta" and trainer is not None and _at_fault(trainer.state.step + 1):
                if SPEC["event"] == "error":
                    raise RuntimeError(f"injected fault on rank {_rank()} at step {trainer.state.step + 1}")
                (DIR / "paused").write_text(json.dumps({"step": trainer.state.step + 1, "pid": os.getpid()}))
                deadline = time.monotonic() + 120
                while not (trainer.stop_signals.received or (DIR / "go").exists()) and time.monotonic() < deadline:
                    time.sleep(0.05)
            return loss(self, model, batch, device)

        LanguageModelingTask.loss = loss_with_fault
    elif SPEC["event"] == "save_fails":
        from shardlab.checkpoint import manager

        publish = manager.publish

        def publish_or_fail(tmp, final, meta):
            if _at_fault(int(meta["step"])):
                raise OSError(errno.ENOSPC, "No space left on device", str(final))
            return publish(tmp, final, meta)

        manager.publish = publish_or_fail
