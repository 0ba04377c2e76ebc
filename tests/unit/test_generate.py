"""tools/generate.py loads a checkpoint into one process exactly and samples text from it."""

from __future__ import annotations

import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tools import generate

PROBE = torch.arange(0, 32).view(1, 32) * 7 % 256


def probe_logits(trainer) -> dict:
    with torch.no_grad():
        return {"logits": trainer.model.eval()(PROBE)}


def test_generate_loads_the_trained_weights_and_continues_the_prompt(tiny_lm, tmp_path, capsys):
    trained = run_rank(
        tiny_lm("optimization.max_steps=6", "checkpoint.interval_steps=6"),
        tmp_path,
        dist_env.detect(),
        after_fit=probe_logits,
    )
    checkpoint = tmp_path / "checkpoints" / "step_00000006"
    model, task, _ = generate.load_model(checkpoint)
    with torch.no_grad():
        assert torch.equal(model(PROBE), trained["logits"])

    capsys.readouterr()  # drop the training run's output
    text = generate.main([str(checkpoint), "--prompt", "import ", "--max-new-tokens", "20", "--top-k", "0"])
    assert text.startswith("import ") and len(text) > len("import ")
    assert capsys.readouterr().out.strip() == text.strip()
    again = generate.main([str(checkpoint), "--prompt", "import ", "--max-new-tokens", "20", "--top-k", "0"])
    assert again == text  # greedy decoding is deterministic


def test_generate_loads_a_checkpoint_trained_with_cpu_offload(tiny_lm, tmp_path):
    """An offloaded (or hybrid-sharded) run writes an ordinary DCP checkpoint; its distributed settings describe how
    state was sharded, not what it holds, so generate.py loads it into one process like any other."""
    trained = run_rank(
        tiny_lm(
            "distributed.backend=fully_sharded",
            "distributed.cpu_offload=true",
            "optimization.max_steps=4",
            "checkpoint.interval_steps=4",
        ),
        tmp_path,
        dist_env.detect(),
        after_fit=probe_logits,
    )
    model, _, cfg = generate.load_model(tmp_path / "checkpoints" / "step_00000004")
    with torch.no_grad():
        torch.testing.assert_close(model(PROBE), trained["logits"], rtol=1e-5, atol=1e-6)
