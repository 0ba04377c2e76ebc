"""shardlab-export for mixtures of experts (issue 49): a Mixtral, Qwen2-MoE or Qwen3-MoE folder loaded by shardlab
and saved without its weights changing exports the hub's per-expert tensors (written back out of the grouped
experts) bit-equal to the source files; a few fine-tuning steps later, the export is a folder transformers loads as
the same family, computing shardlab's logits. And the MoE options no exported family expresses are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint import hf_folder
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab_commands import export_hf, generate
from shardlab_tasks.lm.hf.export_hf import export_refusal
from tests.hf_folders import MOE_FAMILIES, make_folder
from tests.unit.test_export_hf_shards import UNCHANGED, source_tensors

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_cache) -> dict[str, tuple[Path, Path, Path]]:
    """family -> (its transformers-made folder, the step folder of a run that loaded it and changed nothing, the
    step folder of a run that fine-tuned it for 3 steps)."""
    from shardlab.cli.preflight import compose_config
    from tests.conftest import TINY_LM

    root = tmp_path_factory.mktemp("moe_export")
    out = {}
    for name in MOE_FAMILIES:
        folder = make_folder(name, root / name, max_shard_size="20KB")
        common = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"model.pretrained={folder}", "data.seq_len=32"]
        run_rank(compose_config([*common, *UNCHANGED]), root / f"same_{name}", dist_env.detect())
        tuned = ["optimization.max_steps=3", "checkpoint.interval_steps=3", "optimizer.lr=1e-2"]
        run_rank(compose_config([*common, *tuned]), root / f"tuned_{name}", dist_env.detect())
        steps = (root / f"same_{name}" / "checkpoints" / "step_00000001", root / f"tuned_{name}" / "checkpoints")
        out[name] = (folder, steps[0], steps[1] / "step_00000003")
    return out


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_load_then_export_gives_the_hub_per_expert_tensors_bit_equal(runs, name, tmp_path):
    folder, checkpoint, _ = runs[name]
    out = export_hf.main([str(checkpoint), "--out", str(tmp_path / "hf"), "--dtype", "bf16", "--max-shard-mb", "0.02"])
    index = json.loads((out / hf_folder.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 3
    theirs, ours = source_tensors(folder), source_tensors(out)
    assert sorted(ours) == sorted(theirs) and any(".experts.3." in key for key in ours)
    for key, tensor in theirs.items():
        assert ours[key].dtype == torch.bfloat16 and torch.equal(ours[key], tensor), key
    source, written = (json.loads((f / "config.json").read_text()) for f in (folder, out))
    assert written["model_type"] == source["model_type"] and written["architectures"] == source["architectures"]
    hf, expected = (transformers.AutoConfig.from_pretrained(f) for f in (out, folder))
    for key in ("num_experts_per_tok", "router_aux_loss_coef", "intermediate_size", "norm_topk_prob", "qkv_bias"):
        assert getattr(hf, key, None) == getattr(expected, key, None), key
    for key in ("num_local_experts", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(hf, key, None) == getattr(expected, key, None), key


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_a_fine_tuned_moe_exports_as_a_folder_transformers_computes_as_shardlab(runs, name, tmp_path):
    folder, _, checkpoint = runs[name]
    out = export_hf.main([str(checkpoint), "--out", str(tmp_path / "hf")])
    ours, task, _ = generate.load_model(checkpoint)
    task.prepare_data()
    batch = torch.stack([task.valid_dataset[i] for i in range(2)])[:, :-1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    source = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf) is type(source)
    with torch.no_grad():
        theirs, mine, before = hf(batch).logits, ours(batch), source(batch).logits
    assert (mine - before).abs().max() > 1e-3  # the fine-tuning changed the model: the export is not the source
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"score_func": "sigmoid"}, "DeepSeek-V3's"),
        ({"routed_scaling": 2.5}, "routed_scaling=2.5"),
        ({"norm_topk_prob": False}, "Mixtral's"),
        ({"shared_ffn_dim": 8}, "shared expert is gated"),
    ],
)
def test_moe_options_no_exported_family_expresses_are_refused(change, reason):
    moe = {"score_func": "softmax", "norm_topk_prob": True, "shared_ffn_dim": 0, "shared_expert_gate": False}
    model = {"arch": "llama", "qkv_bias": False, "out_bias": False, "qk_norm": False, "moe": {**moe, **change}}
    assert reason in export_refusal(model)
    assert export_refusal({**model, "moe": moe}) is None


def test_lora_on_an_moe_trains_its_adapters_and_both_exports_load_with_the_trained_models_logits(
    runs, tiny_lm, tmp_path
):
    """LoRA on attention and on Qwen2-MoE's shared expert of a loaded MoE: the merged export (the base's experts
    read back from the hub folder and written out again) and the peft adapter on transformers' model of the source
    folder compute what the trained shardlab model computes."""
    import peft

    from tests.unit.test_lora import LORA, trained

    folder = runs["qwen2_moe"][0]
    cfg = tiny_lm(f"model.pretrained={folder}", *LORA, "model.lora.target_modules=[attn.*,mlp.shared.*]",
                  "optimization.max_steps=2", "checkpoint.interval_steps=2", "optimizer.lr=1e-2", "data.seq_len=32",
                  "validation.interval_steps=0")  # fmt: skip
    run_rank(cfg, tmp_path / "lora", dist_env.detect())
    step = tmp_path / "lora" / "checkpoints" / "step_00000002"
    merged = export_hf.main([str(step), "--out", str(tmp_path / "merged"), "--max-shard-mb", "0.02"])
    adapter = export_hf.main([str(step), "--adapter-only", "--out", str(tmp_path / "adapter")])
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.1.mlp.shared_expert.up_proj" in targets and "model.layers.0.self_attn.q_proj" in targets
    _, model = trained(step)
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(input_ids=x).logits
        ours = model(x)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(x).logits
        with_peft = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=x).logits
    assert (ours - before).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(with_peft, ours, rtol=1e-4, atol=1e-5)


def test_an_moe_trained_from_scratch_exports_as_mixtral_computing_its_logits(tiny_lm, tmp_path):
    """model=moe_tiny (no folder: no q/k norms, no shared expert) exports as a Mixtral, the expert width and count,
    top-k and aux coefficient in its config.json, the logits shardlab's."""
    cfg = tiny_lm("model=moe_tiny", "model.num_layers=2", "model.dim=48", "model.num_heads=4", "model.num_kv_heads=2",
                  "model.moe.num_experts=4", "model.moe.ffn_dim=24", "optimization.max_steps=2",
                  "checkpoint.interval_steps=2", "optimizer.lr=1e-2", "validation.interval_steps=0")  # fmt: skip
    run_rank(cfg, tmp_path / "run", dist_env.detect())
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    out = export_hf.main([str(step), "--out", str(tmp_path / "hf")])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["intermediate_size"], config["num_experts_per_tok"]) == (4, 24, 2)
    assert config["router_aux_loss_coef"] == 0.02
    ours, task, _ = generate.load_model(step)
    task.prepare_data()
    batch = torch.stack([task.valid_dataset[i] for i in range(2)])[:, :-1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(batch).logits, ours(batch), rtol=1e-4, atol=1e-5)
