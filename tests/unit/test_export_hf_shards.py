"""shardlab-export as a round trip: a Hugging Face folder of each family, loaded (model.pretrained) and saved by
shardlab without its weights changing, exports as shards whose tensors equal the source files' bit for bit (bf16),
with the source's tokenizer files and a config.json transformers reads as the same family. And the export's
bookkeeping: shards and index, a re-run replaces the earlier export, a cut-short one leaves it as it was, and the
Llama options that choose the family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint import hf_folder
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError
from shardlab.runner import run_rank
from shardlab_commands import export_hf
from shardlab_tasks.lm.hf.export_hf import export_refusal, family
from tests.hf_folders import FAMILIES, make_folder

transformers = pytest.importorskip("transformers")

# optimizer.lr=1e-30: the one step leaves every weight as read (w - 1e-30 rounds to w in fp32): a checkpoint of the
# loaded model, as training would save it.
UNCHANGED = ["optimization.max_steps=1", "checkpoint.interval_steps=1", "optimizer.lr=1e-30"]
UNCHANGED += ["lr_scheduler.warmup_steps=0", "validation.interval_steps=1"]


def source_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in hf_folder.weight_files(folder):
        state |= load_file(str(file))
    return {k: v for k, v in state.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}


@pytest.fixture(scope="module")
def loaded_checkpoints(tmp_path_factory, corpus_cache) -> dict[str, tuple[Path, Path]]:
    """family -> (its transformers-made folder, the step folder of a run that loaded it and did not change it)."""
    from shardlab.cli.preflight import compose_config
    from tests.conftest import TINY_LM

    root = tmp_path_factory.mktemp("roundtrip")
    out = {}
    for name in FAMILIES:
        folder = make_folder(name, root / name)
        cfg = compose_config([*TINY_LM, f"data.cache_dir={corpus_cache}", f"model.pretrained={folder}", *UNCHANGED])
        run_rank(cfg, root / f"run_{name}", dist_env.detect())
        out[name] = (folder, root / f"run_{name}" / "checkpoints" / "step_00000001")
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_load_then_export_gives_the_source_tensors_and_files(loaded_checkpoints, name, tmp_path):
    folder, checkpoint = loaded_checkpoints[name]
    out = export_hf.main([str(checkpoint), "--out", str(tmp_path / "hf"), "--dtype", "bf16", "--max-shard-mb", "0.02"])
    index = json.loads((out / hf_folder.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and sorted(p.name for p in out.glob("*.safetensors")) == files
    theirs, ours = source_tensors(folder), source_tensors(out)
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert ours[key].dtype == torch.bfloat16 and torch.equal(ours[key], tensor), key
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ours.values())
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / file).read_bytes() == (folder / file).read_bytes(), file
    source, written = (json.loads((f / "config.json").read_text()) for f in (folder, out))
    assert written["model_type"] == source["model_type"] and written["architectures"] == source["architectures"]
    hf = transformers.AutoConfig.from_pretrained(out)
    expected = transformers.AutoConfig.from_pretrained(folder)
    for key in ("vocab_size", "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(hf, key) == getattr(expected, key), key


def test_fp32_export_of_a_loaded_llama3_computes_the_source_models_logits(loaded_checkpoints, tmp_path):
    folder, checkpoint = loaded_checkpoints["llama3"]
    out = export_hf.main([str(checkpoint), "--out", str(tmp_path / "hf")])
    assert all(t.dtype == torch.float32 for t in source_tensors(out).values())
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [
            transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval()(tokens).logits
            for f in (folder, out)
        ]
    assert transformers.AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_export_again_replaces_the_earlier_one_and_a_cut_short_one_changes_nothing(
    loaded_checkpoints, tmp_path, monkeypatch
):
    _, checkpoint = loaded_checkpoints["qwen3"]
    out = tmp_path / "hf"
    export_hf.main([str(checkpoint), "--out", str(out), "--max-shard-mb", "0.02"])
    (out / "stale.txt").write_text("from an earlier export")
    export_hf.main([str(checkpoint), "--out", str(out), "--dtype", "bf16"])  # one shard now: the old ones are gone
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors") == ["model-00001-of-00001.safetensors"]
    assert not (out / "stale.txt").exists()
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(path, tensors, read, dtype, buffer_bytes):
        raise OSError("disk full")

    monkeypatch.setattr(hf_folder, "_write_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf.main([str(checkpoint), "--out", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left behind


def test_a_folder_that_is_no_export_is_refused_not_replaced(loaded_checkpoints, tmp_path):
    _, checkpoint = loaded_checkpoints["gpt2"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="holds files an export did not write \\(no shardlab_export.json\\)"):
        export_hf.main([str(checkpoint), "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_the_llama_options_choose_the_family_and_what_none_expresses_is_refused():
    llama = {"arch": "llama"}
    assert family(llama) == "llama" and family(llama, {"model_type": "mistral"}) == "mistral"
    assert family({**llama, "qk_norm": True}) == "qwen3"
    assert family({**llama, "qkv_bias": True}, {"model_type": "llama"}) == "qwen2"
    assert family({**llama, "qkv_bias": True, "out_bias": True}, {"model_type": "mistral"}) == "llama"  # no biases
    assert family({"arch": "gpt"}) == "gpt2"
    for ok in ({}, {"tie_embeddings": True, "rope_scaling": {"rope_type": "llama3"}, "head_dim": 32}):
        assert export_refusal({**llama, **ok}) is None
    assert "output bias alone" in export_refusal({**llama, "out_bias": True})
    assert "Qwen3's attention_bias" in export_refusal({**llama, "qk_norm": True, "qkv_bias": True})
