"""Fine-tuning (task=sft) trains alike on 1 process and on 2 ranks (ddp, fully_sharded, with accumulation), and a
checkpoint moves between those world sizes continuing the same curve (CPU, gloo); unpacked rows train alike on 2
tensor-parallel ranks.

Rows hold different numbers of answer tokens, so a rank's or a micro-batch's mean is not the step's: these runs agree
only because every micro-batch is weighted by its share of the step's answer tokens (Task.loss_count)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned
from tests.unit.test_sft import SFT_TINY

RTOL = 1e-5
FSDP = "distributed.backend=fully_sharded"
UNPACKED = ["data.pack=false", "model.max_seq_len=256", "data.seq_len=256"]
"""A sample a row, each micro-batch cut after its longest sample (demo samples of any length up to 256): on 2
tensor-parallel ranks, a multiple of 2 long (LanguageModelingTask.collate), or sequence parallelism's collectives
disagree."""
STEPS = ["optimization.max_steps=6", "optimization.batch_size=8", "checkpoint.interval_steps=3"]


def sft(*overrides: str):
    return compose_config([*SFT_TINY, *STEPS, *overrides])


def full_params(trainer) -> dict:
    """The whole model on rank 0, gathered from its shards."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"params": get_model_state_dict(trainer.model, options=options)}


def train_losses(result: dict, metric: str = "loss") -> dict[int, float]:
    return {r["step"]: r[metric] for r in result["history"] if r["split"] == "train"}


def step3(run_dir) -> str:
    return str(run_dir / "checkpoints" / "step_00000003")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single_dir, fsdp_dir = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("fsdp")
    reference = run_rank(sft(), single_dir, dist_env.detect(), after_fit=full_params)
    unpacked = run_rank(sft(*UNPACKED), tmp_path_factory.mktemp("unpacked"), dist_env.detect(), after_fit=full_params)
    ddp, fsdp, fsdp_accum, fsdp_from_single, tp_unpacked = run_spawned(
        [
            sft("distributed.backend=ddp"),
            sft(FSDP),
            sft(FSDP, "optimization.batch_size=4", "optimization.update_freq=2"),
            sft(FSDP, f"checkpoint.resume={step3(single_dir)}"),
            sft(FSDP, "distributed.tensor_parallel_degree=2", *UNPACKED),
        ],
        world_size=2,
        run_dirs=[
            tmp_path_factory.mktemp("ddp"),
            fsdp_dir,
            *(tmp_path_factory.mktemp(n) for n in ("accum", "resumed", "tp_unpacked")),
        ],
        inspect=full_params,
    )
    single_from_fsdp = run_rank(
        sft(f"checkpoint.resume={step3(fsdp_dir)}"), tmp_path_factory.mktemp("from_fsdp"), dist_env.detect(),
        after_fit=full_params,
    )  # fmt: skip
    return {
        "reference": reference,
        "ddp": ddp,
        "fsdp": fsdp,
        "fsdp_accum": fsdp_accum,
        "fsdp_from_single": fsdp_from_single,
        "single_from_fsdp": single_from_fsdp,
        "unpacked": unpacked,
        "tp_unpacked": tp_unpacked,
    }


@pytest.mark.parametrize(
    ("name", "against"),
    [("ddp", "reference"), ("fsdp", "reference"), ("fsdp_accum", "reference"), ("fsdp_from_single", "reference"),
     ("single_from_fsdp", "reference"), ("tp_unpacked", "unpacked")],
)  # fmt: skip
def test_two_ranks_and_resumes_across_world_sizes_follow_the_single_process_curve(name, against, runs):
    first = 4 if "from" in name else 1  # a resumed run starts after its checkpoint's step
    # gnorm: the global gradient norm before clipping, so a gradient scaled wrong shows here even where Adam and
    # clipping would hide it from the losses.
    for metric in ("loss", "gnorm"):
        got, expected = train_losses(runs[name], metric), train_losses(runs[against], metric)
        assert sorted(got) == list(range(first, 7))
        torch.testing.assert_close(
            torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
            torch.tensor([expected[s] for s in sorted(got)], dtype=torch.float64),
            rtol=RTOL,
            atol=0,
            msg=lambda m, k=metric: f"{k}: {m}",
        )
    reference = runs[against]["params"]
    assert runs[name]["params"].keys() == reference.keys()
    for key, value in reference.items():
        # atol 1e-5 besides rtol: gradients that are rounding noise (the key bias cannot change attention) get
        # Adam steps of any size up to the learning rate's (tests/distributed/test_lm_parity.py).
        torch.testing.assert_close(
            runs[name]["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )
