"""Layouts: the ways to place a model (single, ddp, fully_sharded with its shard degree, resharding, activation
checkpointing and CPU offload) that the memory plan compares, the one a config asks for, and how FSDP2 shards a
parameter's rows over a layout's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def checkpointing(self) -> str:
        """The distributed.activation_checkpointing value of this layout."""
        if not self.activation_checkpointing:
            return "none"
        if self.ac_save_ops:
            return "selective_op"
        return "selective_layer" if self.ac_every_k_units > 1 else "full"

    def label(self, world_size: int) -> str:
        text = self.backend
        if self.backend == "fully_sharded":
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
        return text

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
        if self.backend == "fully_sharded":
            values.update(
                sharding_degree=-1 if self.sharding_degree == world_size else self.sharding_degree,
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
    if d.backend != "fully_sharded":
        return Layout(d.backend, 1, True, cpu_offload=False, **checkpointing)
    degree = world_size if d.sharding_degree == -1 else min(d.sharding_degree, world_size)
    return Layout("fully_sharded", degree, d.reshard_after_forward, cpu_offload=d.cpu_offload, **checkpointing)


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
