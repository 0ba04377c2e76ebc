"""model.pretrained: a Hugging Face folder of each family as shardlab's model, computing what transformers computes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardlab.cli.preflight import compose_config
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.errors import CheckpointError, ConfigError
from shardlab.runner import build_task
from tests.hf_folders import FAMILIES, make_folder, reference

SEQ = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_folder(family, root / family) for family in FAMILIES}


def task_of(folder: Path, *overrides: str):
    cfg = compose_config([f"model.pretrained={folder}", f"data.seq_len={SEQ}", *overrides])
    return build_task(cfg, world_size=1)


def loaded(task) -> torch.nn.Module:
    """The task's model as a single-process run has it: built on meta, materialized, then the folder read into it."""
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    assert task.load_pretrained(model, torch.device("cpu")) == task.pretrained
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gives_transformers_logits_and_loss_from_its_bf16_shards(folders, family):
    folder = folders[family]
    assert len(list(folder.glob("*.safetensors"))) >= 3
    task = task_of(folder)
    model = loaded(task)
    tokens = torch.randint(0, 257, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    logits, loss = reference(folder, tokens)
    with torch.no_grad():
        ours = model(tokens[:, :-1])
        our_loss, _ = task.loss(model, tokens, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # bf16 files into fp32 master weights
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(our_loss, loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("llama3", {"arch": "llama", "num_kv_heads": 2, "tie_embeddings": False, "rope_theta": 500000.0}),
        ("llama3_tied", {"tie_embeddings": True, "qkv_bias": False, "out_bias": False}),
        ("qwen2", {"qkv_bias": True, "out_bias": False, "tie_embeddings": True, "rope_scaling": None}),
        ("qwen3", {"qk_norm": True, "head_dim": 32, "dim": 64, "qkv_bias": False}),
        ("mistral", {"head_dim": None, "max_seq_len": 64, "ffn_dim": 96}),  # the sliding window bounds the length
        ("gpt2", {"arch": "gpt", "mlp_ratio": 4.0, "max_seq_len": 128, "tie_embeddings": True}),
    ],
)
def test_config_json_decides_the_model_section_and_the_folders_tokenizer_is_used(folders, family, expected):
    task = task_of(folders[family])
    m = task.cfg.model
    assert {k: m[k] for k in expected} == expected
    assert m.vocab_size == 320 and m.num_layers == 2
    assert task.cfg.data.tokenizer == str(folders[family] / "tokenizer.json")
    assert task.tokenizer.eod == 256 and task.cfg.data.eod_token == "<|endoftext|>"
    if family.startswith("llama3"):
        assert dict(m.rope_scaling) == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }


def with_config(folders, tmp_path: Path, family: str, **changes) -> Path:
    folder = tmp_path / family
    shutil.copytree(folders[family], folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("llama3", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("llama3", {"mlp_bias": True}, "mlp_bias=True is not supported"),
        ("llama3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not implemented"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ("gpt2", {"activation_function": "relu"}, "activation_function='relu' is not supported"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ("llama3", {"model_type": "t5"}, "model_type='t5' is not a family shardlab loads"),
        ("llama3", {"hidden_size": None}, "hidden_size=absent must be an integer from 1"),
        ("llama3", {"rms_norm_eps": float("nan")}, "rms_norm_eps=nan must be a finite number > 0"),
        ("qwen3", {"head_dim": 3.7}, "head_dim=3.7 must be an integer"),
        ("llama3", {"num_hidden_layers": 2_000_000}, "num_layers 2000000 is more than the 4096 shardlab plans"),
    ],
)
def test_a_field_shardlab_cannot_express_is_refused_in_one_line_naming_it(folders, tmp_path, family, changes, message):
    folder = with_config(folders, tmp_path, family, **changes)
    with pytest.raises(ConfigError, match=message) as error:
        task_of(folder)
    assert "\n" not in str(error.value) and str(folder / "config.json") in str(error.value)


def test_weights_that_do_not_fit_are_refused_before_any_tensor_is_read(folders, tmp_path):
    folder = with_config(folders, tmp_path, "qwen3", intermediate_size=128)  # config.json no longer fits the shards
    task = task_of(folder)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(
        CheckpointError, match=r"model.pretrained: .*mlp.gate_proj.weight is \[96, 64\], the model's is"
    ):
        task.load_pretrained(model, torch.device("cpu"))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_config_json_alone_plans_but_does_not_train(folders, tmp_path):
    folder = tmp_path / "config_only"
    folder.mkdir()
    shutil.copy(folders["llama3"] / "config.json", folder)
    with pytest.raises(ConfigError, match="holds no .safetensors weights; a config.json alone plans"):
        task_of(folder)
    task_of(folder, "dry_run=true")


def test_pretrained_and_init_from_together_are_refused(folders, tmp_path):
    with pytest.raises(ConfigError, match="model.pretrained and checkpoint.init_from both give the starting weights"):
        task_of(folders["gpt2"], f"checkpoint.init_from={tmp_path}")


LLAMA31_8B = Path(__file__).parents[1] / "data" / "llama3_1_8b"


def test_llama_3_1_8b_config_json_alone_plans_for_8_h100s(capsys):
    from shardlab.runner import print_plan

    overrides = [
        "distributed=fully_sharded", "distributed.world_size=8", "distributed.plan_device=h100_80gb",
        "distributed.precision=bf16", "data.seq_len=4096", "optimization.batch_size=8", "validation.batch_size=8",
        "dry_run=true",
    ]  # fmt: skip
    task = task_of(LLAMA31_8B, *overrides)
    m = task.cfg.model
    assert (m.arch, m.num_layers, m.dim, m.num_heads, m.num_kv_heads, m.ffn_dim) == ("llama", 32, 4096, 32, 8, 14336)
    assert (m.vocab_size, m.max_seq_len, m.rope_theta, m.rope_scaling.rope_type) == (128256, 131072, 5e5, "llama3")
    print_plan(task.cfg, task)
    out = capsys.readouterr().out
    assert "8.03B" in out or "8,030,261,248" in out, out
    assert "h100_80gb" in out, out
