"""Layouts: the ways to place a model (single, ddp, fully_sharded with its shard degree, resharding, activation
checkpointing and CPU offload) that the memory plan compares, the one a config asks for, and how FSDP2 shards a
parameter's rows over a layout's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


def shard_rows(rows: int, degree: int, rank: int | None = None) -> int:
    """Rows of a ``rows``-row parameter a rank of a ``degree``-rank shard group holds, as FSDP2 chunks it
    (torch.chunk: ceil(rows / degree) per rank, the last ranks fewer or none). ``rank=None``: the padded shard every
    rank allocates (FSDP2 pads each shard to the first one's size)."""
    chunk = -(-rows // degree)
    if rank is None:
        return chunk
    return max(0, min(chunk, rows - rank * chunk))


def shard_numel(shapes: list[tuple[int, int]], degree: int, rank: int | None = None) -> int:
    return sum(shard_rows(rows, degree, rank) * width for rows, width in shapes)


# ---- layouts and what each holds -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One way to place the model: the distributed.* keys the plan compares."""

    backend: str
    sharding_degree: int = 1
    """Ranks a parameter is sharded over (1 = not sharded)."""
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    """Whether any unit recomputes in backward (every unit, unless one of the two keys below narrows it)."""
    cpu_offload: bool = False
    ac_every_k_units: int = 1
    """> 1: only every k-th unit recomputes (activation_checkpointing=selective_layer)."""
    ac_save_ops: tuple[str, ...] = ()
    """Non-empty: every unit keeps these op groups' outputs and recomputes the rest (selective_op)."""
    ac_matmul_save_every: int = 1
    """selective_op: of the matmul outputs, only the 1st, (n+1)-th, ... of each unit are kept."""
    ac_skip_units: tuple[int, ...] = ()
    """Units that never recompute (distributed.ac_skip_units)."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallelism): each layer's matrices split over this many ranks."""
    pp: int = 1
    """Pipeline stages' ranks (distributed.pipeline_parallel_degree)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks."""
    schedule: str = "1f1b"
    """pp > 1: distributed.pipeline_schedule."""
    stages_per_rank: int = 1
    """pp > 1: distributed.pipeline_stages_per_rank."""
    ep: int = 1
    """Expert-parallel degree (distributed.expert_parallel_degree): ranks of the data-sharding ones that split an
    MoE layer's experts between them (shardlab.memory.experts)."""
    stage_split: str = "shardlab"
    """pp > 1: how layers split into stages (shardlab.memory.pipeline.stage_sizes): shardlab's cut, or torchtitan's
    (for comparing with its published runs; no config key)."""
    last_stage_outputs_kept: bool = False
    """pp > 1: whether the last stage keeps every micro-batch's output (the logits) to the end of the step, as torch's
    schedule does when step's return_outputs is on (its default, under which torchtitan's published runs ran).
    shardlab's PipelineRunner turns it off: it never reads them. No config key: for comparing with those runs."""
    embedding_gradient_whole: bool = False
    """tp > 1: whether each TP rank computes the embedding's gradient over the whole vocabulary, as torch's
    RowwiseParallel embedding does (torchtitan's, under which its published runs ran: shardlab.memory.axes,
    _embedding_gradient_whole). shardlab's VocabularySplitEmbedding computes each rank's rows only. No config key:
    for comparing with those runs."""

    @property
    def multi_axis(self) -> bool:
        """Whether a tensor, pipeline or context axis is in use (shardlab.memory.axes plans it)."""
        return self.tp > 1 or self.pp > 1 or self.cp > 1

    def data_ranks(self, world_size: int) -> int:
        """Ranks that read different samples: the world over the model axes."""
        return max(world_size // (self.tp * self.pp * self.cp), 1)

    @property
    def checkpointing(self) -> str:
        """The distributed.activation_checkpointing value of this layout."""
        if not self.activation_checkpointing:
            return "none"
        if self.ac_save_ops:
            return "selective_op"
        return "selective_layer" if self.ac_every_k_units > 1 else "full"

    def label(self, world_size: int) -> str:
        text = self.backend if not self.multi_axis else self._axes_label(world_size)
        if self.backend == "fully_sharded" and not self.multi_axis:
            if self.sharding_degree < world_size:
                text = f"hybrid, shards of {self.sharding_degree}"
            if not self.reshard_after_forward:
                text += ", no reshard"
        if self.checkpointing == "full":
            text += " + act. ckpt"
        elif self.checkpointing == "selective_layer":
            text += f" + act. ckpt 1/{self.ac_every_k_units} units"
        elif self.checkpointing == "selective_op":
            text += " + op-selective ckpt"
            if self.ac_matmul_save_every > 1:
                text += f" (1/{self.ac_matmul_save_every} matmuls)"
        if self.ac_skip_units:
            text += f" except units {', '.join(map(str, self.ac_skip_units))}"
        if self.cpu_offload:
            text += " + cpu_offload"
        if self.ep > 1:
            text += f" + EP {self.ep}"
        return text

    def _axes_label(self, world_size: int) -> str:
        """E.g. 'FSDP 8 x TP 8 x PP 8 (1f1b)', 'DDP 2 x FSDP 4 x TP 2' (the data axes, then the model axes)."""
        dp = self.data_ranks(world_size)
        parts = []
        if self.backend == "fully_sharded":
            if dp > self.sharding_degree:
                parts.append(f"DDP {dp // self.sharding_degree}")
            parts.append(f"FSDP {self.sharding_degree}" + ("" if self.reshard_after_forward else " no reshard"))
        elif dp > 1:
            parts.append(f"DDP {dp}")
        parts += [f"{name} {size}" for name, size in (("CP", self.cp), ("TP", self.tp)) if size > 1]
        if self.pp > 1:
            stages = f", {self.stages_per_rank} stages/rank" if self.stages_per_rank > 1 else ""
            parts.append(f"PP {self.pp} ({self.schedule}{stages})")
        return " x ".join(parts)

    def overrides(self, world_size: int) -> dict:
        """The distributed.* values that select this layout."""
        values: dict = {"backend": self.backend, "activation_checkpointing": self.checkpointing}
        if self.checkpointing == "selective_layer":
            values["ac_every_k_units"] = self.ac_every_k_units
        elif self.checkpointing == "selective_op":
            values["ac_save_ops"] = list(self.ac_save_ops)
            values["ac_matmul_save_every"] = self.ac_matmul_save_every
        if self.checkpointing != "none":
            values["ac_skip_units"] = list(self.ac_skip_units)
        values.update(
            tensor_parallel_degree=self.tp, pipeline_parallel_degree=self.pp, context_parallel_degree=self.cp,
            pipeline_schedule=self.schedule, pipeline_stages_per_rank=self.stages_per_rank,
        )  # fmt: skip
        if self.ep > 1:  # the key exists once expert parallelism does: left out at 1, so older configs compose
            values["expert_parallel_degree"] = self.ep
        if self.backend == "fully_sharded":
            values.update(
                sharding_degree=-1 if self.sharding_degree == self.data_ranks(world_size) else self.sharding_degree,
                reshard_after_forward=self.reshard_after_forward,
                cpu_offload=self.cpu_offload,
            )
        return values


def layout_of(d, world_size: int) -> Layout:
    """The layout a composed distributed section asks for."""
    mode = d.activation_checkpointing
    checkpointing = {
        "activation_checkpointing": mode != "none",
        "ac_every_k_units": d.ac_every_k_units if mode == "selective_layer" else 1,
        "ac_save_ops": tuple(d.ac_save_ops) if mode == "selective_op" else (),
        # getattr: configs recorded before these keys existed lack them
        "ac_matmul_save_every": getattr(d, "ac_matmul_save_every", 1) if mode == "selective_op" else 1,
        "ac_skip_units": tuple(getattr(d, "ac_skip_units", ())) if mode != "none" else (),
    }
    # getattr: configs recorded before the model axes existed lack their keys
    axes = {
        "tp": getattr(d, "tensor_parallel_degree", 1), "pp": getattr(d, "pipeline_parallel_degree", 1),
        "cp": getattr(d, "context_parallel_degree", 1), "schedule": getattr(d, "pipeline_schedule", "1f1b"),
        "stages_per_rank": getattr(d, "pipeline_stages_per_rank", 1), "ep": getattr(d, "expert_parallel_degree", 1),
    }  # fmt: skip
    if d.backend != "fully_sharded":
        return Layout(d.backend, 1, True, cpu_offload=False, **checkpointing, **axes)
    data = max(world_size // (axes["tp"] * axes["pp"] * axes["cp"]), 1)
    degree = data if d.sharding_degree == -1 else min(d.sharding_degree, data)
    return Layout("fully_sharded", degree, d.reshard_after_forward, cpu_offload=d.cpu_offload, **checkpointing, **axes)


# ---- alternatives and the automatic choice ---------------------------------------------------------------------------
def alternatives(world_size: int, ranks_per_node: int) -> list[Layout]:
    """The layouts dry_run compares, roughly from fastest to smallest."""
    if world_size == 1:
        return [
            Layout("single"),
            Layout("single", activation_checkpointing=True),
            Layout("fully_sharded", 1, cpu_offload=True),
            Layout("fully_sharded", 1, activation_checkpointing=True, cpu_offload=True),
        ]
    layouts = [Layout("ddp")]
    hybrid = [f for f in range(2, world_size) if world_size % f == 0]
    # Across machines, sharding within one and replicating across them keeps the all-gathers on the fast links.
    node = ranks_per_node if ranks_per_node in hybrid else None
    if node:
        layouts += [Layout("fully_sharded", node, reshard_after_forward=False), Layout("fully_sharded", node)]
    layouts += [Layout("fully_sharded", world_size, reshard_after_forward=False), Layout("fully_sharded", world_size)]
    layouts += [Layout("fully_sharded", f) for f in hybrid if f != node]
    layouts += [
        Layout("fully_sharded", world_size, activation_checkpointing=True),
        Layout("fully_sharded", world_size, cpu_offload=True),
        Layout("fully_sharded", world_size, activation_checkpointing=True, cpu_offload=True),
    ]
    return layouts


def axis_alternatives(chosen: Layout, world_size: int, ranks_per_node: int) -> list[Layout]:
    """The layouts dry_run compares with a multi-axis one: the same ranks per model replica (so the same samples per
    data-parallel rank, which the profile was made for) split other ways between tensor and pipeline parallelism
    (TP inside a machine), each pipeline under GPipe, 1F1B and interleaved 1F1B, with and without activation
    checkpointing."""
    model_ranks = chosen.tp * chosen.pp
    data = chosen.data_ranks(world_size)
    out = [chosen]
    for tp in [d for d in range(1, model_ranks + 1) if model_ranks % d == 0 and d <= max(ranks_per_node, 1)]:
        pp = model_ranks // tp
        base = replace(chosen, tp=tp, pp=pp, schedule="1f1b", stages_per_rank=1)
        shapes = (
            [base]
            if pp == 1
            else [replace(base, schedule="gpipe"), base, replace(base, schedule="interleaved_1f1b", stages_per_rank=2)]
        )
        for layout in shapes:
            for checkpointing in (False, True):
                candidate = replace(
                    layout,
                    activation_checkpointing=checkpointing,
                    ac_every_k_units=1,
                    ac_save_ops=(),
                    ac_matmul_save_every=1,
                    ac_skip_units=chosen.ac_skip_units if checkpointing else (),
                )
                if candidate not in out and (candidate.multi_axis or data * model_ranks == world_size):
                    out.append(candidate)
    return out
