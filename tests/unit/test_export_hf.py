"""shardlab-export: a trained checkpoint loads in transformers as GPT-2 or Llama and computes what shardlab
computes."""

from __future__ import annotations

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError
from shardlab.runner import run_rank
from shardlab_commands import export_hf, generate, preprocess_lm
from shardlab_tasks.lm.hf.export_hf import export_refusal

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE trained by the preprocessing tool on 1 MB of the embedded corpus."""
    cache = tmp_path_factory.mktemp("bpe")
    out = preprocess_lm.main(
        ["--train-tokenizer", "bpe", "--vocab-size", "500", "--tokenizer-sample-mb", "1", "--max-corpus-mb", "1"]
        + ["--cache-dir", str(cache), "--workers", "0"]
    )
    return str(out / "tokenizer.json")


# Grouped-query attention, a rope_theta and rms_norm_eps other than transformers' defaults, a SwiGLU width of its own.
LLAMA = [
    "model=llama_tiny",
    "model.num_kv_heads=2",
    "model.ffn_dim=96",
    "model.rope_theta=500000",
    "model.norm_eps=1e-6",
]
EXPORTS = {
    "gpt2_bpe_tied": ("bpe", "GPT2LMHeadModel", ["model.tie_embeddings=true"]),
    "gpt2_byte_untied": ("byte", "GPT2LMHeadModel", ["model.tie_embeddings=false"]),
    "llama_bpe": ("bpe", "LlamaForCausalLM", LLAMA),
}


@pytest.mark.parametrize("name", EXPORTS)
def test_exported_model_matches_shardlab_logits_and_greedy_tokens(name, tiny_lm, bpe_tokenizer, tmp_path):
    tokenizer, hf_class, model_overrides = EXPORTS[name]
    spec = bpe_tokenizer if tokenizer == "bpe" else "byte"
    cfg = tiny_lm(f"data.tokenizer={spec}", *model_overrides, "optimization.max_steps=6", "checkpoint.interval_steps=6")
    run_rank(cfg, tmp_path / "run", dist_env.detect())
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000006"
    out = export_hf.main([str(checkpoint), "--out", str(tmp_path / "hf")])

    ours, task, _ = generate.load_model(checkpoint)
    task.prepare_data()
    batch = torch.stack([task.valid_dataset[i] for i in range(4)])[:, :-1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class
    assert hf.config.tie_word_embeddings == cfg.model.get("tie_embeddings", False)
    with torch.no_grad():
        theirs, mine = hf(batch).logits, ours(batch)
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-5)
    assert (theirs - mine).abs().max() <= 1e-4

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def main(argv):\n    return  'déjà vu ✓'\n"
    assert hf_tok(text)["input_ids"] == task.tokenizer.encode(text)
    assert hf_tok.decode(task.tokenizer.encode(text)) == text
    assert hf_tok.eos_token_id == task.tokenizer.eod

    prompt = task.tokenizer.encode("import ")
    expected = generate.generate_ids(ours, task.tokenizer, prompt, 16, 0, 1.0, 32, torch.Generator())
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
    if got[-1] == task.tokenizer.eod:  # transformers keeps the end token, shardlab stops before it
        got = got[:-1]
    assert got == expected and len(expected) > len(prompt)


def test_configs_no_hugging_face_architecture_expresses_are_refused_with_a_reason():
    base = {"arch": "gpt", "dim": 64, "mlp_ratio": 4.0}
    assert export_refusal(base) is None and export_refusal({"arch": "llama"}) is None
    assert "fractional" in export_refusal({**base, "mlp_ratio": 1.01})
    assert "model.arch='mine' has no Hugging Face counterpart" in export_refusal({**base, "arch": "mine"})


def test_export_of_a_non_checkpoint_directory_is_a_one_line_error(tmp_path):
    from shardlab.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not a complete shardlab checkpoint"):
        export_hf.main([str(tmp_path), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
    assert ConfigError  # the refusals above are ConfigErrors, printed by run_tool as one line
