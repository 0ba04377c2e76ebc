"""The training state is one object: a new resumable counter is one edit in shardlab/train_state.py.

docs/design.md shows that edit as a diff. These tests apply that very diff to today's train_state.py, train with the
result through the real trainer and checkpoint manager (nothing else changed), and resume: the counter is saved into
shardlab.json and comes back. An older checkpoint, which lacks the counter, gives it its default.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import shardlab.trainer
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab.train_state import TrainState

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
OLD_CHECKPOINT_META = REPO / "tests" / "data" / "checkpoint_0b6f597" / "step_00000002" / "shardlab.json"


def documented_diff() -> str:
    """The ```diff block of docs/design.md's "Adding a resumable counter"."""
    text = DESIGN.read_text()
    section = text[text.index("## Adding a resumable counter") :]
    match = re.search(r"```diff\n(.*?)```", section, re.S)
    assert match, "docs/design.md: no ```diff block under 'Adding a resumable counter'"
    return match.group(1)


def apply_diff(source: str, diff: str) -> str:
    """Apply a unified diff's hunks to ``source``: each hunk's context and removed lines must occur exactly once."""
    for hunk in re.split(r"^@@[^\n]*\n", diff, flags=re.M)[1:]:
        lines = hunk.rstrip("\n").split("\n")
        old = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "-") or line == "")
        new = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "+") or line == "")
        assert source.count(old) == 1, f"hunk does not apply to today's train_state.py:\n{old}"
        source = source.replace(old, new)
    return source


def train_state_with_the_documented_counter() -> tuple[type[TrainState], str]:
    """TrainState as it is after applying docs/design.md's diff, imported as a module of its own; and the new field."""
    diff = documented_diff()
    files = re.findall(r"^\+\+\+ b/(\S+)", diff, re.M)
    assert files == ["shardlab/train_state.py"], f"the documented edit must touch one file, touches {files}"
    source = apply_diff((REPO / "shardlab" / "train_state.py").read_text(), diff)
    spec = importlib.util.spec_from_loader("train_state_with_counter", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    try:
        exec(compile(source, "train_state_with_counter.py", "exec"), module.__dict__)
    finally:
        del sys.modules[spec.name]
    (added,) = set(module.TrainState().counters()) - set(TrainState().counters())
    return module.TrainState, added


def test_the_documented_diff_is_as_large_as_the_docs_say():
    diff = documented_diff()
    added = sum(1 for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff.splitlines() if line.startswith("-") and not line.startswith("---"))
    assert removed == 0
    assert f"{added} lines added" in DESIGN.read_text()


def test_a_new_counter_is_saved_and_restored_by_a_real_resume(tiny_lm, tmp_path, monkeypatch):
    extended, counter = train_state_with_the_documented_counter()
    monkeypatch.setattr(shardlab.trainer, "TrainState", extended)  # what editing train_state.py does to the trainer
    cfg = tiny_lm("optimization.max_steps=4", "checkpoint.interval_steps=2", "validation.interval_steps=0")
    state_at_end = lambda trainer: {"state": trainer.state.counters()}  # noqa: E731

    uninterrupted = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=state_at_end)
    assert uninterrupted["state"][counter] == 4
    saved = json.loads((tmp_path / "checkpoints" / "step_00000002" / "shardlab.json").read_text())
    # Every counter as the state had it at step 2: none missing, none shadowed by what the manager writes beside them.
    at_step_2 = {"step": 2, "samples_seen": 2 * cfg.optimization.batch_size, "skipped_steps": 0, counter: 2}
    assert {key: saved.get(key) for key in at_step_2} == at_step_2

    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")  # resume from step 2
    resumed = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=state_at_end)
    steps = [r["step"] for r in resumed["history"] if r["split"] == "train"]
    assert steps == [3, 4]
    assert resumed["state"] == uninterrupted["state"], "the counter restarted instead of continuing from step 2"


def test_a_checkpoint_without_the_counter_gives_it_its_default():
    extended, counter = train_state_with_the_documented_counter()
    meta = json.loads(OLD_CHECKPOINT_META.read_text())  # written before the counter existed
    assert counter not in meta
    state = extended()
    setattr(state, counter, 7)
    state.load_state_dict(meta)
    assert getattr(state, counter) == 0
    assert (state.step, state.samples_seen) == (meta["step"], meta["samples_seen"])
