"""Preprocessing as a Slurm array over the test cluster's two hosts (partition `multi`): the same tokens as one
process, token for token; one array task cancelled mid-shard is redone alone by resubmitting the array."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardlab_tasks.lm.corpus.cache import prepare_corpus
from tests.faults.test_fault_matrix import SITE
from tests.slurm.test_slurm import slurm_state, wait_for
from tests.unit.test_lm_shards import WORDS, stream, write_corpus

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
HOSTS = {"shl-n1", "shl-n2"}


def submit_array(env: dict, tmp_path: Path, corpus: Path, cache: Path, num_tasks: int, num_shards: int) -> str:
    """sbatch --array over partition multi, one exclusive task per element (so the two land on the two hosts)."""
    command = (
        f"{sys.executable} -m shardlab_commands.preprocess_lm {corpus} --cache-dir {cache} --shards {num_shards} "
        "--workers 0"
    )
    done = subprocess.run(
        ["sbatch", "--parsable", "-p", "multi", "--exclusive", f"--array=0-{num_tasks - 1}", f"--chdir={ROOT}",
         f"--output={tmp_path}/array-%A_%a.out", "--wrap", command],
        env={**env, "PYTHONPATH": f"{SITE}:{ROOT}"}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip().split(";")[0]


def wait_array(env: dict, job_id: str, tmp_path: Path) -> None:
    try:
        wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True,
                                            text=True).stdout.strip(), 600, f"array {job_id}")  # fmt: skip
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob(f"array-{job_id}_*.out")))
    assert "Traceback" not in logs, logs[-3000:]


def test_a_two_host_array_writes_one_process_tokens(multi_node_env, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_files=12)
    one = prepare_corpus(str(corpus), str(tmp_path / "one"), "byte", 5.0, 0, num_workers=0)
    job = submit_array(multi_node_env, tmp_path, corpus, tmp_path / "array", num_tasks=2, num_shards=4)
    wait_array(multi_node_env, job, tmp_path)
    (out,) = (tmp_path / "array").glob("corpus-*")
    assert out.name == one.name and (out / "meta.json").is_file()
    hosts = {json.loads(p.read_text())["host"] for p in out.glob("shards/*/record.json")}
    assert hosts == HOSTS, hosts  # both hosts wrote shards
    meta_one = json.loads((one / "meta.json").read_text())
    for split in ("train", "valid"):
        np.testing.assert_array_equal(stream(out, split), np.fromfile(one / f"{split}.bin", dtype=meta_one["dtype"]))


def test_an_array_task_cancelled_mid_shard_is_redone_alone(multi_node_env, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_files=4, seed=3)
    line = json.dumps({"text": " ".join(WORDS * 500)}) + "\n"
    (corpus / "part-03.jsonl").write_text(line * (60 * 2**20 // len(line)))  # shard 1 of 2: long enough to cancel
    cache = tmp_path / "cache"
    job = submit_array(multi_node_env, tmp_path, corpus, cache, num_tasks=2, num_shards=2)
    wait_for(lambda: list(cache.glob("corpus-*/shards/.tmp-00001-*/train.bin")), 300, "task 1 writing shard 1")
    subprocess.run(["scancel", "--signal=KILL", f"{job}_1"], env=multi_node_env, check=True)
    wait_array(multi_node_env, job, tmp_path)
    (out,) = cache.glob("corpus-*")
    assert (out / "shards" / "00000" / "record.json").is_file() and not (out / "shards" / "00001").exists()
    assert not (out / "meta.json").exists()
    kept = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((out / "shards" / "00000").iterdir())]

    job = submit_array(multi_node_env, tmp_path, corpus, cache, num_tasks=2, num_shards=2)  # the same command again
    wait_array(multi_node_env, job, tmp_path)
    assert set(slurm_state(multi_node_env, job).split()) <= {"COMPLETED"}  # each array task's state, a line each
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((out / "shards" / "00000").iterdir())] == kept
    assert (out / "meta.json").is_file() and not list((out / "shards").glob(".tmp-*"))
