"""shardlab-preprocess --slurm: the corpus's shards tokenized by one Slurm job of several tasks, submitted through
submitit on the test cluster's partition `debug`, give the tokens one process writes, token for token."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardlab_tasks.lm.corpus.cache import prepare_corpus
from tests.unit.test_lm_shards import stream, write_corpus

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]


def test_a_submitit_job_of_two_tasks_writes_one_process_tokens(slurm_env, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_files=12)
    one = prepare_corpus(str(corpus), str(tmp_path / "one"), "byte", 5.0, 0, num_workers=0)
    cache = tmp_path / "job"
    command = [sys.executable, "-m", "shardlab_commands.preprocess_lm", str(corpus), "--cache-dir", str(cache),
               "--shards", "4", "--workers", "0", "--slurm", "--partition", "debug", "--nodes", "1",
               "--tasks-per-node", "2",
               "--cpus-per-task", "1", "--timeout-min", "10"]  # fmt: skip
    # the tasks unpickle the tool's main on the node: they import shardlab's three packages from this checkout
    done = subprocess.run(command, cwd=ROOT, env={**slurm_env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert re.search(r"submitted job \d+: 2 tasks over 4 shards", done.stdout), done.stdout
    (out,) = cache.glob("corpus-*")
    assert out.name == one.name and (out / "meta.json").is_file()
    meta = json.loads((out / "meta.json").read_text())
    assert len(meta["shards"]) == 4 and not list((out / "shards").glob(".tmp-*"))
    # both tasks of the one job tokenized: each its own shards (submitit's log of task t: <job>_<t>_log.out)
    logs = [next(cache.glob(f"preprocess-jobs/*/*_{t}_log.out")).read_text() for t in (0, 1)]
    written = [set(re.findall(r"^shard (\d+) of 4:", log, re.M)) for log in logs]
    assert all(f"global_rank={t}(2)" in log for t, log in enumerate(logs)), logs
    assert written[0] and written[1] and not written[0] & written[1], logs
    assert written[0] | written[1] == {"0", "1", "2", "3"}, logs
    meta_one = json.loads((one / "meta.json").read_text())
    for split in ("train", "valid"):
        np.testing.assert_array_equal(stream(out, split), np.fromfile(one / f"{split}.bin", dtype=meta_one["dtype"]))
