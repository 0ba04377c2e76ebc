"""The first hour's rough edges (issue #51): a dry run leaves nothing on disk."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_a_dry_run_prints_its_plan_and_leaves_no_folder(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    (tmp_path / "kept").mkdir()  # a folder that was there stays
    args = ["model=gpt_small", "dry_run=true", "distributed=fully_sharded", "distributed.world_size=4"]
    for extra in ([], ["hydra.run.dir=kept/a/b"]):
        done = subprocess.run([sys.executable, "-m", "shardlab.train", *args, *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "planned in" in done.stdout
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["kept"], extra
