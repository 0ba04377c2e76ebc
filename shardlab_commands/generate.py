"""Sample text from a language-model checkpoint, to see what a run learned.

    shardlab-generate runs/lm/default/checkpoints/step_00000300 --prompt "def " --max-new-tokens 200
    shardlab-generate runs/lm/default/checkpoints/step_00000300 --top-k 0     # greedy
    shardlab-generate model.safetensors                                        # from shardlab-consolidate

Works with checkpoints from any backend and world size (DCP loads them into one process).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import OmegaConf

from shardlab.checkpoint import weights
from shardlab.distributed.materialize import materialize
from shardlab.errors import ShardlabError
from shardlab.runner import build_task
from shardlab.train import run_tool


@torch.no_grad()
def generate_ids(
    model,
    tokenizer,
    ids: list[int],
    max_new_tokens: int,
    top_k: int,
    temperature: float,
    max_seq_len: int,
    generator: torch.Generator,
) -> list[int]:
    """``ids`` continued by up to ``max_new_tokens`` tokens, stopping before an end-of-document token. Ids above the
    tokenizer's vocabulary (the model's padding to a multiple of 64) are never drawn."""
    seq = torch.tensor([ids or [tokenizer.eod]])
    for _ in range(max_new_tokens):
        logits = model(seq[:, -max_seq_len:])[0, -1, : tokenizer.vocab_size].float()
        if top_k <= 0:
            next_id = logits.argmax()
        else:
            values, indices = logits.topk(min(top_k, logits.numel()))
            probs = torch.softmax(values / max(temperature, 1e-6), dim=-1)
            next_id = indices[torch.multinomial(probs, 1, generator=generator)][0]
        if int(next_id) == tokenizer.eod:
            break
        seq = torch.cat([seq, next_id.view(1, 1)], dim=1)
    return seq[0].tolist()


def sample(model, tokenizer, prompt: str, *args, **kwargs) -> str:
    """The prompt and its continuation as text, decoded by the tokenizer the model was trained with."""
    return tokenizer.decode(generate_ids(model, tokenizer, tokenizer.encode(prompt), *args, **kwargs))


def load_model(checkpoint: Path, user_dir: str | None = None):
    """The model of a step_N checkpoint or a consolidated .safetensors file, in one process on the CPU, with the
    config it was trained with (``user_dir``: the plug-ins of a run that had them)."""
    info = weights.describe(checkpoint)
    cfg = weights.training_config(checkpoint, info, user_dir)
    task = build_task(cfg, world_size=1)
    if task.unit != "tokens":
        raise ShardlabError(f"{checkpoint} is a {cfg.task.name} checkpoint; generate.py samples language models only")
    with torch.device("meta"):
        model = task.build_model()
    # Before materializing: shardlab.json's config is checked against the tensors the checkpoint stores, so a crafted
    # one (64 layers x 16384) is refused rather than allocated.
    weights.check_compatible(checkpoint, info, cfg.task.name, OmegaConf.to_container(cfg.model, resolve=True))
    weights.check_shapes(checkpoint, model)
    materialize(model, torch.device("cpu"), task.init_tensor, cfg.seed)
    weights.load_into(model, checkpoint)
    return model.eval(), task, cfg


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_N checkpoint directory or a .safetensors file")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--top-k", type=int, default=8, help="sample among the k likeliest tokens; 0 = greedy")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--user-dir", help="the plug-in folder of a run trained with user_dir= (imported: trust it)")
    args = parser.parse_args(argv)

    model, task, cfg = load_model(args.checkpoint, args.user_dir)
    text = sample(
        model,
        task.tokenizer,
        args.prompt,
        args.max_new_tokens,
        args.top_k,
        args.temperature,
        cfg.model.get("max_seq_len") or cfg.data.seq_len,  # no position limit in the architecture: the trained length
        torch.Generator().manual_seed(args.seed),
    )
    print(text)
    return text


def cli() -> None:
    """The console script (pyproject.toml's [project.scripts]): a mistake is one line and exit code 2."""
    run_tool(main)


if __name__ == "__main__":
    cli()
