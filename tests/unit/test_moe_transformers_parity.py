"""The MoE Llama (model.moe) against transformers' own Mixtral, Qwen2-MoE and Qwen3-MoE models with the same weights
(issue 49): the logits (fp32, rtol 1e-4) and the first step's loss, the cross-entropy plus router_aux_loss_coef x
transformers' load-balancing loss (``output_router_logits=True``), on one process. Weights are copied in memory, as
transformers 5 holds them (grouped experts); hub folders read and written: tests/unit/test_moe_pretrained.py and
test_moe_export.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import meta_model
from shardlab.runner import build_task
from shardlab_tasks.lm.hf.hf_models import LLAMA_NAMES
from tests.conftest import compose_config

transformers = pytest.importorskip("transformers")

VOCAB, DIM, LAYERS, EXPERTS, FFN = 320, 32, 2, 4, 16
MOE_NAMES = {
    "mlp.router": "mlp.gate",
    "mlp.shared.gate": "mlp.shared_expert.gate_proj",
    "mlp.shared.up": "mlp.shared_expert.up_proj",
    "mlp.shared.down": "mlp.shared_expert.down_proj",
    "mlp.shared.output_gate": "mlp.shared_expert_gate",
}
"""Our MoE block's modules -> transformers 5's (the grouped experts keep their names: experts.gate_up_proj...)."""

FAMILIES = {
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=FFN, num_local_experts=EXPERTS), []),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(moe_intermediate_size=FFN, shared_expert_intermediate_size=24, num_experts=EXPERTS),
        ["model.qkv_bias=true", "model.moe.shared_ffn_dim=24", "model.moe.shared_expert_gate=true"],
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(moe_intermediate_size=FFN, num_experts=EXPERTS, head_dim=8, norm_topk_prob=True),
        ["model.qk_norm=true", "model.head_dim=8"],
    ),
}


def hf_name(ours: str) -> str:
    ends = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight"}
    if ours in ends or ours == "head.out.weight":
        return ends.get(ours, "lm_head.weight")
    _, layer, rest = ours.split(".", 2)
    module, _, leaf = rest.rpartition(".")
    if module == "mlp.experts":
        return f"model.layers.{layer}.{rest}"
    return f"model.layers.{layer}.{({**LLAMA_NAMES, **MOE_NAMES}).get(module, module)}.{leaf}"


def both_models(family: str):
    config_class, sizes, overrides = FAMILIES[family]
    hf_cfg = config_class(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, tie_word_embeddings=False, experts_implementation="eager", **sizes,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    normalised = getattr(hf_cfg, "norm_topk_prob", True)  # Mixtral always renormalises; its config has no key
    moe = [f"model.moe.num_experts={EXPERTS}", f"model.moe.ffn_dim={FFN}", "model.moe.top_k=2",
           "model.moe.z_loss_coef=0", f"model.moe.aux_loss_coef={hf_cfg.router_aux_loss_coef}",
           f"model.moe.norm_topk_prob={normalised}"]  # fmt: skip
    task = build_task(compose_config([
        "model=moe_tiny", f"model.num_layers={LAYERS}", f"model.dim={DIM}", "model.num_heads=4", "model.num_kv_heads=2",
        f"model.vocab_size={VOCAB}", f"model.norm_eps={hf_cfg.rms_norm_eps}", "data.seq_len=12",
        f"model.rope_theta={hf_cfg.rope_parameters['rope_theta']}", *moe, *overrides,
    ]), world_size=1)  # fmt: skip
    ours = meta_model(task.build_model)
    materialize(ours, torch.device("cpu"), task.init_tensor, seed=0)
    source = theirs.state_dict()
    with torch.no_grad():
        for name, p in ours.state_dict().items():
            p.copy_(source[hf_name(name)])
    return task, ours, theirs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_the_first_loss_with_the_aux_loss_equal_transformers(family):
    task, ours, theirs = both_models(family)
    batch = torch.randint(0, 257, (2, 13), generator=torch.Generator().manual_seed(1))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = theirs(input_ids=inputs, output_router_logits=True)
    torch.testing.assert_close(ours(inputs), out.logits, rtol=1e-4, atol=1e-5)
    ours.take_routing_stats()
    expected = F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))
    expected = expected + theirs.config.router_aux_loss_coef * out.aux_loss
    loss, _ = task.loss(ours, batch, torch.device("cpu"))
    assert out.aux_loss > 0
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
