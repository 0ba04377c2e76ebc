"""What an MoE model does after each optimizer step (shardlab_tasks/lm/models/moe_balance.py): the step's per-layer
load, summed over its micro-batches and then over the ranks, moves DeepSeek-V3's balancing bias (only after an applied
update) and counts each expert's idle steps, warning once, in one line, when one reaches
model.moe.idle_expert_warning_steps."""

from __future__ import annotations

import re

import torch
from torch import nn

from shardlab_tasks.lm.config import MoEConfig
from shardlab_tasks.lm.models.moe import MoEBlock
from shardlab_tasks.lm.models.moe_balance import StepLoad, moe_blocks

RATE = 0.1


def two_layers(**overrides) -> tuple[nn.Module, MoEConfig]:
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 1, "ffn_dim": 4, "score_bias": True, "bias_update_rate": RATE,
                       **overrides})  # fmt: skip
    return nn.Sequential(MoEBlock(cfg, 4), MoEBlock(cfg, 4)), cfg


class OtherRank:
    """all_reduce_sum as if a second rank had routed ``theirs``: records what it was given."""

    def __init__(self, theirs: torch.Tensor) -> None:
        self.theirs, self.calls = theirs, []

    def __call__(self, mine: torch.Tensor) -> torch.Tensor:
        self.calls.append(mine.clone())
        return mine + self.theirs


def biases(model: nn.Module) -> torch.Tensor:
    return torch.stack([block.router.score_bias for block in moe_blocks(model)])


def test_the_bias_moves_toward_equal_load_from_the_load_summed_over_micro_batches_and_ranks():
    model, cfg = two_layers(idle_expert_warning_steps=0)
    load = StepLoad(cfg)
    for _ in range(2):  # two micro-batches
        load.add([torch.tensor([3, 1, 0, 0]), torch.tensor([1, 1, 1, 1])])
    other = OtherRank(torch.tensor([[0, 0, 0, 8], [1, 1, 1, 1]]))
    assert load.after_update(model, other, applied=True) == []
    torch.testing.assert_close(other.calls[0], torch.tensor([[6, 2, 0, 0], [2, 2, 2, 2]]))
    # layer 0 summed: [6, 2, 0, 8], mean 4: the busy experts' biases fall, the idle one's rises; layer 1 is balanced
    torch.testing.assert_close(biases(model), torch.tensor([[-RATE, RATE, RATE, -RATE], [0.0, 0.0, 0.0, 0.0]]))
    load.add([torch.tensor([4, 0, 0, 0]), torch.tensor([1, 1, 1, 1])])
    load.after_update(model, OtherRank(torch.zeros(2, 4, dtype=torch.int64)), applied=False)  # a skipped update
    torch.testing.assert_close(biases(model), torch.tensor([[-RATE, RATE, RATE, -RATE], [0.0, 0.0, 0.0, 0.0]]))
    assert load.load is None  # each step starts from nothing


def test_an_expert_idle_on_every_rank_for_the_set_steps_is_warned_once_in_one_line():
    model, cfg = two_layers(idle_expert_warning_steps=3)
    load, lines = StepLoad(cfg), []
    nobody = OtherRank(torch.zeros(2, 4, dtype=torch.int64))
    for step in range(
        5
    ):  # layer 1's expert 2 never gets a token; layer 0's expert 3 only at step 1 (on the other rank)
        load.add([torch.tensor([2, 1, 1, 0]), torch.tensor([2, 1, 0, 1])])
        other = OtherRank(torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]])) if step == 1 else nobody
        lines.append(load.after_update(model, other, applied=True))
    assert lines[:2] == [[], []] and lines[3] == [], lines
    (line,) = lines[2]  # layer 1's expert 2, idle from the start; warned once, not again at steps 4 and 5
    assert line.startswith("warning: model.moe: layer 1: 1 expert (2) received no token for 3 steps"), line
    assert "model.moe.idle_expert_warning_steps" in line and "\n" not in line
    (line,) = lines[4]  # layer 0's expert 3: its count restarted after the other rank's token at step 2
    assert line.startswith("warning: model.moe: layer 0: 1 expert (3) received no token for 3 steps"), line


def test_without_bias_balancing_or_warning_nothing_is_kept_or_exchanged():
    model, cfg = two_layers(score_bias=False, bias_update_rate=0.0, idle_expert_warning_steps=0)
    load = StepLoad(cfg)
    load.add([torch.tensor([4, 0, 0, 0]), torch.tensor([1, 1, 1, 1])])
    other = OtherRank(torch.zeros(2, 4, dtype=torch.int64))
    assert load.after_update(model, other, applied=True) == [] and other.calls == []


def test_a_training_run_logs_the_load_to_tensorboard_and_warns_of_idle_experts_in_train_log(tiny_lm, tmp_path):
    """One process, 2 steps of 32 tokens (batch 1) over 128 experts, top-1: at least 64 experts of a layer get
    none in steps 1 and 2 together, so the warning (after 2 idle steps) comes at step 2, one line; TensorBoard has
    each layer's max/mean load, the auxiliary loss and the idle count beside the loss."""
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank
    from tests.events import scalars

    cfg = tiny_lm(
        "model=moe_tiny", "model.num_layers=2", "model.dim=32", "model.num_heads=2", "model.num_kv_heads=2",
        "model.moe.num_experts=128", "model.moe.top_k=1", "model.moe.ffn_dim=4",
        "model.moe.idle_expert_warning_steps=2",
        "optimization.batch_size=1", "optimization.max_steps=2", "validation.batch_size=1", "logging.tensorboard=true",
    )  # fmt: skip
    run_rank(cfg, tmp_path, dist_env.detect())
    lines = (tmp_path / "train.log").read_text().splitlines()
    warnings = [line for line in lines if "warning: model.moe:" in line]
    assert len(warnings) == 1 and "received no token for 2 steps" in warnings[0], warnings
    assert re.search(r"layer 0: \d+ experts \((\d+, ){8}\.\.\.\); layer 1: \d+ experts", warnings[0]), warnings
    train_line = {step: next(i for i, line in enumerate(lines) if f"[train] step {step} " in line) for step in (1, 2)}
    assert train_line[1] < lines.index(warnings[0]) < train_line[2], lines  # after step 2's update, before its line
    for tag in ("train/moe_load/0", "train/moe_load/1", "train/aux_loss", "train/moe_idle_experts"):
        assert [step for step, _ in scalars(tmp_path, tag)] == [1, 2], tag
    # 32 assignments a layer and step: at least 96 of each layer's 128 experts idle, 192 over both layers
    assert all(value >= 192 for _, value in scalars(tmp_path, "train/moe_idle_experts"))


def test_under_activation_checkpointing_every_steps_routing_reaches_the_loss_and_the_step_load():
    """Blocks wrapped for recompute (distributed.activation_checkpointing): the task still gets each forward's
    routing statistics on every step, not only the first (letting go of them on the wrapper would have shadowed the
    block's own from then on, dropping the auxiliary loss and the loads)."""
    from shardlab.distributed.activation_checkpointing import checkpoint_units
    from tests.conftest import compose_config
    from tests.unit.test_moe_model import SMALL_MOE, built

    task, model = built("model.moe.score_bias=true", "model.moe.bias_update_rate=0.1")
    checkpoint_units(
        model, list(model.blocks), compose_config([*SMALL_MOE, "distributed.activation_checkpointing=full"]).distributed
    )
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        loss, sums = task.loss(model, batch, torch.device("cpu"))
        loss.backward()
        assert "moe_aux_sum" in sums, step
        assert task.step_load.load is not None and int(task.step_load.load[0].sum()) == 2 * 16 * 2, step
        assert task.after_update(model, lambda load: load, applied=True) == []
    assert biases(model).abs().sum() > 0
