"""What each rank holds at the peak of a training step for one layout (``estimate``: the data-parallel byte model of
shardlab.memory.byte_model, or shardlab.memory.axes for a layout with tensor, pipeline or context axes). The byte
model's names, its context's and its collectives' are re-exported here, where the plan's readers have always found
them; the plan's warnings are shardlab.memory.plan_warnings', the console's lines shardlab.memory.console's.
"""

from __future__ import annotations

from shardlab.memory.axes import estimate_axes
from shardlab.memory.byte_model import (  # noqa: F401  (re-exported: the plan's readers import them from here)
    CPU_RUNTIME_BYTES,
    MemoryEstimate,
    RankState,
    estimate_data_parallel,
    rank_state,
    unit_activation_bytes,
)
from shardlab.memory.communication import Collective, collectives, communicators  # noqa: F401  (re-exported)
from shardlab.memory.context import UNDECLARED_STATE_TENSORS, PlanContext  # noqa: F401  (re-exported)
from shardlab.memory.experts import with_expert_parallel
from shardlab.memory.layout import Layout
from shardlab.memory.profile import ModelProfile


def estimate(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> MemoryEstimate:
    """Per-rank bytes of a training step of ``layout`` on the fullest rank: what is held between steps and what the
    step adds."""
    if layout.multi_axis:
        return estimate_axes(profile, layout, ctx)
    return with_expert_parallel(estimate_data_parallel(profile, layout, ctx), profile, ctx)
