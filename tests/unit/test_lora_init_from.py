"""The merged export of a LoRA run whose frozen base came from checkpoint.init_from (shardlab's own weights: a step
folder or a consolidated .safetensors), not model.pretrained: shardlab-export reads the base from there, folds the
adapters in, and transformers computes the trained run's logits and peft's on the exported base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from shardlab.checkpoint import weights
from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.runner import build_task, run_rank
from shardlab_tasks.lm.models.lora import is_adapter
from tests.conftest import TINY_LM

RUN = ["optimization.max_steps=2", "checkpoint.interval_steps=2", "validation.interval_steps=0"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=1e-2"]
MODELS = {"llama": ["model=llama_tiny", "model.lora.target_modules=[attn.*,mlp.*]"], "gpt": []}
"""Llama (untied, renamed on export) and GPT-2 (tied embeddings, Conv1D weights written transposed); gpt's default
targets are attn.* (attn.qkv, attn.proj)."""


def train(run_dir: Path, corpus_cache: str, *overrides: str) -> Path:
    """A 2-step run; its step folder."""
    cfg = compose_config([*TINY_LM, f"data.cache_dir={corpus_cache}", *RUN, *overrides])
    run_rank(cfg, run_dir, dist_env.detect())
    return run_dir / "checkpoints" / "step_00000002"


@pytest.fixture(scope="module", params=sorted(MODELS))
def runs(request, tmp_path_factory, corpus_cache) -> dict:
    """A full run (the base), its weights consolidated into one file, and a LoRA run begun from each."""
    from shardlab_commands import consolidate

    arch, root = request.param, tmp_path_factory.mktemp(f"init_from_{request.param}")
    model = MODELS[arch]
    base = train(root / "base", corpus_cache, *model[:1])
    file = consolidate.main([str(base), "--out", str(root / "base.safetensors")])
    lora = {
        kind: train(root / f"lora_{kind}", corpus_cache, *model, *LORA, f"checkpoint.init_from={source}")
        for kind, source in (("step_folder", base), ("file", file))
    }
    return {"arch": arch, "base": base, "lora": lora, "root": root}


def trained_model(step: Path) -> torch.nn.Module:
    """The LoRA run's model as it trained: the base read from its checkpoint.init_from, the adapters from ``step``."""
    cfg = OmegaConf.create(weights.describe(step)["config"])
    task = build_task(cfg, world_size=1)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=cfg.seed)
    weights.load_into(model, Path(cfg.checkpoint.init_from), keys=lambda key: not is_adapter(key))
    saved = weights.read_full(step)
    assert saved and all(is_adapter(k) for k in saved)  # the step folder: adapters only
    model.load_state_dict(saved, strict=False)
    return model.eval()


@pytest.mark.parametrize("kind", ["step_folder", "file"])
def test_merged_export_of_a_lora_run_begun_from_init_from_computes_the_trained_logits_and_peft_s(runs, kind, tmp_path):
    import peft
    import transformers

    from shardlab_commands import export_hf

    step = runs["lora"][kind]
    out = export_hf.main(
        [str(step), "--out", str(tmp_path / "merged"), "--max-shard-mb", "0.05", "--buffer-mb", "0.01"]
    )
    assert len(list(out.glob("*.safetensors"))) >= 3 and not (out / "adapter_config.json").exists()
    adapter = export_hf.main([str(step), "--adapter-only", "--out", str(tmp_path / "adapter")])
    plain = export_hf.main([str(runs["base"]), "--out", str(tmp_path / "base")])  # the base as transformers has it
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs, before = trained_model(step)(x), merged(input_ids=x).logits, base(input_ids=x).logits
        with_peft = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=x).logits
    assert not torch.allclose(ours, before, atol=1e-3)  # the adapters trained away from the base
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(theirs, with_peft, rtol=1e-4, atol=1e-5)


def test_merged_export_reads_the_init_from_base_again_and_refuses_one_that_moved(runs, tmp_path):
    from shardlab.errors import ConfigError
    from shardlab_commands import export_hf

    step = runs["lora"]["step_folder"]
    first = export_hf.main([str(step), "--out", str(tmp_path / "first")])
    moved = runs["root"] / "moved_base"
    runs["base"].rename(moved)
    try:
        with pytest.raises(ConfigError, match=r"checkpoint.init_from=.*step_00000002, the frozen base .* pass --base"):
            export_hf.main([str(step), "--out", str(tmp_path / "refused")])
        again = export_hf.main([str(step), "--base", str(moved), "--out", str(tmp_path / "again")])
    finally:
        moved.rename(runs["base"])
    assert not (tmp_path / "refused").exists()
    for file in sorted(first.glob("*.safetensors")):
        assert (again / file.name).read_bytes() == file.read_bytes(), file.name
