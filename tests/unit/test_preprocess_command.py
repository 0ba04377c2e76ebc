"""shardlab-preprocess's "train with:" line is a command that runs, as printed, and trains on the cache it made
(not on a new one keyed by a tokenizer written as None)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [  # the model and the run only: data.* keys would key another cache
    "model.num_layers=1", "model.dim=32", "model.num_heads=2", "model.max_seq_len=32", "data.seq_len=32",
    "optimization.batch_size=4", "optimization.max_steps=2", "validation.batch_size=4", "validation.num_batches=1",
    "logging.progress_bar=false", "logging.tensorboard=false",
]  # fmt: skip


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kwargs)


def test_the_printed_train_with_command_runs_and_reuses_the_cache(tmp_path):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"d{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + len('hello world')\n" * 60)
    done = run([sys.executable, "-m", "shardlab_commands.preprocess_lm", str(corpus), "--cache-dir", str(cache)])
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("train with: ")]
    command = shlex.split(line.removeprefix("train with: "))
    assert command[:3] == ["python", "-m", "shardlab.train"] and "None" not in line, line
    assert f"data.path={corpus}" in command and f"data.cache_dir={cache}" in command
    caches = sorted(cache.iterdir())

    trained = run([sys.executable, *command[1:], *TINY, f"hydra.run.dir={tmp_path / 'run'}"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "final validation:" in trained.stdout and "Traceback" not in trained.stderr
    assert sorted(cache.iterdir()) == caches  # trained on the cache the tool wrote, not a new one
