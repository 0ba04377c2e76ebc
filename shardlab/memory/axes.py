"""The plan of a layout with tensor, pipeline or context axes beside the data ones: what the fullest rank holds and
what each axis sends per step.

The model as one rank sees it:
- **Tensor parallelism** splits every matrix over ``tp`` ranks (column-wise linears by output rows, row-wise by input
  columns, the embedding and the head by vocabulary rows: torch's ColwiseParallel/RowwiseParallel as torchtitan's
  Llama plan places them); vectors (norm weights) stay whole on each. FSDP then shards each rank's TP shard over the
  data-shard and context ranks (torchtitan's dp_shard_cp), by rows as it does any parameter.
- **Sequence parallelism** (always on with TP here, as in torchtitan) shards the norm and dropout regions' activations
  by sequence, and TP's column/row split shards the attention and MLP ones by heads and width, so every saved
  activation is divided by ``tp`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", eq. 4: ``sbh (34 / t + 5 a s / (h t))`` per layer; the ``5as/h`` scores term is absent here, the fused
  attention the profile counts keeping no length x length matrix). Loss parallelism keeps the logits vocabulary-
  sharded, so they divide by ``tp`` too. **Context parallelism** divides the sequence, and with it every saved
  activation, by ``cp`` (the ring's transient key/value chunks are not counted); its traffic is the ring's key/value
  chunks and their gradients (_cp_sent).
- **Pipeline stages** hold consecutive layers (shardlab.memory.pipeline: shardlab's cut, the first stages taking
  the remainder; the embedding with the first stage, the head, final norm and loss with the last). Each stage keeps
  its units gathered from its first forward to its last backward (with reshard_after_forward they are gathered
  again per micro-batch in the warmup, and stay so from the first backward: counted from the first forward), and
  its gradients unsharded, accumulating in the reduce dtype, until the last micro-batch's backward reduce-scatters
  them: torch.distributed.pipelining turns FSDP2's gradient sync and
  reshard-after-backward off for all but the last micro-batch (stage.py, backward_maybe_with_nosync), and
  torchtitan turns reshard-after-forward off under PP. The schedule decides how many micro-batches' activations a
  stage holds at once; the rank's peak is found by running its schedule's order through these events.

Everything is per rank, in bytes, as estimate's figures; the fullest pipeline rank is reported (torchtitan's published
peaks are the maximum over ranks).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from shardlab.memory import devices
from shardlab.memory.byte_model import (
    CPU_RUNTIME_BYTES,
    MemoryEstimate,
    _transient,
    estimate_data_parallel,
    rank_state,
    unit_activation_bytes,
)
from shardlab.memory.communication import Collective, collectives
from shardlab.memory.context import PlanContext
from shardlab.memory.experts import plan_experts, with_expert_parallel
from shardlab.memory.layout import Layout, shard_numel
from shardlab.memory.pipeline import bubble_fraction, max_in_flight, rank_stages, schedule_ops, stage_sizes
from shardlab.memory.profile import ModelProfile


@dataclass(frozen=True)
class AxesDetail:
    """What a multi-axis layout adds to the plan's lines."""

    rank: int
    """The pipeline rank whose peak is reported (the fullest)."""
    stage_layers: tuple[tuple[int, ...], ...]
    """Per pipeline rank, the units of each of its stages (one stage when pp is 1)."""
    in_flight: int
    """The most micro-batches' activations the fullest rank holds at once (summed over its stages)."""
    bubble: float
    traffic: dict[str, int]
    """Bytes one rank sends per optimizer step on each axis: fsdp (data), tp, pp, and cp where the layout has it."""
    rank_peaks: tuple[int, ...] = ()
    """Each pipeline rank's peak bytes (its state, gathered units, gradients and activations; without the CPU
    runtime or allocator terms), by pipeline rank: what shardlab.memory.stage_step measures rank 0's against."""


def tp_shapes(shapes: list[tuple[int, int]], tp: int, whole: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """A rank's TP share of parameters given as (rows, elements per row): matrices split in ``tp``, vectors whole,
    and one entry left whole for each of ``whole`` (an MoE block's parameters: ExpertProfile.block_shapes)."""
    left, out = list(whole), []
    for rows, width in shapes:
        if (rows, width) in left:
            left.remove((rows, width))
            out.append((rows, width))
        else:
            out.append((-(-rows // tp), width) if rows > 1 and width > 1 else (rows, width))
    return out


def model_rank_profile(profile: ModelProfile, tp: int, cp: int) -> ModelProfile:
    """The profile of the model as one (tp, cp) rank holds it: its TP share of every parameter, every saved
    activation divided by tp (sequence parallelism) and cp (its slice of the sequence)."""
    split = tp * cp

    def part(n: int) -> int:
        return -(-n // split)

    experts = profile.experts
    whole = experts.block_shapes if experts is not None and experts.block_shapes else None
    groups = [tp_shapes(g, tp, whole[i] if whole else ()) for i, g in enumerate(profile.groups())]
    acts = [part(n) for n in profile.unit_activations]
    if tp > 1:
        # torch's sequence parallelism all-gathers the normed input of the attention's and the MLP's column-wise
        # linears, which then save it whole (Megatron keeps the shard and gathers again in backward): two full
        # layer inputs per layer instead of two shards.
        for i in layer_units(profile):
            acts[i] += 2 * (-(-profile.unit_inputs[i] // cp) - part(profile.unit_inputs[i]))
    # In backward, the row-wise linear's output gradient is gathered to the full sequence and the column-wise one's
    # input gradient is full before its reduce-scatter: two full layer inputs where one rank's shards would be.
    workspace = max((-(-n // cp) - part(n) for n in profile.unit_inputs), default=0) * 2 if tp > 1 else 0
    trained = None if profile.trainable_shapes is None else [
        tp_shapes(g, tp, whole[i] if whole else ()) for i, g in enumerate(profile.trainable_shapes)]  # fmt: skip
    if experts is not None:  # each rank routes its slice of the sequence
        spec = experts.spec
        experts = dataclasses.replace(experts, spec=dataclasses.replace(
            spec, tokens_per_sample=-(-spec.tokens_per_sample // split)))  # fmt: skip
    return dataclasses.replace(
        profile,
        params=sum(r * w for g in groups for r, w in g),
        unit_params=[sum(r * w for r, w in g) for g in groups[:-1]],
        unit_shapes=groups[:-1],
        root_shapes=groups[-1],
        trainable_shapes=trained,
        experts=experts,
        activations=None if profile.activations is None else part(profile.activations) + sum(acts) - sum(
            part(n) for n in profile.unit_activations),
        unit_activations=acts,
        backward_workspace=workspace,
        unit_inputs=[part(n) for n in profile.unit_inputs],
        output=part(profile.output),
        largest_outside=part(profile.largest_outside),
        activation_slack=part(profile.activation_slack),
        unit_op_outputs=None if profile.unit_op_outputs is None else [
            {k: part(v) for k, v in u.items()} for u in profile.unit_op_outputs],
        unit_op_overlap=None if profile.unit_op_overlap is None else [
            {k: part(v) for k, v in u.items()} for u in profile.unit_op_overlap],
        unit_matmuls=None if profile.unit_matmuls is None else [
            [(part(a), part(b)) for a, b in u] for u in profile.unit_matmuls],
        autocast=None if profile.autocast is None else model_rank_profile(profile.autocast, tp, cp),
    )  # fmt: skip


def layer_units(profile: ModelProfile) -> list[int]:
    """The units that are the model's repeated layers: those shaped like the most common unit shape."""
    groups = profile.groups()[:-1]
    if not groups:
        return []
    common, _ = Counter(tuple(g) for g in groups).most_common(1)[0]
    return [i for i, g in enumerate(groups) if tuple(g) == common]


def stage_units(profile: ModelProfile, num_stages: int, split: str = "shardlab") -> list[list[int]]:
    """The units of each global stage: the layers split as ``split`` says (pipeline.stage_sizes), the units before
    the first layer (embedding) on the first stage, those after the last (head) on the last."""
    layers = layer_units(profile)
    units = list(range(len(profile.unit_params)))
    if not layers:
        return [units] + [[] for _ in range(num_stages - 1)]
    stages, start = [], 0
    for size in stage_sizes(len(layers), num_stages, split):
        stages.append(layers[start : start + size])
        start += size
    stages[0] = [u for u in units if u < layers[0]] + stages[0]
    stages[-1] = stages[-1] + [u for u in units if u > layers[-1]]
    return stages


def _sub_profile(profile: ModelProfile, units: list[int], with_root: bool) -> ModelProfile:
    """The part of ``profile`` one stage holds: its units, and the root (final norm, tied weights) on the last."""
    groups = profile.groups()
    trained = profile.trainable()
    root = groups[-1] if with_root else []
    return dataclasses.replace(
        profile,
        params=sum(r * w for u in units for r, w in groups[u]) + sum(r * w for r, w in root),
        unit_params=[profile.unit_params[u] for u in units],
        unit_shapes=[groups[u] for u in units],
        root_shapes=root,
        trainable_shapes=[*(trained[u] for u in units), trained[-1] if with_root else []],
        autocast=None,
    )


@dataclass
class _Stage:
    """One local stage's bytes (see the module docstring)."""

    state: int
    gathered: int
    accumulated: int
    sharded_grads: int
    kept: int
    """Activations kept per micro-batch in flight."""
    recompute: int
    """What a backward saves again on top (the recomputed unit, the loss's gradients)."""
    reduce_buffer: int
    """The last backward's reduce-scatter input: the biggest unit's unsharded gradients in the reduce dtype."""
    receive_buffers: int
    """torch's PipelineStage allocates, for every micro-batch, a buffer for the input it receives (not on the first
    stage) and one for its output's gradient (not on the last), and keeps them (stage.py, _create_act_recv_info and
    _create_grad_recv_info)."""
    unit_grad: int = 0
    """During every backward, the biggest unit's new gradients in the parameters' dtype, which autograd writes to
    param.grad before FSDP's post-backward adds them into the accumulated (reduce-dtype) gradients and frees them
    (torch 2.14 _fsdp_param.py, to_accumulated_grad_if_needed and accumulate_unsharded_grad_if_needed)."""
    embedding_grad: int = 0
    """On the first stage under torch's RowwiseParallel embedding (Layout.embedding_gradient_whole), its new
    gradient in the parameters' dtype, whole over the vocabulary, written during its backward, the last of each
    micro-batch's."""
    step_output: int = 0
    """On the last stage, where step's return_outputs is on (Layout.last_stage_outputs_kept: torch's default, as
    torchtitan's published runs had it; shardlab's PipelineRunner turns it off), its output of one micro-batch (the
    logits), which torch then keeps from that forward to the end of the step and concatenates: forward_one_chunk
    appends it to output_chunks, which the schedule's step merges and returns (torch 2.14 stage.py
    forward_one_chunk, schedules.py step). Torch before 2025-05 (pytorch#153383) kept every stage's outputs so;
    other stages' outputs here go at their backward (fwd_cache), inside ``kept``."""


def estimate_axes(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> MemoryEstimate:
    """Per-rank bytes of ``layout`` (tp, pp or cp above 1) on its fullest rank."""
    rank_profile = model_rank_profile(profile, layout.tp, layout.cp)
    data = layout.data_ranks(ctx.world_size)
    # FSDP over the data-shard and context ranks, replicated over the rest of the data ranks (torchtitan's dp_shard_cp)
    shard = layout.sharding_degree * layout.cp if layout.backend == "fully_sharded" else 1
    data_layout = dataclasses.replace(layout, sharding_degree=shard, tp=1, pp=1, cp=1)
    data_ctx = dataclasses.replace(ctx, world_size=data * layout.cp)
    if layout.pp == 1:
        # today's data-parallel plan, on the model's rank share; its experts placed by expert parallelism
        est = with_expert_parallel(estimate_data_parallel(rank_profile, data_layout, data_ctx), rank_profile, data_ctx)
        moe = plan_experts(rank_profile, data_layout, data_ctx)
        exchanged = moe.all_to_all_bytes if moe is not None else 0
        layers = tuple(range(len(profile.unit_params)))
        traffic = {"fsdp": est.comm_bytes - exchanged, "tp": _tp_sent(rank_profile, layout, ctx, layers), "pp": 0}
        if exchanged:
            traffic["ep"] = exchanged
        traffic.update(_cp_sent(rank_profile, layout, ctx, layers))
        est.axes = AxesDetail(0, ((layers,),), 1, 0.0, traffic)
    else:
        est = _pipelined(rank_profile, layout, data_layout, data_ctx)
    est.layout = layout
    est.comm_bytes = sum(est.axes.traffic.values())
    if ctx.device == "cuda":  # a communicator per mesh dimension in use, and the default group
        dims = sum(1 for n in (layout.tp, layout.pp, layout.cp, shard, data * layout.cp // max(shard, 1)) if n > 1)
        est.outside = devices.CUDA_CONTEXT + (1 + dims) * devices.NCCL_PER_COMMUNICATOR
    return est


def _pipelined(profile: ModelProfile, layout: Layout, data_layout: Layout, ctx: PlanContext) -> MemoryEstimate:
    """The fullest pipeline rank's peak, from its schedule's order of forwards and backwards."""
    pp, v, m = layout.pp, layout.stages_per_rank, ctx.update_freq
    stages = stage_units(profile, pp * v, layout.stage_split)
    per_unit = unit_activation_bytes(profile, data_layout) if profile.activations is not None else None
    best, rank_peaks = None, []
    for rank in range(pp):
        mine = rank_stages(rank, pp, v, layout.schedule)
        bytes_ = [_stage_bytes(profile, stages, s, per_unit, data_layout, ctx, layout.tp) for s in mine]
        ops = schedule_ops(layout.schedule, pp, rank, m, v)
        peak, parts = _run(ops, bytes_)
        rank_peaks.append(peak)
        if best is None or peak > best[0]:
            best = (peak, parts, rank, mine, bytes_, ops)
    _, parts, rank, mine, bytes_, ops = best
    state = [rank_state(_sub_profile(profile, stages[s], s == pp * v - 1), data_layout, ctx) for s in mine]
    traffic = {
        "fsdp": _fsdp_sent(profile, stages, mine, data_layout, ctx),
        "tp": _tp_sent(profile, layout, ctx, tuple(u for s in mine for u in stages[s])),
        "pp": _pp_sent(profile, stages, mine, m, pp * v),
        **_cp_sent(profile, layout, ctx, tuple(u for s in mine for u in stages[s])),
    }
    detail = AxesDetail(
        rank, tuple(tuple(tuple(stages[s]) for s in rank_stages(r, pp, v, layout.schedule)) for r in range(pp)),
        max_in_flight(ops), bubble_fraction(pp, m, v), traffic, tuple(rank_peaks),
    )  # fmt: skip
    est = MemoryEstimate(
        layout, params=sum(s.params for s in state), optimizer=sum(s.optimizer for s in state), grad_buffers=0,
        grads=parts["grads"], gathered=parts["gathered"],
        activations=None if per_unit is None else parts["activations"],
        runtime=CPU_RUNTIME_BYTES if ctx.device == "cpu" else 0, host=0, comm_bytes=0, accumulating=True, axes=detail,
    )  # fmt: skip
    if ctx.device == "cuda":
        est.allocator = int(devices.FRAGMENTATION * est.peak)
    return est


def _stage_bytes(profile, stages, stage: int, per_unit, layout: Layout, ctx: PlanContext, tp: int = 1) -> _Stage:
    """One global stage's bytes on a rank: its sharded state, its gathered units and unsharded gradients, and what
    each micro-batch in flight keeps."""
    last = stage == len(stages) - 1
    sub = _sub_profile(profile, stages[stage], last)
    f = layout.sharding_degree
    state = rank_state(sub, layout, ctx)
    unsharded = sum(f * shard_numel(g, f) for g in sub.groups())
    whole_vocabulary = _embedding_gradient_whole(profile, stages[stage], tp) if layout.embedding_gradient_whole else 0
    trained = sum(f * shard_numel(g, f) for g in sub.trainable()) + whole_vocabulary - whole_vocabulary // tp
    kept = recompute = 0
    if per_unit is not None:
        kept_per_unit, recomputed = per_unit
        kept = sum(kept_per_unit[u] for u in stages[stage])
        recompute = max((recomputed[u] for u in stages[stage]), default=0) + profile.backward_workspace
        if last:  # the loss: what is saved outside the units, and backward's first gradients
            kept += profile.activations - sum(profile.unit_activations) - _transient(profile)
            recompute += _transient(profile)
        else:  # torch's PipelineStage keeps each micro-batch's output until its backward (fwd_cache)
            kept += _boundary(profile)
        if stage > 0:  # the input arrives in that micro-batch's receive buffer (below), which the first unit keeps
            kept -= min(_boundary(profile), kept)
    return _Stage(
        state=state.params + state.optimizer, gathered=ctx.param_bytes * unsharded,
        accumulated=ctx.reduce_bytes * trained, sharded_grads=state.grads, kept=kept, recompute=recompute,
        reduce_buffer=ctx.reduce_bytes * max((f * shard_numel(g, f) for g in sub.trainable()), default=0),
        receive_buffers=ctx.update_freq * _boundary(profile) * ((stage > 0) + (not last)),
        unit_grad=ctx.param_bytes * max((f * shard_numel(g, f) for g in sub.trainable()), default=0),
        embedding_grad=ctx.param_bytes * whole_vocabulary,
        step_output=profile.output if last and layout.last_stage_outputs_kept and per_unit is not None else 0,
    )  # fmt: skip


def _embedding_gradient_whole(profile: ModelProfile, units: list[int], tp: int) -> int:
    """Elements of the embedding's gradient on a tensor-parallel rank where torch's RowwiseParallel splits it
    (Layout.embedding_gradient_whole: torchtitan's published runs): the vocabulary whole, not its 1/tp rows.
    torch's DTensor has no vocabulary-sharded strategy for the embedding's backward (torch 2.14
    distributed/tensor/_ops/_embedding_ops.py, embedding_dense_backward_strategy: the gradient sharded by columns,
    or Partial), so such an embedding computes a Partial gradient of the whole table on each rank, which FSDP2
    reduces over TP only when it reads it (_fsdp_param.py, _get_grad_inner_tensor); in between, gradients accumulated
    unsharded across micro-batches (PP) are that whole table in the reduce dtype (to_accumulated_grad_if_needed).
    The embedding is the trained units before the first layer (their matrices; tests/unit/test_torch_internals.py
    checks torch still does this). shardlab's own VocabularySplitEmbedding writes each rank's rows only."""
    layers = layer_units(profile)
    if tp == 1 or not layers:
        return 0
    trained = profile.trainable()
    return tp * sum(r * w for u in units if u < layers[0] for r, w in trained[u] if r > 1 and w > 1)


def _run(ops, stages: list[_Stage]) -> tuple[int, dict[str, int]]:
    """The rank's peak over its ops and what it is made of: a stage's units are gathered at its first forward, its
    unsharded gradients appear at its first backward; both go at its last backward, which writes its sharded
    gradients; each forward keeps its activations until its backward, during which the recomputation adds more;
    the last stage's outputs stay to the end, where the schedule concatenates them (_Stage.step_output)."""
    counts = Counter((op.stage, op.kind) for op in ops)
    seen: Counter = Counter()
    live = {"gathered": 0, "grads": 0, "activations": 0}
    peak, at_peak = 0, dict(live)
    for op in ops:
        s = stages[op.stage]
        seen[(op.stage, op.kind)] += 1
        first, last = seen[(op.stage, op.kind)] == 1, seen[(op.stage, op.kind)] == counts[(op.stage, op.kind)]
        if op.kind == "F":
            live["gathered"] += s.gathered if first else 0
            live["activations"] += s.kept + s.step_output
            continue
        live["gathered"] += s.accumulated if first else 0
        during = dict(live, activations=live["activations"] + s.recompute)
        during["gathered"] += s.unit_grad + (s.reduce_buffer if last else 0)
        # the embedding's backward comes last, the micro-batch's layers (their recomputation, their activations) done
        closing = dict(live, activations=live["activations"] - s.kept)
        closing["gathered"] += s.embedding_grad + (s.reduce_buffer if last else 0)
        for moment in (during, closing) if s.embedding_grad else (during,):
            if sum(moment.values()) > peak:
                peak, at_peak = sum(moment.values()), moment
        live["activations"] -= s.kept
        if last:
            live["gathered"] -= s.gathered + s.accumulated
            live["grads"] += s.sharded_grads
    merged = sum(counts[(i, "F")] * s.step_output for i, s in enumerate(stages))
    if merged and sum(live.values()) + merged > peak:  # after the last backward: the outputs and their concatenation
        peak, at_peak = sum(live.values()) + merged, dict(live, activations=live["activations"] + merged)
    state = sum(s.state + s.receive_buffers for s in stages)
    at_peak["activations"] += sum(s.receive_buffers for s in stages)
    return state + peak, at_peak


def _tp_sent(profile: ModelProfile, layout: Layout, ctx: PlanContext, units: tuple[int, ...]) -> int:
    """Sequence-parallel TP: per layer and micro-batch, forward all-gathers the (sequence-sharded) input of attention
    and of the MLP and reduce-scatters their outputs, backward does the reverse (Korthikanti et al. 2022, section
    4.2.2), and a recomputed layer repeats its forward's: 4 collectives of a layer input's size, each way."""
    if layout.tp == 1:
        return 0
    layers = set(layer_units(profile)) & set(units)
    picked = set(_picked(profile, layout))
    calls = sum(profile.unit_inputs[u] * (12 if u in picked else 8) for u in layers)
    if profile.experts is not None:  # an MoE block gathers nothing (SequenceShardedMoE): attention's half only
        calls //= 2
    return Collective("all_gather", layout.tp, calls, ctx.update_freq).sent


def _cp_sent(profile: ModelProfile, layout: Layout, ctx: PlanContext, units: tuple[int, ...]) -> dict[str, int]:
    """Context parallelism's ring (torch's _templated_ring_attention and its backward), per layer and micro-batch:
    forward passes this rank's key and value chunks on cp - 1 times, backward passes them on cp - 1 times again and
    the key and value gradients, accumulated in fp32 (torch's convert_to_f32), cp times (the last brings each back
    to its owner); a recomputed layer repeats its forward's. A chunk of K (or V) as attention sees it is a layer input
    on this rank (``unit_inputs``, divided by tp and cp: heads x head_dim = dim, GQA's heads expanded before
    attention). The allgather rotation sends the same bytes once per attention ((cp - 1)/cp of the whole K, V).
    {"cp": bytes}, or {} without a context axis (the traffic of other layouts keeps its keys)."""
    cp = layout.cp
    if cp == 1:
        return {}
    layers = set(layer_units(profile)) & set(units)
    picked = set(_picked(profile, layout))
    fp32_grads = 4 / ctx.param_bytes
    per_chunk = sum(profile.unit_inputs[u] * ((cp - 1) * (3 if u in picked else 2) + cp * fp32_grads) for u in layers)
    return {"cp": int(2 * per_chunk * ctx.update_freq)}  # K and V


def _picked(profile: ModelProfile, layout: Layout) -> list[int]:
    from shardlab.distributed.activation_checkpointing import checkpointed_units

    return checkpointed_units(
        len(profile.unit_params), layout.checkpointing, layout.ac_every_k_units, layout.ac_skip_units
    )


def _fsdp_sent(profile, stages, mine, layout: Layout, ctx: PlanContext) -> int:
    """Under PP each stage reduces its gradients once per step (they stay unsharded across the micro-batches). Its
    units are gathered once when they stay gathered (reshard_after_forward=false, as torchtitan runs PP), else again
    for each micro-batch's forward and backward, as fully_sharded gathers them (an upper bound: a unit still gathered
    from a backward is not gathered again)."""
    once = dataclasses.replace(ctx, update_freq=1, reduce_every_microbatch=True)
    kept = dataclasses.replace(layout, reshard_after_forward=False)
    sent = 0
    for s in mine:
        sub = _sub_profile(profile, stages[s], s == len(stages) - 1)
        gathers = collectives(sub, layout, ctx) if layout.reshard_after_forward else collectives(sub, kept, once)
        sent += sum(c.sent for c in gathers if c.op == "all_gather")
        sent += sum(c.sent for c in collectives(sub, kept, once) if c.op != "all_gather")
    return sent


def _pp_sent(profile: ModelProfile, stages, mine, microbatches: int, num_stages: int) -> int:
    """Per micro-batch, a stage sends its output forward (unless last) and its input's gradient back (unless
    first): each the size of a layer input on this rank (sequence-sharded)."""
    sends = sum((s < num_stages - 1) + (s > 0) for s in mine)
    return Collective("send", 2, _boundary(profile), sends * microbatches).sent


def _boundary(profile: ModelProfile) -> int:
    """Bytes of what crosses a stage boundary per micro-batch: a layer's input, as this rank holds it."""
    layers = layer_units(profile)
    return profile.unit_inputs[layers[0]] if layers else 0
