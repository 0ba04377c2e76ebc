"""FSDP 2 x tensor parallelism 2 across the test cluster's two hosts (partition `multi`): each tensor-parallel group
inside one host, the data axis across the two, in both layouts a Slurm job runs (one task per rank, and one task per
host starting its ranks); the losses equal one process's."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.conftest import TINY_LM
from tests.events import scalars
from tests.slurm.test_multinode import ON_TWO_HOSTS
from tests.slurm.test_slurm import RUN, assert_losses_equal, finish, manifest, submit, train_losses

pytestmark = pytest.mark.slurm
STEPS = 10
LLAMA = ["model=llama_tiny", "model.num_kv_heads=2", "model.ffn_dim=null"]
"""A Llama (tensor-parallel plan: heads, KV heads, FFN width and vocabulary split in two) at TINY_LM's sizes."""
LAYOUTS = {
    "one_task_per_rank": ["hydra.launcher.tasks_per_node=2"],
    "one_task_per_host_starting_two_ranks": ["distributed.world_size=4"],
}


@pytest.fixture(scope="module")
def one_process(tiny_lm, tmp_path_factory) -> dict:
    cfg = tiny_lm(*RUN[len(TINY_LM) :], *LLAMA, f"optimization.max_steps={STEPS}", "distributed.backend=single")
    return run_rank(cfg, tmp_path_factory.mktemp("one_process"), dist_env.detect())


def run_tp_on_two_hosts(env, tmp_path, corpus_cache, *overrides) -> tuple[str, Path, str]:
    """FSDP 2 x TP 2 (4 ranks) of the Llama on the two hosts: the sweep's output, the run folder and the job's log."""
    tp = [*ON_TWO_HOSTS, *LLAMA, f"optimization.max_steps={STEPS}", "distributed.tensor_parallel_degree=2"]
    out = finish(submit(env, tmp_path, corpus_cache, *tp, *overrides))
    (job,) = manifest(tmp_path)
    log = Path(job["log"]).read_text()
    assert f"completed at step {STEPS}" in out, out[-3000:] + log[-3000:]
    assert "world size 4 (slurm)" in log and "network: 2 hosts" in log, log[-3000:]
    return out, Path(job["run_dir"]), log


@pytest.mark.parametrize(
    "layout",
    # one task per host starting its 2 ranks: with -m slow (the suite's 15 minutes); tests/slurm/test_multinode.py
    # runs that layout by default for plain and hybrid sharding
    [pytest.param(name, marks=[pytest.mark.slow] if name != "one_task_per_rank" else []) for name in LAYOUTS],
)
def test_fsdp_2_x_tensor_parallel_2_on_two_hosts_keeps_tp_in_each_host_and_matches_one_process(
    multi_node_env, corpus_cache, tmp_path, one_process, layout
):
    _, run_dir, log = run_tp_on_two_hosts(multi_node_env, tmp_path, corpus_cache, *LAYOUTS[layout])
    assert "tensor parallel: dp_shard 2 x tp 2" in log, log[-3000:]
    # Ranks 0-1 joined from shl-n1 and 2-3 from shl-n2: no tensor-parallel group spans the two.
    assert "tensor-parallel groups span hosts" not in log, log[-3000:]
    got = scalars(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert_losses_equal([v for _, v in got], train_losses(one_process))


def test_a_cyclic_task_distribution_splits_tp_groups_across_hosts_and_says_so_in_one_line(
    multi_node_env, corpus_cache, tmp_path, one_process
):
    """srun dealing the tasks round the hosts (task 0 on shl-n1, 1 on shl-n2, ...; sbatch --distribution=cyclic):
    every tensor-parallel group spans the two hosts. Warned, not refused: the losses are still one process's."""
    _, run_dir, log = run_tp_on_two_hosts(
        multi_node_env, tmp_path, corpus_cache, *LAYOUTS["one_task_per_rank"],
        "+hydra.launcher.additional_parameters.distribution=cyclic",
    )  # fmt: skip
    warning = (
        "warning: 2 of 2 tensor-parallel groups span hosts (ranks 0-1 on shl-n1, shl-n2), so every layer's "
        "collectives cross the network: start each host's ranks consecutively"
    )
    assert warning in log, log[-3000:]
    got = scalars(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert_losses_equal([v for _, v in got], train_losses(one_process))
