"""The memory plan of layouts with tensor, pipeline and context axes (shardlab.memory.axes, shardlab.memory.pipeline):
the schedules' orders and bubbles, the stage split, and the bytes each axis takes off a rank.

What torchtitan published for its 70B and 405B runs against this plan: tests/unit/test_plan_axes.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardlab.memory.axes import estimate_axes, model_rank_profile, stage_units
from shardlab.memory.console import describe
from shardlab.memory.estimate import PlanContext, estimate
from shardlab.memory.layout import Layout
from shardlab.memory.pipeline import bubble_fraction, max_in_flight, rank_stages, schedule_ops, stage_sizes
from shardlab.memory.profile import ModelProfile

DIM, FFN, VOCAB, LAYERS = 64, 256, 1000, 8
LAYER = [(3 * DIM, DIM), (DIM, DIM), (FFN, DIM), (DIM, FFN), (DIM, 1), (DIM, 1)]  # qkv, out, up, down, 2 norms
INPUT, SAVED = 100_000, 900_000  # bytes of a layer's input, and of all it saves


def profile(layers: int = LAYERS, saved: int = SAVED, inputs: int = INPUT) -> ModelProfile:
    """An LM-shaped profile by hand: embedding, ``layers`` identical layers, head; the final norm in the root."""
    shapes = [[(VOCAB, DIM)], *[list(LAYER) for _ in range(layers)], [(VOCAB, DIM)]]
    root = [(DIM, 1)]
    acts = [0, *[saved] * layers, 400]
    return ModelProfile(
        params=sum(r * w for g in [*shapes, root] for r, w in g),
        unit_params=[sum(r * w for r, w in g) for g in shapes],
        activations=sum(acts) + 800,
        unit_activations=acts,
        unit_inputs=[0, *[inputs] * layers, inputs],
        largest_outside=400,
        local_batch=2,
        unit_shapes=shapes,
        root_shapes=root,
    )


def context(world: int, update_freq: int = 1) -> PlanContext:
    return PlanContext(world, 8, "cpu", param_bytes=2, reduce_bytes=4, optimizer_state_bytes=8,
                       update_freq=update_freq)  # fmt: skip


def test_stages_split_layers_as_shardlab_cuts_them_or_as_torchtitan_does():
    assert stage_sizes(126, 8, "torchtitan") == [15, 16, 16, 16, 16, 16, 16, 15]
    assert stage_sizes(126, 16, "torchtitan") == [7] + [8] * 14 + [7]
    assert stage_sizes(7, 2, "torchtitan") == [3, 4]
    assert stage_sizes(126, 8) == [16] * 6 + [15] * 2  # shardlab's cut: the first stages take the remainder
    units = stage_units(profile(), 4)
    assert units == [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]]  # embedding on the first stage, head on the last
    assert stage_units(profile(7), 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert rank_stages(1, 4, 2) == [1, 5] and rank_stages(1, 4, 2, "zbv_zero_bubble") == [1, 6]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("m", [4, 8])
def test_every_schedule_runs_each_forward_once_and_its_backward_after_it(schedule, v, m):
    for rank in range(4):
        ops = schedule_ops(schedule, 4, rank, m, v)
        done = set()
        for op in ops:
            key = (op.stage, op.microbatch)
            if op.kind == "F":
                assert key not in done
                done.add(key)
            else:
                assert key in done, f"{schedule} rank {rank}: backward of {key} before its forward"
        assert sorted((o.kind, o.stage, o.microbatch) for o in ops) == sorted(
            (k, s, i) for k in "FB" for s in range(v) for i in range(m)
        )


def test_in_flight_micro_batches_gpipe_all_1f1b_the_stages_ahead_interleaved_torchs_warmup():
    assert [max_in_flight(schedule_ops("gpipe", 4, r, 8)) for r in range(4)] == [8] * 4
    assert [max_in_flight(schedule_ops("1f1b", 4, r, 8)) for r in range(4)] == [4, 3, 2, 1]
    # torch's _get_warmup_ops: (v - 1) * pp + 2 (pp - 1 - rank) forwards first, then one forward and one backward
    assert [max_in_flight(schedule_ops("interleaved_1f1b", 4, r, 8, 2)) for r in range(4)] == [11, 9, 7, 5]


def test_bubble_is_the_fill_over_the_step_and_interleaving_divides_the_fill():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(8, 8) == pytest.approx(7 / 15)
    assert bubble_fraction(8, 8, 2) == pytest.approx(7 / 23)
    assert bubble_fraction(4, 32) < bubble_fraction(4, 8)


def test_tensor_parallel_splits_matrices_and_saved_activations_but_not_vectors():
    whole = profile()
    half = model_rank_profile(whole, 2, 1)
    assert half.unit_shapes[1] == [(3 * DIM // 2, DIM), (DIM // 2, DIM), (FFN // 2, DIM), (DIM // 2, FFN),
                                   (DIM, 1), (DIM, 1)]  # fmt: skip
    # every saved tensor halves (sequence parallelism), but the two gathered inputs the column-wise linears save
    # are whole: 2 x (input - input / 2) back
    assert half.unit_activations[1] == SAVED // 2 + 2 * (INPUT - INPUT // 2)
    assert half.unit_inputs[1] == INPUT // 2
    ctx = context(4)
    fsdp = estimate(whole, Layout("fully_sharded", 4), ctx)
    tp = estimate(whole, Layout("fully_sharded", 2, tp=2), ctx)
    assert tp.params < fsdp.params * 1.05 and tp.activations < fsdp.activations  # same ranks, state alike
    assert tp.axes.traffic["tp"] > 0 and tp.axes.traffic["pp"] == 0


def test_pipeline_1f1b_holds_fewer_micro_batches_than_gpipe_and_interleaving_frees_stages_earlier():
    prof, ctx = profile(), context(8, update_freq=8)
    gpipe = estimate_axes(prof, Layout("fully_sharded", 2, pp=4, schedule="gpipe"), ctx)
    one = estimate_axes(prof, Layout("fully_sharded", 2, pp=4, schedule="1f1b"), ctx)
    loop = estimate_axes(prof, Layout("fully_sharded", 2, pp=4, schedule="interleaved_1f1b", stages_per_rank=2), ctx)
    assert gpipe.axes.in_flight == 8 and one.axes.in_flight == 4
    assert one.activations < gpipe.activations
    # Where the gathered units and unsharded gradients outweigh the activations (405B), the interleaved rank's
    # first-finished stage reduce-scatters its gradients and frees its units before the other's backward ends (with
    # one round of micro-batches, m = pp, as there: two rounds interleave both stages' backwards).
    light, one_round = profile(saved=90, inputs=10), context(8, update_freq=4)
    one_light = estimate_axes(light, Layout("fully_sharded", 2, pp=4, schedule="1f1b"), one_round)
    loop_light = estimate_axes(light, loop.layout, one_round)
    assert loop_light.gathered < one_light.gathered and loop_light.peak < one_light.peak
    assert one.axes.bubble == pytest.approx(3 / 11) and loop.axes.bubble == pytest.approx(3 / 19)
    assert one.axes.traffic["pp"] > 0


def test_a_stages_backward_holds_its_gathered_units_fp32_gradients_and_one_units_new_bf16_gradients():
    """Under PP a stage keeps its units gathered (bf16) and their gradients unsharded in fp32 across the micro-batches;
    during each backward the unit being differentiated also has its new gradients in bf16, which FSDP2's
    post-backward adds into the fp32 ones and frees (_fsdp_param.py, accumulate_unsharded_grad_if_needed)."""
    est = estimate_axes(profile(), Layout("fully_sharded", 4, pp=2, schedule="1f1b"), context(8, update_freq=8))
    assert est.axes.rank == 0 and est.axes.stage_layers[0] == ((0, 1, 2, 3, 4),)  # embedding and four layers
    embedding, layer = VOCAB * DIM, sum(r * w for r, w in LAYER)
    stage = embedding + 4 * layer  # every row count divides by the 4 shards: no padding
    assert est.gathered == (2 + 4) * stage + 2 * embedding  # the biggest unit's bf16 gradients on top


def test_under_torchs_rowwise_embedding_the_first_stage_accumulates_the_embeddings_gradient_whole():
    """torch's RowwiseParallel embedding computes its gradient over the whole vocabulary on each TP rank (DTensor's
    strategy: tests/unit/test_torch_internals.py), so where it splits the embedding (torchtitan's runs:
    Layout.embedding_gradient_whole) the first stage's unsharded fp32 gradients hold the whole table where its weights
    hold their half; shardlab's VocabularySplitEmbedding holds the rank's rows only."""
    layout = Layout("fully_sharded", 4, tp=2, pp=2, schedule="1f1b")
    ctx = context(16, update_freq=8)
    torchs, ours = (
        estimate_axes(profile(), dataclasses.replace(layout, embedding_gradient_whole=whole), ctx)
        for whole in (True, False)
    )
    assert torchs.axes.rank == ours.axes.rank == 0 and torchs.axes.stage_layers[0] == ((0, 1, 2, 3, 4),)
    embedding, layer = VOCAB * DIM, sum((r // 2 if r > 1 and w > 1 else r) * w for r, w in LAYER)
    stage = embedding // 2 + 4 * layer  # the TP rank's share: half the embedding's rows, half of each layer's
    biggest_new_grads = 2 * max(embedding // 2, layer)
    assert ours.gathered == (2 + 4) * stage + biggest_new_grads  # bf16 weights, fp32 gradients, as the rank holds them
    assert torchs.gathered == 2 * stage + 4 * (stage + embedding // 2) + biggest_new_grads


def test_a_last_stage_that_keeps_its_outputs_holds_every_micro_batchs_to_the_end_of_the_step_and_their_merge():
    """With step's return_outputs on (torch's default, as torchtitan's published runs had it), the schedule keeps
    the last stage's output of every micro-batch (output_chunks) and concatenates them after the last backward: a
    1F1B last stage holds one micro-batch's activations at a time, but m outputs, then 2 m at the merge. shardlab's
    PipelineRunner turns it off, and its plan (the default layout) keeps none."""
    logits = 5_000_000  # the head's output, far above everything else a stage keeps here
    with_head = dataclasses.replace(profile(), output=logits)
    layout = Layout("fully_sharded", 2, pp=4, schedule="1f1b")
    kept = dataclasses.replace(layout, last_stage_outputs_kept=True)
    for m in (4, 8):
        plain = estimate_axes(profile(), layout, context(8, update_freq=m))
        est = estimate_axes(with_head, kept, context(8, update_freq=m))
        assert plain.axes.rank == 0 and est.axes.rank == 3  # the last stage is now the fullest
        assert 2 * m * logits <= est.activations < 2 * m * logits + plain.activations
        assert estimate_axes(with_head, layout, context(8, update_freq=m)).peak == plain.peak


def test_the_dry_run_lines_name_the_axes_and_compare_other_splits():
    prof, ctx = profile(), context(8, update_freq=8)
    chosen = Layout("fully_sharded", 2, tp=2, pp=2, activation_checkpointing=True)
    lines = describe(prof, chosen, ctx, compare=True)
    assert "FSDP 2 x TP 2 x PP 2 (1f1b)" in lines[0]
    assert any("bubble" in line and "sends per step" in line for line in lines)
    table = "\n".join(lines)
    assert "FSDP 2 x PP 4 (interleaved_1f1b, 2 stages/rank)" in table and "FSDP 2 x TP 4" in table
    # a planned layout keeps its keys: what backend=auto would set to run it
    keys = chosen.overrides(8)
    assert keys["tensor_parallel_degree"] == 2 and keys["pipeline_parallel_degree"] == 2
    assert keys["sharding_degree"] == -1
    assert dataclasses.replace(chosen, sharding_degree=1).overrides(8)["sharding_degree"] == 1


# ---- verify_plan: the real mesh and fully_shard on the fake process group ----------------------------------------
TINY_3D = ["model=llama_tiny", "distributed=fully_sharded", "distributed.world_size=16", "optimization.batch_size=8",
           "validation.batch_size=16", "optimization.update_freq=2", "distributed.tensor_parallel_degree=2",
           "distributed.pipeline_parallel_degree=2", "dry_run=true"]  # fmt: skip


def tiny_task(overrides: list[str], world: int = 16):
    from shardlab.runner import build_task
    from tests.conftest import compose_config

    cfg = compose_config(overrides)
    return cfg, build_task(cfg, world_size=world)


def colwise_rowwise_plan(model, mlp_split: bool = True) -> dict:
    """A Megatron-style plan for shardlab's Llama, as a task would hand it (Task.tensor_parallel_plan)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"embed": RowwiseParallel(), "head.out": ColwiseParallel()}
    for name in ("q", "k", "v"):
        plan[f"blocks.*.attn.{name}"] = ColwiseParallel()
    plan["blocks.*.attn.o"] = RowwiseParallel()
    if mlp_split:
        plan.update({"blocks.*.mlp.gate": ColwiseParallel(), "blocks.*.mlp.up": ColwiseParallel(),
                     "blocks.*.mlp.down": RowwiseParallel()})  # fmt: skip
    return plan


def test_verify_plan_builds_the_3d_mesh_and_holds_the_plan_to_fully_shard_on_each_pipeline_stage():
    from shardlab.memory.verify import verify_plan

    cfg, task = tiny_task(TINY_3D)
    lines = verify_plan(cfg, task, 16)
    assert "pp 2 x dp_shard 4 x tp 2" in lines[0] and "pipeline rank 1" in lines[0]
    # the LM task's own tensor-parallel plan (shardlab_tasks/lm/models/tensor_parallel.py), checked against the plan's
    # TP bytes
    assert "the task's tensor-parallel plan applied" in lines[0] and "NOT applied" not in lines[0]


def test_verify_plan_applies_the_tasks_tensor_parallel_plan_and_catches_a_plan_that_splits_less():
    from shardlab.memory.verify import PlanMismatch, verify_plan

    cfg, task = tiny_task(TINY_3D)
    task.tensor_parallel_plan = colwise_rowwise_plan  # as Task.tensor_parallel_plan hands it to the backend
    lines = verify_plan(cfg, task, 16)
    assert "the task's tensor-parallel plan applied" in lines[0]
    task.tensor_parallel_plan = lambda model: colwise_rowwise_plan(model, mlp_split=False)
    with pytest.raises(PlanMismatch, match="bytes of params"):
        verify_plan(cfg, task, 16)


# ---- backend=auto: the model axes as candidates -------------------------------------------------------------------
WIDE = ["model=llama_tiny", "model.dim=1024", "model.num_heads=8", "model.num_kv_heads=8", "model.num_layers=2",
        "data.seq_len=16", "distributed=fully_sharded", "distributed.world_size=8", "optimization.batch_size=8",
        "validation.batch_size=8"]  # fmt: skip


def test_backend_auto_picks_a_tensor_parallel_layout_for_a_budget_fsdp_alone_cannot_meet():
    """Wide layers, short sequences: what a rank must fit is a gathered layer, which TP divides. A budget between
    FSDP's need and TP 8's is met only by a TP layout, and only when the task can split (Task.tensor_parallel_plan)."""
    from shardlab.distributed.units import model_on_meta
    from shardlab.errors import ConfigError
    from shardlab.memory import budget
    from shardlab.memory.plan import profile_config

    cfg, task = tiny_task(WIDE, 8)
    model = model_on_meta(task)
    profile, ctx = profile_config(cfg, task, 8, model)
    task.tensor_parallel_plan = lambda m: colwise_rowwise_plan(m)
    axes = budget.task_axes(cfg, task, 8, model, ctx.ranks_per_node)
    assert axes is not None and axes.tp_degrees == (2, 4, 8) and axes.pp_degrees == ()  # update_freq 1: no pipeline
    data_only = min(budget.needed(estimate(profile, layout, ctx)) for layout in budget.auto_candidates(8, 8, False))
    tp8 = Layout("fully_sharded", 1, tp=8)
    tp_need = budget.needed(estimate(axes.profile_at(tp8), tp8, ctx))
    assert tp_need < data_only
    cfg.distributed.memory_budget_gb = (tp_need + data_only) / 2 / 2**30
    with pytest.raises(ConfigError, match="fits no layout"):
        budget.choose(profile, cfg, ctx)
    choice = budget.choose(profile, cfg, ctx, axes=axes)
    assert choice.layout.tp > 1 and budget.needed(choice.estimate) <= cfg.distributed.memory_budget_gb * 2**30
    assert choice.layout.overrides(8)["tensor_parallel_degree"] == choice.layout.tp


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_the_plans_stages_hold_the_parameters_the_real_cut_gives_each_stage(num_stages):
    """The plan's stages (stage_units, with the root on the last) against shardlab.distributed.pipeline's pruned
    stages of the LM task's own model and PipelineCut: a drift in the split or in where the embedding, head and
    final norm go fails here."""
    from shardlab.distributed.pipeline import layer_ranges, pruned
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory.plan import profile_config

    cfg, task = tiny_task(["model=llama_tiny", "model.num_layers=5", "distributed=fully_sharded", "dry_run=true"], 1)
    model = model_on_meta(task)
    prof, _ = profile_config(cfg, task, 1, model)
    cut = task.pipeline_cut()
    root = sum(r * w for r, w in prof.groups()[-1])  # the final norm, planned on the last stage
    stages = stage_units(prof, num_stages)
    planned = [sum(prof.unit_params[u] for u in s) + root * (i == num_stages - 1) for i, s in enumerate(stages)]
    ranges = layer_ranges(cut.num_layers, num_stages)
    real = [
        sum(p.numel() for p in pruned(model, cut, r, first=i == 0, last=i == num_stages - 1).parameters())
        for i, r in enumerate(ranges)
    ]
    assert planned == real and sum(real) == sum(p.numel() for p in model.parameters())
    assert [len(r) for r in ranges] == stage_sizes(5, num_stages)
