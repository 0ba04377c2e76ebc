"""The memory plan of mixture-of-experts models from their config.json alone: Qwen3-30B-A3B on one machine of 8 H100s
and Mixtral 8x22B on 64 H100s (8 machines), fully sharded, at several expert-parallel degrees; the tables of
docs/models.md's "Planning an MoE".

    python -m shardlab_bench plan_moe --out docs/bench/plan_moe.json

Nothing is measured and no weight exists: each model is its published config.json (tests/data/qwen3_30b_a3b,
tests/data/mixtral_8x22b), read as a model section (``moe_overrides``), built on the meta device and planned as
dry_run plans it (seconds each, on any machine); then distributed.verify_plan shards Qwen3-30B-A3B's 48 layers of 128
experts with the real fully_shard over 8 ranks of torch's fake process group and holds the plan to it, without expert
parallelism and at EP 2 and 8 (the backend's expert split on its expert mesh, distributed.expert_parallel_degree).

The expert-parallel degree is set on the planned layout (``Layout.ep``), the value distributed.expert_parallel_degree
gives it. Every setting: bf16 parameters with fp32 gradient reduction, AdamW, full activation checkpointing of the
blocks, balanced routing (the plan's assumption: an unbalanced router sends some rank more rows).

DeepSeek-V3 is not planned: its attention (multi-head latent attention) is refused for loading, so Mixtral 8x22B
stands in as the large model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from shardlab_bench.plan_axes import verify  # timed verify_plan of a layout, as plan_axes.json's
from shardlab_bench.provenance import collect, finish

REPO = Path(__file__).resolve().parent.parent

DENSE_TWIN = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}
"""The dense family whose attention and fields an MoE family shares: its config.json is read as that family's for
everything but the MoE block."""


def moe_overrides(folder: Path) -> list[str]:
    """The model section of an MoE config.json as overrides of model=moe_tiny: the dense fields as
    shardlab_tasks.lm.hf.hf_models reads them for the dense twin, the MoE fields as
    shardlab_tasks.lm.hf.moe_hub.moe_section reads them."""
    from shardlab_tasks.lm.hf.hf_models import model_section, read_config_json
    from shardlab_tasks.lm.hf.moe_hub import moe_section

    hf = read_config_json(folder)
    path = folder / "config.json"
    dense = model_section({**hf, "model_type": DENSE_TWIN[hf["model_type"]], "architectures": []}, path)
    moe = {k: v for k, v in moe_section(hf, str(path)).items() if k != "family"}
    out = ["model=moe_tiny", "model.moe.z_loss_coef=0.0"]
    for key, value in dense.items():
        if key not in ("arch", "ffn_dim", "rope_scaling", "moe"):  # moe: the dense twin says none
            out.append(f"model.{key}={'null' if value is None else value}")
    out += [f"model.moe.{key}={value}" for key, value in moe.items()]
    return out


COMMON = [
    "distributed=fully_sharded", "distributed.plan_device=h100_80gb", "distributed.precision=bf16",
    "distributed.activation_checkpointing=full", "distributed.ac_skip_units=[0,-1]",
]  # fmt: skip
MODELS = {
    "Qwen3-30B-A3B": "tests/data/qwen3_30b_a3b",
    "Mixtral 8x22B": "tests/data/mixtral_8x22b",
}
SETUPS = [
    # Qwen3-30B-A3B on one machine of 8 H100s: 8 sequences of 4096 tokens per step (one per rank)
    *[("Qwen3-30B-A3B", 8, 8, 4096, ep, []) for ep in (1, 2, 4, 8)],
    # Mixtral 8x22B on 8 machines of 8 H100s: 64 sequences of 4096 tokens per step (one per rank); the state that
    # does not fit the GPUs moved to the hosts (cpu_offload)
    *[("Mixtral 8x22B", 64, 64, 4096, ep, []) for ep in (1, 8)],
    ("Mixtral 8x22B", 64, 64, 4096, 8, ["distributed.cpu_offload=true"]),
]
"""(model, world size, global batch, sequence length, expert-parallel degree, further overrides)."""
VERIFIED_EP = (2, 8)
"""Expert-parallel degrees of Qwen3-30B-A3B on 8 ranks that verify_plan holds to the backend's expert mesh and
fully_shard (the JSON's ``verify_ep``), beside the first layout's ``verify``."""


def keys(model: str, world: int, batch: int, seq_len: int) -> list[str]:
    return [
        *moe_overrides(REPO / MODELS[model]), *COMMON, f"distributed.world_size={world}",
        f"optimization.batch_size={batch}", f"validation.batch_size={batch}", f"data.seq_len={seq_len}",
        f"model.max_seq_len={seq_len}",
    ]  # fmt: skip


def plan(overrides: list[str], ep: int) -> dict[str, Any]:
    """What dry_run plans for ``overrides`` at expert-parallel degree ``ep``: the fullest rank's figures and the MoE
    ones (shardlab.memory.experts)."""
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory.estimate import estimate
    from shardlab.memory.experts import plan_experts
    from shardlab.memory.layout import layout_of
    from shardlab.memory.plan import profile_config
    from shardlab.runner import build_task

    cfg = compose_config(overrides)
    world = cfg.distributed.world_size
    task = build_task(cfg, world_size=world)
    profile, ctx = profile_config(cfg, task, world, model_on_meta(task))
    layout = dataclasses.replace(layout_of(cfg.distributed, world), ep=ep)
    est = estimate(profile, layout, ctx)
    moe = plan_experts(profile, layout, ctx)
    return {
        "label": layout.label(world), "world_size": world, "samples_per_microbatch": profile.local_batch,
        "peak_bytes": est.peak, "device_bytes": est.device_peak, "capacity_bytes": ctx.capacity,
        "params_bytes": est.params, "optimizer_bytes": est.optimizer, "grads_bytes": est.grads,
        "state_bytes": est.state, "gathered_bytes": est.gathered, "activation_bytes": est.activations or 0,
        "host_bytes": est.host, "sent_bytes": est.comm_bytes, **dataclasses.asdict(moe),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    meta = collect(__file__, argv)
    rows = []
    for model, world, batch, seq_len, ep, extra in SETUPS:
        overrides = [*keys(model, world, batch, seq_len), *extra]
        rows.append({"model": model, "config": MODELS[model], "ep": ep, "overrides": overrides,
                     "plan": plan(overrides, ep)})  # fmt: skip
    qwen = keys("Qwen3-30B-A3B", 8, 8, 4096)
    with_ep = [verify([*qwen, f"distributed.expert_parallel_degree={ep}"]) for ep in VERIFIED_EP]
    results = {"tool": "plan_moe", "plans": rows, "verify": verify(qwen), "verify_ep": with_ep}
    results["meta"] = finish(meta)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}: {len(rows)} layouts in {results['meta']['seconds']} s")
    return 0
