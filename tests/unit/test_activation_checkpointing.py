"""Selective activation checkpointing (distributed.activation_checkpointing=selective_layer / selective_op, with
torchtitan's choice: ac_matmul_save_every=2 and ac_skip_units=[0,-1]): the same math as none, the units it wraps, what
the plan predicts for it, its config checks, and torch.compile over it.

Against measured memory: tests/distributed/test_memory_plan.py; on ddp and fully_sharded: tests/distributed/
test_lm_parity.py; the CPU table of memory against recompute time: shardlab_bench/activation_checkpointing.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from shardlab.distributed import env as dist_env
from shardlab.distributed.activation_checkpointing import checkpoint_units, checkpointed_units
from shardlab.distributed.units import model_on_meta
from shardlab.errors import ConfigError
from shardlab.memory.estimate import estimate
from shardlab.memory.layout import layout_of
from shardlab.memory.plan import profile_config
from shardlab.runner import build_task, run_rank
from tests.conftest import compose_config

MODES = ["none", "full", "selective_layer", "selective_op"]
LLAMA = ["model=llama_tiny", "model.num_kv_heads=2"]
# torchtitan's selective op checkpointing: every other matmul output kept, the first and last unit (a Llama's
# embedding and output head) not checkpointed.
TITAN = [
    "distributed.activation_checkpointing=selective_op",
    "distributed.ac_matmul_save_every=2",
    "distributed.ac_skip_units=[0,-1]",
]
SETTINGS = {**{m: [f"distributed.activation_checkpointing={m}"] for m in MODES}, "torchtitan": TITAN}


def train_losses(tiny_lm, tmp_path, *overrides) -> tuple[list[float], dict]:
    cfg = tiny_lm(*overrides, "optimization.max_steps=4", "validation.interval_steps=0", "model.num_layers=4")
    result = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=count_wrappers)
    return [r["loss"] for r in result["history"] if r["split"] == "train"], result


def count_wrappers(trainer) -> dict:
    return {"wrapped": sum(isinstance(m, CheckpointWrapper) for m in trainer.model.modules())}


@pytest.mark.parametrize("model", [[], LLAMA], ids=["gpt", "llama"])
def test_every_mode_trains_exactly_the_losses_of_none(tiny_lm, tmp_path, model):
    """Recomputation must not change the math: the same losses, bit for bit, and the modes wrap the units they say."""
    runs = {name: train_losses(tiny_lm, tmp_path / name, *model, *overrides) for name, overrides in SETTINGS.items()}
    for name in runs:
        assert torch.equal(torch.tensor(runs[name][0]), torch.tensor(runs["none"][0])), name
    assert len(runs["none"][0]) == 4
    # gpt: 4 blocks; llama: 4 blocks plus its embedding and head units (6 in all); torchtitan's leaves 2 out
    num_units = 4 if not model else 6
    expected = {"none": 0, "full": num_units, "selective_layer": num_units // 2, "selective_op": num_units}
    expected["torchtitan"] = num_units - 2
    assert {m: r[1]["wrapped"] for m, r in runs.items()} == expected


def test_selective_layer_wraps_every_kth_unit_counting_from_one():
    assert checkpointed_units(6, "selective_layer", 2) == [1, 3, 5]
    assert checkpointed_units(7, "selective_layer", 3) == [2, 5]
    assert checkpointed_units(3, "full", 2) == [0, 1, 2]
    assert checkpointed_units(3, "none", 2) == []


def test_skipped_units_never_recompute_and_the_modes_count_the_others():
    assert checkpointed_units(6, "full", 2, [0, -1]) == [1, 2, 3, 4]
    # selective_layer counts the blocks only, as torchtitan counts them: the 2nd and 4th of blocks 1-4
    assert checkpointed_units(6, "selective_layer", 2, [0, -1]) == [2, 4]
    assert checkpointed_units(6, "none", 2, [0]) == []
    with pytest.raises(ConfigError, match=r"ac_skip_units=\[0, 6\] names units \[6\], but the task has 6 units"):
        checkpointed_units(6, "full", 2, [0, 6])


def _mlp_units(gelu_after: bool = False) -> tuple[nn.Module, list[nn.Module]]:
    """Two units of Linear(16, 32), GELU, Linear(32, 16) (``gelu_after``: and a GELU, which saves that output)."""
    torch.manual_seed(0)
    tail = [nn.GELU()] if gelu_after else []
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), *tail) for _ in range(2)))
    return model, list(model)


def backward_ops(*overrides: str, gelu_after: bool = False) -> list[tuple[str, tuple]]:
    """The ops (name, output shape) backward runs on ``_mlp_units``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[tuple[str, tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append((func.__name__, tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
            return out

    model, units = _mlp_units(gelu_after)
    checkpoint_units(model, units, compose_config(list(overrides)).distributed)
    loss = model(torch.randn(4, 16)).sum()
    with Count() as count:
        loss.backward()
    return count.ops


def names(ops: list[tuple[str, tuple]]) -> list[str]:
    return [name for name, _ in ops]


def test_selective_op_recomputes_the_cheap_ops_and_reuses_the_matmuls():
    """Backward under selective_op runs every unit's GELU again but no matmul of forward's (only backward's own)."""
    plain, selective, full = (names(backward_ops(*SETTINGS[m])) for m in ("none", "selective_op", "full"))
    assert plain.count("gelu.default") == 0 and selective.count("gelu.default") == 2 == full.count("gelu.default")
    assert selective.count("addmm.default") == 0 < full.count("addmm.default")  # full recomputes the linears


def test_every_other_matmul_recomputes_each_units_second_linear_only():
    """ac_matmul_save_every=2 keeps the 1st matmul of each unit's forward and recomputes the 2nd (32 -> 16), whose
    output the unit's last GELU needs (without that GELU, recomputation stops before it: nothing saved it)."""
    every_other = "distributed.ac_matmul_save_every=2"
    ops = backward_ops(*SETTINGS["selective_op"], every_other, gelu_after=True)
    assert [shape for name, shape in ops if name == "addmm.default"] == [(4, 16), (4, 16)]
    # each unit's first GELU; its last one is never rerun (recomputation stops once its input is saved again)
    assert names(ops).count("gelu.default") == 2
    kept = names(backward_ops(*SETTINGS["selective_op"], gelu_after=True))
    assert kept.count("addmm.default") == 0 and kept.count("gelu.default") == 2
    # with the first unit skipped, only the second recomputes
    skipped = names(
        backward_ops(*SETTINGS["selective_op"], every_other, "distributed.ac_skip_units=[0]", gelu_after=True)
    )
    assert skipped.count("addmm.default") == 1 and skipped.count("gelu.default") == 1


@pytest.mark.parametrize("every", [1, 2])
def test_selective_op_composes_with_compile_and_gives_eager_gradients(every):
    """torch.compile over a selective_op unit (the policy applied in inductor's partitioner; every=2: the counting
    policy, called in trace order) computes what eager does; a cheap stand-in for the LM runs of
    tests/distributed/test_compile.py."""
    grads = {}
    for compiled in (False, True):
        model, units = _mlp_units()
        cfg = compose_config([*SETTINGS["selective_op"], f"distributed.ac_matmul_save_every={every}"]).distributed
        units = checkpoint_units(model, units, cfg)
        if compiled:
            for unit in units:
                unit.compile(backend="aot_eager")  # the partitioner applies the policy; no C++ build needed
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        grads[compiled] = [p.grad.clone() for p in model.parameters()]
    for eager, compiled in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", [["model=gpt_small"], ["model=llama_small"]], ids=["gpt_small", "llama_small"])
@pytest.mark.parametrize("backend", ["single", "ddp", "fully_sharded"])
def test_planned_peak_of_each_selective_mode_lies_between_none_and_full(model, backend):
    world = 1 if backend == "single" else 4
    overrides = [*model, f"distributed.backend={backend}", "optimization.batch_size=16", "data.seq_len=512"]
    cfg = compose_config(overrides)
    task = build_task(cfg, world_size=world)
    profile, ctx = profile_config(cfg, task, world, model_on_meta(task))

    def peak(mode: str) -> int:
        cfg.distributed.activation_checkpointing = mode
        return estimate(profile, layout_of(cfg.distributed, world), ctx).peak

    none, full, kept_matmuls = peak("none"), peak("full"), peak("selective_op")
    assert full < peak("selective_layer") < none
    assert full < kept_matmuls < none
    cfg.distributed.ac_matmul_save_every = 2  # half the matmul outputs kept: between keeping all and full
    every_other = peak("selective_op")
    assert full < every_other < kept_matmuls
    cfg.distributed.ac_skip_units = [0, -1]  # torchtitan's: two units keep everything, so a little more
    assert every_other < peak("selective_op") < kept_matmuls
    cfg.distributed.ac_skip_units, cfg.distributed.ac_matmul_save_every = [], 1
    cfg.distributed.ac_save_ops = ["attention"]  # keeping less recomputes more: closer to full
    assert full < peak("selective_op") < kept_matmuls


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["distributed.activation_checkpointing=some"], "activation_checkpointing must be one of none, full, sel"),
        (
            ["distributed.activation_checkpointing=selective_layer", "distributed.ac_every_k_units=1"],
            "ac_every_k_units must be >= 2, got 1; every unit (k=1) is activation_checkpointing=full",
        ),
        (
            ["distributed.activation_checkpointing=selective_op", "distributed.ac_save_ops=[matmul,softmax]"],
            "ac_save_ops must be a non-empty list of matmul, attention, got ['matmul', 'softmax']",
        ),
        (["distributed.ac_every_k_units=4"], "ac_every_k_units applies to activation_checkpointing=selective_layer"),
        (
            ["distributed.activation_checkpointing=full", "distributed.ac_save_ops=[matmul]"],
            "ac_save_ops applies to activation_checkpointing=selective_op only (it is full)",
        ),
        (
            [*SETTINGS["selective_op"], "distributed.ac_matmul_save_every=0"],
            "ac_matmul_save_every must be >= 1 (1 keeps every matmul), got 0",
        ),
        (
            [*SETTINGS["selective_op"], "distributed.ac_save_ops=[attention]", "distributed.ac_matmul_save_every=2"],
            "ac_matmul_save_every=2 thins the kept matmul outputs, but distributed.ac_save_ops=['attention'] keeps",
        ),
        (
            [*SETTINGS["full"], "distributed.ac_matmul_save_every=2"],
            "ac_matmul_save_every applies to activation_checkpointing=selective_op only (it is full)",
        ),
        (["distributed.ac_skip_units=[0]"], "ac_skip_units leaves units out of activation checkpointing, which is off"),
    ],
)
def test_bad_checkpointing_values_are_named_before_launch(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        build_task(compose_config(overrides), world_size=1)
