"""shardlab-generate loads a checkpoint into one process exactly and samples text from it."""

from __future__ import annotations

import json

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError
from shardlab.runner import run_rank
from shardlab_commands import evaluate, generate

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


def test_a_checkpoint_naming_a_plug_in_folder_is_not_imported_unless_named(tiny_lm, tmp_path):
    """shardlab.json records the run's user_dir; a shared folder could point it at code of anyone's. The tools import
    plug-ins only from --user-dir."""
    run_rank(tiny_lm("optimization.max_steps=2", "checkpoint.interval_steps=2"), tmp_path / "run", dist_env.detect())
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    plugins = tmp_path / "planted"
    plugins.mkdir()
    marker = tmp_path / "code-ran"
    (plugins / "payload.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    meta = json.loads((checkpoint / "shardlab.json").read_text())
    meta["config"]["user_dir"] = str(plugins)
    (checkpoint / "shardlab.json").write_text(json.dumps(meta))
    for tool in (generate.main, evaluate.main):
        with pytest.raises(CheckpointError) as e:
            tool([str(checkpoint), "--max-new-tokens", "2"] if tool is generate.main else [str(checkpoint)])
        message = str(e.value)
        assert f"was trained with plug-ins from user_dir={plugins}; a checkpoint's code is imported only" in message
        assert f"pass --user-dir {plugins}" in message and not marker.exists()
    generate.main([str(checkpoint), "--max-new-tokens", "2", "--user-dir", str(plugins)])  # named: imported
    assert marker.exists()
