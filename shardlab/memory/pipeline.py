"""Pipeline schedules as the memory plan sees them: how a model's layers split into stages, which stages a pipeline
rank holds, the order its forwards and backwards run in (so which micro-batches' activations it holds at once), and
the bubble, the share of a step a rank waits.

The orders follow torch.distributed.pipelining's schedules (torch 2.14, schedules.py): GPipe runs every forward,
then every backward; 1F1B runs ``min(m, pp - rank)`` forwards, then one backward and one forward in turn
(Schedule1F1B's warmup_chunks); the interleaved schedules run ``(v - 1) * m_round + 2 (pp - 1 - rank)`` forwards
first, capped at all ``m * v`` of them (_get_warmup_ops), taking the local stages round by round, then a forward and
a backward in turn (_get_1f1b_rank_ops). The zero-bubble schedules split each backward into the input's and the
weights' gradients; they keep activations as their 1F1B counterparts do (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", ZB-H1), which is how they are planned here. The split of layers is torchtitan's default
(generate_split_points, torchtitan 9dec370): the first stage gets the base count, the middle stages one more each
while layers are left over.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")
"""Schedules the plan knows, by distributed.pipeline_schedule."""
LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")
"""Schedules with more than one stage per rank (distributed.pipeline_stages_per_rank >= 2)."""


def stage_sizes(num_layers: int, num_stages: int, split: str = "shardlab") -> list[int]:
    """Layers of each stage. ``shardlab``: as even as the count allows, the first stages taking one more
    (shardlab.distributed.pipeline's cut); ``torchtitan``: its default split points (generate_split_points at
    9dec370), ``num_layers // num_stages`` each and one more for each middle stage while the remainder lasts, the
    last stage taking what is left (the published runs shardlab_bench/plan_axes.py compares with)."""
    if split == "shardlab":  # the real cut's own function, so the plan cannot drift from what runs
        # imported here, not at the top: that module imports torch's pipelining and with it torch._dynamo (~1 s), which
        # every start (each CLI command, each spawned rank) paid through the runner's memory plan, pipeline or not
        from shardlab.distributed.pipeline import layer_ranges

        return [len(layers) for layers in layer_ranges(num_layers, num_stages)]
    base, extra = divmod(num_layers, num_stages)
    sizes = [base] * num_stages
    for stage in range(1, num_stages - 1):
        if extra == 0:
            break
        sizes[stage] += 1
        extra -= 1
    sizes[-1] += extra
    return sizes


def rank_stages(rank: int, pp: int, stages_per_rank: int, schedule: str = "1f1b") -> list[int]:
    """The global stage indices pipeline rank ``rank`` holds, local order: loop style (rank, rank + pp, ...); the V
    schedule (zbv) folds back (rank, 2 pp - 1 - rank). The loop is shardlab.distributed.pipeline's own placement."""
    if schedule == "zbv_zero_bubble":
        return [rank, 2 * pp - 1 - rank]
    from shardlab.distributed.pipeline import rank_stages as real_rank_stages  # here, not at the top: stage_sizes

    return real_rank_stages(rank, pp, stages_per_rank)


@dataclass(frozen=True)
class Op:
    """One forward ("F") or backward ("B") of a local stage on a micro-batch."""

    kind: str
    stage: int
    """The local stage index (0 .. stages_per_rank - 1)."""
    microbatch: int


def schedule_ops(schedule: str, pp: int, rank: int, microbatches: int, stages_per_rank: int = 1) -> list[Op]:
    """The forwards and backwards pipeline rank ``rank`` runs, in order."""
    m, v = microbatches, stages_per_rank
    if schedule == "gpipe":
        return [Op("F", 0, i) for i in range(m)] + [Op("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        ops = [Op("F", 0, i) for i in range(warmup)]
        for i in range(m):  # one backward, then the next forward
            ops.append(Op("B", 0, i))
            if warmup + i < m:
                ops.append(Op("F", 0, warmup + i))
        return ops
    return _interleaved_ops(pp, rank, m, v)


def _interleaved_ops(pp: int, rank: int, m: int, v: int) -> list[Op]:
    rounds = max(1, m // pp)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    forward_next, backward_next = [0] * v, [0] * v
    ops: list[Op] = []

    def forward(k: int) -> None:
        stage = (k // per_round) % v
        ops.append(Op("F", stage, forward_next[stage]))
        forward_next[stage] += 1

    def backward(k: int) -> None:
        stage = v - 1 - (k // per_round) % v
        ops.append(Op("B", stage, backward_next[stage]))
        backward_next[stage] += 1

    for k in range(warmup):
        forward(k)
    for k in range(total):  # a forward and a backward in turn, then the backwards left
        if warmup + k < total:
            forward(warmup + k)
        backward(k)
    return ops


def max_in_flight(ops: list[Op]) -> int:
    """The most forwards whose backward has not run yet, at any point: the micro-batch activations held at once."""
    held = peak = 0
    for op in ops:
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step each rank idles in the fill and drain: (pp - 1) / (m + pp - 1) for GPipe and 1F1B, the
    fill shrinking by the stages per rank for the interleaved ones, (pp - 1) / (v m + pp - 1) (Narayanan et al.
    2021, Megatron-LM's interleaved schedule: bubble time (p - 1) / v against m micro-batches of work)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
