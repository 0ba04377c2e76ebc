"""What the plan warns of beside its bytes: an optimizer that declares no state, a model FSDP cannot split, a root
unit that stays gathered, gradients kept unsharded between micro-batches. Printed under the plan
(shardlab.memory.console.describe).
"""

from __future__ import annotations

from collections.abc import Iterator

from shardlab.memory.context import UNDECLARED_STATE_TENSORS, PlanContext
from shardlab.memory.devices import GiB
from shardlab.memory.layout import Layout
from shardlab.memory.profile import ModelProfile


def warnings(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> Iterator[str]:
    if ctx.undeclared_optimizer is not None:
        yield (
            f"warning: optimizer '{ctx.undeclared_optimizer}' declares no state per parameter, so it is planned "
            f"with {UNDECLARED_STATE_TENSORS} fp32 tensors per parameter as Adam; register it with state_tensors="
        )
    sharded = layout.backend == "fully_sharded"
    P = profile.params
    if sharded and not profile.unit_params:
        yield (
            "warning: fully_sharded without units gathers the whole model at once: no saving while it computes "
            "(set distributed.wrap_min_num_params or give the task fsdp_units)"
        )
    elif sharded and max(profile.unit_params) > P / 3:
        yield (
            f"warning: one FSDP unit holds {max(profile.unit_params) / P:.0%} of the parameters: its gathered copy "
            "is what every rank must fit; split it into smaller units"
        )
    if sharded and profile.root_params > P / 3 and ctx.world_size > 1:
        yield (
            f"warning: the root unit holds {profile.root_params / P:.0%} of the parameters (e.g. tied embeddings) "
            "and stays gathered for the whole step"
        )
    if sharded and ctx.update_freq > 1 and not ctx.reduce_every_microbatch:
        yield (
            "warning: distributed.reduce_every_microbatch=false keeps unsharded gradients of the whole model between "
            f"micro-batches (+{4 * P * (1 - 1 / layout.sharding_degree) / GiB:.2f} GiB per rank)"
        )
