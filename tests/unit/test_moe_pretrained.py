"""model.pretrained with a Hugging Face folder of a mixture of experts (issue 49): Mixtral, Qwen2-MoE (its gated
shared expert) and Qwen3-MoE (q/k norms) that transformers builds and saves in bf16 as >= 3 shards, one tensor per
expert, read into shardlab's grouped experts on one process: logits equal transformers' (fp32, rtol 1e-4) and the
first step's loss, the auxiliary loss included, equals transformers' (``output_router_logits=True``). DeepSeek-V3,
gpt-oss and a field an MoE block cannot express are refused in one line before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardlab.errors import CheckpointError, ConfigError
from shardlab_tasks.lm.hf.hf_models import expert_pieces, weight_names
from tests.hf_folders import MOE_FAMILIES, make_folder, moe_reference
from tests.unit.test_hf_pretrained import SEQ, loaded, task_of

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_hf")
    return {family: make_folder(family, root / family, max_shard_size="20KB") for family in MOE_FAMILIES}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_moe_family_gives_transformers_logits_and_loss_with_its_aux_loss(folders, family):
    folder = folders[family]
    assert len(list(folder.glob("*.safetensors"))) >= 3
    task = task_of(folder)
    model = loaded(task)
    tokens = torch.randint(0, 257, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    logits, cross_entropy, aux = moe_reference(folder, tokens)
    with torch.no_grad():
        ours = model(tokens[:, :-1])
        model.take_routing_stats()
        our_loss, sums = task.loss(model, tokens, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # bf16 files into fp32 master weights
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-5)
    assert sums["moe_aux_sum"] > 0  # the auxiliary loss is in the compared loss, not zero
    torch.testing.assert_close(our_loss, cross_entropy + aux, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("family", "expected", "moe"),
    [
        ("mixtral", {"qkv_bias": False, "qk_norm": False}, {"num_experts": 4, "top_k": 2, "ffn_dim": 16}),
        (
            "qwen2_moe",
            {"qkv_bias": True, "out_bias": False},
            {"shared_ffn_dim": 24, "shared_expert_gate": True, "norm_topk_prob": False},
        ),
        ("qwen3_moe", {"qk_norm": True, "head_dim": 16}, {"norm_topk_prob": True, "aux_loss_coef": 0.02}),
    ],
)
def test_config_json_decides_the_moe_section_and_every_hub_tensor_has_its_place(folders, family, expected, moe):
    m = task_of(folders[family]).cfg.model
    assert {k: m[k] for k in expected} == expected and {k: m.moe[k] for k in moe} == moe
    index = json.loads((folders[family] / "model.safetensors.index.json").read_text())["weight_map"]
    single = {hf.key for hf in weight_names(m).values()}
    pieces = [key for parts in expert_pieces(m).values() for key, _ in parts]
    assert len(pieces) == len(set(pieces)) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert sorted(single | set(pieces)) == sorted(index)


def with_config(folder: Path, tmp_path: Path, config: dict) -> Path:
    """``folder``'s weights beside another config.json."""
    out = tmp_path / "changed"
    shutil.copytree(folder, out)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("qwen3_moe", {"num_experts_per_tok": 2.5}, "num_experts_per_tok=2.5 must be an integer"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than the experts there are"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not implemented"),
        ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen2_moe", {"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size=absent"),
        ("qwen3_moe", {"norm_topk_prob": "true"}, "norm_topk_prob='true' must be true or false"),
        ("mixtral", {"attention_bias": True}, "attention_bias=true is not Mixtral's"),
    ],
)
def test_an_moe_field_shardlab_cannot_express_is_refused_in_one_line(folders, tmp_path, family, changes, message):
    config = json.loads((folders[family] / "config.json").read_text())
    config |= changes
    folder = with_config(folders[family], tmp_path, {k: v for k, v in config.items() if v is not None})
    with pytest.raises(ConfigError, match=message) as error:
        task_of(folder)
    assert "\n" not in str(error.value) and str(folder / "config.json") in str(error.value)


@pytest.mark.parametrize(
    ("config_class", "missing"),
    [("DeepseekV3Config", "multi-head latent attention"), ("GptOssConfig", "attention sinks")],
)
def test_deepseek_v3_and_gpt_oss_are_refused_naming_what_is_missing_before_any_weight_is_read(
    folders, tmp_path, config_class, missing
):
    config = getattr(transformers, config_class)(num_hidden_layers=2, hidden_size=32).to_dict()
    folder = with_config(folders["mixtral"], tmp_path, config)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not read")  # a weight read would fail otherwise: the refusal comes first
    with pytest.raises(ConfigError, match=f"model_type='{config['model_type']}' is not loaded: .*{missing}") as e:
        task_of(folder)
    assert "\n" not in str(e.value)


def test_expert_weights_that_do_not_fit_are_refused_before_any_tensor_is_read(folders, tmp_path):
    from shardlab.distributed.materialize import materialize
    from shardlab.distributed.units import model_on_meta

    config = json.loads((folders["qwen3_moe"] / "config.json").read_text())
    folder = with_config(folders["qwen3_moe"], tmp_path, {**config, "moe_intermediate_size": 8})
    task = task_of(folder)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"experts.0.gate_proj.weight is \[16, 32\], the model's is \[8, 32\]"):
        task.load_pretrained(model, torch.device("cpu"))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


QWEN3_30B_A3B = Path(__file__).parents[1] / "data" / "qwen3_30b_a3b"
"""Qwen3-30B-A3B's published config.json (Qwen/Qwen3-30B-A3B on the Hub), without its weights."""


def test_qwen3_30b_a3b_config_json_alone_reads_as_its_published_moe_and_plans(capsys):
    from shardlab.runner import print_plan

    task = task_of(QWEN3_30B_A3B, "distributed=fully_sharded", "distributed.world_size=8",
                   "distributed.plan_device=h100_80gb", "distributed.precision=bf16", "dry_run=true")  # fmt: skip
    m = task.cfg.model
    assert (m.num_layers, m.dim, m.num_heads, m.num_kv_heads, m.head_dim, m.qk_norm) == (48, 2048, 32, 4, 128, True)
    moe = (m.moe.num_experts, m.moe.top_k, m.moe.ffn_dim, m.moe.norm_topk_prob, m.moe.aux_loss_coef)
    assert moe == (128, 8, 768, True, 0.001)
    print_plan(task.cfg, task)
    assert "30,532,122,624 parameters" in capsys.readouterr().out  # the published 30.5B total
