"""Every config.json field the families read is checked for its type and range: a wrong value is one line naming
config.json and the field (never a traceback, a truncation like head_dim=3.7 -> 3, or a NaN carried into the model),
and a shape too large to plan is refused from its fields before any module is built."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from shardlab_tasks.lm.hf.hf_fields import MAX_LAYERS
from shardlab_tasks.lm.hf.hf_models import HFConfigError, model_section
from tests.hf_folders import FAMILIES, MOE_FAMILIES

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, dict]:
    """family -> the config.json transformers writes for tests/hf_folders.py's small model of that family."""
    root = tmp_path_factory.mktemp("configs")
    out = {}
    for family, (config_class, kwargs) in {**FAMILIES, **MOE_FAMILIES}.items():
        getattr(transformers, config_class)(**kwargs).save_pretrained(root / family)
        out[family] = json.loads((root / family / "config.json").read_text())
    return out


PATH = Path("/models/x/config.json")
NAN, INF = math.nan, math.inf

LLAMA_FIELDS = [
    ("hidden_size", [-32, 0, 64.0, "64", True, None, 2**40]),
    ("num_attention_heads", [0, -4, 4.5, "4", [4]]),
    ("num_key_value_heads", [0, 2.5, "2"]),
    ("num_hidden_layers", [0, 2.0, "2", -1]),
    ("intermediate_size", [0, 96.5, "96"]),
    ("max_position_embeddings", [0, 256.0, "256"]),
    ("head_dim", [3.7, "abc", -16, 0, [16]]),
    ("rms_norm_eps", [NAN, INF, -1e-5, 0, "1e-5", [1e-5], True]),
    ("rope_theta", ["abc", [1], NAN, 0, -10000.0, {"a": 1}]),
    ("rope_scaling", [[1, 2], "llama3", 7]),
    ("rope_parameters", [[1, 2], "default"]),
    ("sliding_window", ["x", 0, 64.5, [64]]),
    ("attention_bias", ["false", 0, 1, [True]]),
    ("tie_word_embeddings", ["true", 1]),
    ("architectures", [[1], "LlamaForCausalLM", [None], {"a": 1}]),
    ("model_type", [["llama"], 7, None]),
    ("vocab_size", [0, 320.0, "320", -1]),
    ("hidden_act", [["silu"], 1]),
    ("mlp_bias", [0, "false"]),
    ("attention_dropout", [0.1, "0", False]),
    ("pretraining_tp", [2, "1", True]),
    ("use_sliding_window", [True, "false", 0]),
]
"""(field, wrong values) of a Llama-family config.json; each refused naming the field."""

LLAMA3_ROPE_FIELDS = [
    ("factor", [NAN, "8", -8.0, 0]),
    ("low_freq_factor", [INF, "1"]),
    ("high_freq_factor", [[4.0], None]),
    ("original_max_position_embeddings", ["64", 64.5, 0, NAN]),
]
"""(field of rope_parameters with rope_type llama3, wrong values)."""

GPT2_FIELDS = [
    ("n_embd", [-32, 64.5, "64", 0]),
    ("n_head", [0, 4.0, "4"]),
    ("n_layer", [0, 2.5, "2"]),
    ("n_positions", [0, "128", 128.0]),
    ("n_inner", [0, 256.5, "256", -1]),
    ("tie_word_embeddings", ["true", 0]),
    ("layer_norm_epsilon", [NAN, 1e-6, "1e-5"]),
    ("activation_function", ["relu", ["gelu_new"]]),
    ("scale_attn_weights", [False, 1, "true"]),
    ("scale_attn_by_inverse_layer_idx", [True, 0]),
    ("reorder_and_upcast_attn", [True, 0]),
    ("add_cross_attention", [True, "no"]),
    ("vocab_size", [0, 320.5]),
]
"""(field, wrong values) of a GPT-2 config.json."""

MOE_FIELDS = [
    ("num_experts_per_tok", [0, 2.5, "2", None, 5]),
    ("router_aux_loss_coef", [NAN, "0.02", -0.1, True]),
    ("router_jitter_noise", [0.1, "0", NAN]),
    ("decoder_sparse_step", [2, "1", 0]),
    ("mlp_only_layers", [[0]]),
]
"""(field, wrong values) of every MoE family's config.json (5 experts per token: more than the 4 there are)."""
MOE_FAMILY_FIELDS = {
    "mixtral": [("num_local_experts", [0, 4.0, "4", None]), ("attention_bias", [True])],
    "qwen2_moe": [
        ("num_experts", [0, 4.0, "4"]),
        ("moe_intermediate_size", [0, 16.5, "16", None]),
        ("shared_expert_intermediate_size", [0, "24", None]),
        ("norm_topk_prob", ["true", 1]),
        ("qkv_bias", ["true", 1]),
    ],
    "qwen3_moe": [("moe_intermediate_size", [0, 16.5, "16"]), ("norm_topk_prob", ["false", 0])],
}
"""(field, wrong values) of one MoE family's config.json."""


def cases():
    for family in ("llama3", "qwen2", "qwen3", "mistral", *MOE_FAMILIES):
        for field, values in LLAMA_FIELDS:
            # Qwen2-MoE writes sliding_window=0 beside use_sliding_window=false: no window, not a wrong one
            yield from (
                (family, field, field, v) for v in values if (family, field, v) != ("qwen2_moe", "sliding_window", 0)
            )
    for family in MOE_FAMILIES:
        for field, values in MOE_FIELDS + MOE_FAMILY_FIELDS[family]:
            yield from ((family, field, field, v) for v in values)
    for field, values in LLAMA3_ROPE_FIELDS:
        yield from (("llama3", f"rope_parameters.{field}", f"rope_parameters.{field}", v) for v in values)
    for field, values in GPT2_FIELDS:
        yield from (("gpt2", field, field, v) for v in values)


def changed(hf: dict, field: str, value) -> dict:
    hf = json.loads(json.dumps(hf))
    if "." in field:
        outer, inner = field.split(".")
        hf[outer][inner] = value
    else:
        hf[field] = value
    return hf


def test_every_family_config_reads_as_it_is_written(configs):
    for family, hf in configs.items():
        assert model_section(hf, PATH)["arch"] == ("gpt" if family == "gpt2" else "llama"), family


@pytest.mark.parametrize(("family", "field", "named", "value"), list(cases()), ids=repr)
def test_a_wrong_value_of_any_field_is_refused_in_one_line_naming_config_json_and_the_field(
    configs, family, field, named, value
):
    hf = changed(configs[family], field, value)
    with pytest.raises(HFConfigError) as refused:
        model_section(hf, PATH)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{PATH}: "), message
    assert re.search(rf"\b{re.escape(named.split('.')[-1])}\b", message) or (
        field == "architectures" and "architectures" in message
    ), message


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_a_width_the_heads_do_not_divide_needs_head_dim(configs, family):
    hf = changed(configs[family], "hidden_size", 66)
    hf.pop("head_dim", None)
    refusal = r"hidden_size=66 is not divisible by num_attention_heads=4 .* give head_dim"
    with pytest.raises(HFConfigError, match=refusal):
        model_section(hf, PATH)
    assert model_section({**hf, "head_dim": 16}, PATH)["head_dim"] == 16  # with head_dim: planned


def test_gpt2_width_not_divisible_by_heads_is_refused(configs):
    with pytest.raises(HFConfigError, match="n_embd=66 is not divisible by n_head=4"):
        model_section(changed(configs["gpt2"], "n_embd", 66), PATH)


@pytest.mark.parametrize(
    ("family", "changes", "words"),
    [
        ("llama3", {"num_hidden_layers": 2_000_000}, f"num_layers 2000000 is more than the {MAX_LAYERS}"),
        ("gpt2", {"n_layer": 2_000_000}, f"num_layers 2000000 is more than the {MAX_LAYERS}"),
        ("llama3", {"hidden_size": 2**23, "intermediate_size": 2**23, "num_hidden_layers": 4000}, "parameters"),
        ("qwen3_moe", {"num_experts": 2**24, "moe_intermediate_size": 2**20}, "parameters"),  # the experts counted
    ],
)
def test_a_shape_beyond_the_plans_bound_is_refused_from_its_fields(configs, family, changes, words):
    hf = {**configs[family], **changes}
    with pytest.raises(HFConfigError, match=words):
        model_section(hf, PATH)
