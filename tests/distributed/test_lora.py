"""LoRA on 2 fully_sharded ranks (CPU, gloo), from a Hugging Face folder: only the adapters are reduced, stepped and
saved; a resume reads the frozen base again from the folder and continues the same curve; the saved adapter loads in
peft on the transformers model, and its merged export in transformers alone, with the trained model's logits."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from shardlab.checkpoint.readers import dcp_reader
from shardlab_commands import export_hf
from shardlab_tasks.lm.models.lora import is_adapter
from tests.distributed.harness import run_spawned
from tests.hf_folders import make_folder

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[attn.*,mlp.*]"]


def inspect(trainer) -> dict:
    """Rank 0's view after fit: which parameters the optimizer holds and which get a gradient in a fresh backward
    (FSDP2 gives a sharded parameter its .grad from the reduce-scatter, so these are the tensors reduced), and the
    trained model's logits on a fixed batch."""
    model, task, cfg = trainer.model, trainer.task, trainer.cfg
    names = {id(p): n for n, p in model.named_parameters()}
    sharded = all(isinstance(p, DTensor) for p in model.parameters())  # before the forward below gathers the last unit
    in_optimizer = sorted(names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"])
    tokens = torch.randint(0, 257, (2, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(1))
    trainer.optimizer.zero_grad(set_to_none=True)
    task.loss(model, tokens, trainer.backend.device)[0].backward()
    reduced = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    trainer.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    resumed = str(trainer.resumed_from) if trainer.resumed_from else None
    return {
        "resumed_from": resumed,
        "in_optimizer": in_optimizer,
        "reduced": reduced,
        "tokens": tokens,
        "logits": logits,
        "sharded": sharded,
    }


def _bytes(step_dir) -> tuple[int, int]:
    """(bytes of the step folder's files, bytes of the tensors it holds, from its index)."""
    saved = dcp_reader.read_metadata(step_dir, values=False).state_dict_metadata.values()
    tensors = [m for m in saved if isinstance(m, TensorStorageMetadata)]
    held = sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors)
    return sum(f.stat().st_size for f in step_dir.iterdir() if f.is_file()), held


def test_lora_on_two_sharded_ranks_steps_saves_and_resumes_only_the_adapters(tiny_lm, tmp_path):
    import peft
    import transformers

    folder = make_folder("llama3", tmp_path / "llama3")
    common = [
        "distributed=fully_sharded", "distributed.world_size=2", "optimizer.lr=1e-2", "lr_scheduler=constant",
        "checkpoint.interval_steps=2", "validation.interval_steps=0", f"model.pretrained={folder}",
    ]  # fmt: skip
    lora = tiny_lm(*common, *LORA, "optimization.max_steps=2")
    cfgs = [
        lora,  # saves step 2
        tiny_lm(*common, *LORA, "optimization.max_steps=3"),  # resumes it: adapters from step 2, the base re-read
        tiny_lm(*common, *LORA, "optimization.max_steps=3"),  # the same 3 steps without a stop
        tiny_lm(*common, "optimization.max_steps=2"),  # full fine-tuning, for the checkpoint's size
    ]
    run_dirs = [tmp_path / "lora", tmp_path / "lora", tmp_path / "straight", tmp_path / "full"]
    first, resumed, straight, full = run_spawned(cfgs, 2, run_dirs=run_dirs, inspect=inspect)

    adapters = sorted(n for n in first["in_optimizer"] if is_adapter(n))
    assert first["sharded"] and adapters and first["in_optimizer"] == adapters  # the optimizer: adapters only
    assert first["reduced"] == adapters  # gradients (the reduce-scatter): adapters only
    step = tmp_path / "lora" / "checkpoints" / "step_00000002"
    saved = dcp_reader.read_metadata(step, values=False).state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert model_keys == set(adapters)  # the step folder: adapters only, and their optimizer state
    optim_state = [k.removeprefix("optim.state.") for k in saved if k.startswith("optim.state.")]
    assert optim_state and all(is_adapter(k) for k in optim_state)
    lora_bytes, full_bytes = _bytes(step), _bytes(tmp_path / "full" / "checkpoints" / "step_00000002")
    # 7,424 adapter parameters of ~110k (two layers of width 64, rank 4 on all 7 linears): weights and two Adam
    # moments each; the files add DCP's per-tensor framing, which dominates at this size.
    print(f"checkpoint bytes (files, tensors): LoRA {lora_bytes}, full fine-tuning {full_bytes}")
    assert lora_bytes[1] * 10 < full_bytes[1] and lora_bytes[0] * 3 < full_bytes[0], (lora_bytes, full_bytes)

    assert resumed["resumed_from"].endswith("step_00000002")
    loss = {name: [r["loss"] for r in run["history"] if r["split"] == "train"] for name, run in
            (("resumed", resumed), ("straight", straight))}  # fmt: skip
    assert loss["resumed"][-1] == loss["straight"][-1]  # the base re-read exactly: the same step 3
    torch.testing.assert_close(resumed["logits"], straight["logits"], rtol=0, atol=0)

    adapter = export_hf.main([str(step), "--adapter-only", "--out", str(tmp_path / "adapter")])
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=first["tokens"][:, :-1]).logits
    torch.testing.assert_close(first["logits"], theirs, rtol=1e-4, atol=1e-5)
    # the merged export (base from model.pretrained, adapters folded in as it streams): a plain transformers model
    merged = export_hf.main([str(step), "--out", str(tmp_path / "merged"), "--buffer-mb", "0.05"])
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=first["tokens"][:, :-1]).logits, first["logits"], rtol=1e-4, atol=1e-5
        )
