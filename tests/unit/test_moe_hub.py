"""shardlab_tasks/lm/hf/moe_hub.py against the files transformers itself writes: a tiny MoE model of each family saved
with save_pretrained, its config.json read as a model.moe section, its per-expert tensors placed into the grouped
weights (equal to transformers' own in-memory ones, the block's output equal to the layer's) and read back out
bit-exact; and the fields that cannot be expressed refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from shardlab_tasks.lm.hf.hf_models import HFConfigError
from shardlab_tasks.lm.hf.moe_hub import layer_placements, moe_section
from shardlab_tasks.lm.models.moe import MoEBlock, MoEConfig

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

COMMON = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=4)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(moe_intermediate_size=48, shared_expert_intermediate_size=40, num_experts=4, norm_topk_prob=False),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=48, num_experts=4)),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(moe_intermediate_size=48, n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=0),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    config_name, model_name, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **extra, num_experts_per_tok=2)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.linspace(-0.2, 0.2, buffer.numel()))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= safetensors_torch.load_file(file)
    return request.param, model, json.loads((folder / "config.json").read_text()), tensors


def block_from_files(model_type, hf, tensors) -> tuple[MoEBlock, list]:
    section = moe_section(hf, "config.json")
    block = MoEBlock(MoEConfig(**{k: v for k, v in section.items() if k != "family"}), hf["hidden_size"])
    placements = layer_placements(model_type, 0, section)
    targets = dict([*block.named_parameters(), *block.named_buffers()])
    with torch.no_grad():
        for p in placements:
            targets[p.ours][p.index].copy_(tensors[p.hub_key])
    return block, placements


def test_placements_cover_exactly_the_layers_moe_tensors_of_the_saved_files(saved):
    model_type, _, hf, tensors = saved
    prefix = "model.layers.0.block_sparse_moe." if model_type == "mixtral" else "model.layers.0.mlp."
    placements = layer_placements(model_type, 0, moe_section(hf, "config.json"))
    assert {p.hub_key for p in placements} == {k for k in tensors if k.startswith(prefix)}
    assert {p.expert for p in placements if p.expert is not None} == set(range(moe_section(hf, "x")["num_experts"]))


def test_files_placed_into_grouped_weights_equal_transformers_and_compute_its_layer(saved):
    model_type, model, hf, tensors = saved
    block, _ = block_from_files(model_type, hf, tensors)
    theirs = model.model.layers[0].mlp
    assert torch.equal(block.experts.gate_up_proj, theirs.experts.gate_up_proj)
    assert torch.equal(block.experts.down_proj, theirs.experts.down_proj)
    x = torch.randn(2, 6, hf["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(block(x)[0], theirs(x.clone()), rtol=1e-5, atol=1e-6)


def test_each_hub_tensor_reads_back_out_of_the_grouped_weights_bit_exact(saved):
    model_type, _, hf, tensors = saved
    block, placements = block_from_files(model_type, hf, tensors)
    ours = dict([*block.named_parameters(), *block.named_buffers()])
    for p in placements:
        assert torch.equal(ours[p.ours][p.index], tensors[p.hub_key]), p.hub_key


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "sigmoid"),
    ],
)
def test_an_moe_field_that_cannot_be_expressed_is_refused_in_one_line(change, named):
    hf = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, **change}
    with pytest.raises(HFConfigError, match=named) as e:
        moe_section(hf, "config.json")
    assert "\n" not in str(e.value) and "config.json" in str(e.value)
