"""A relative checkpoint.init_from is the file the run read, wherever shardlab-export runs: the saved config keeps
the user's text (relative to the folder the run was started in), and the export takes the path each checkpoint
recorded at the run's start (its line), never a file of the same name in the export's own folder; a checkpoint with
no such record is refused in one line naming the key and --base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError
from shardlab.runner import run_rank
from shardlab_commands import consolidate, export_hf
from tests.conftest import TINY_LM

RUN = ["optimization.max_steps=2", "checkpoint.interval_steps=2", "validation.interval_steps=0"]
LORA = ["model=llama_tiny", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[attn.*,mlp.*]"]


def train(run_dir: Path, corpus_cache: str, *overrides: str) -> Path:
    cfg = compose_config([*TINY_LM, f"data.cache_dir={corpus_cache}", *RUN, *overrides])
    run_rank(cfg, run_dir, dist_env.detect())
    return run_dir / "checkpoints" / "step_00000002"


def exported(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus_cache) -> tuple[Path, Path]:
    """(the folder the LoRA run was started in, its step folder): begun from init_from=base.safetensors, relative."""
    root = tmp_path_factory.mktemp("relative")
    started_in = root / "project"
    started_in.mkdir()
    base = train(root / "base", corpus_cache, "model=llama_tiny")
    consolidate.main([str(base), "--out", str(started_in / "base.safetensors")])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(started_in)
        step = train(root / "lora", corpus_cache, *LORA, "checkpoint.init_from=base.safetensors")
    return started_in, step


def test_the_export_of_a_relative_init_from_reads_the_runs_base_not_one_in_its_own_folder(
    lora_run, tmp_path, monkeypatch
):
    started_in, step = lora_run
    assert json.loads((step / "shardlab.json").read_text())["config"]["checkpoint"]["init_from"] == "base.safetensors"
    monkeypatch.chdir(started_in)
    expected = exported(export_hf.main([str(step), "--out", str(tmp_path / "there")]))
    elsewhere = tmp_path / "elsewhere"  # a base.safetensors of the same shapes, other values: what cwd would read
    elsewhere.mkdir()
    save_file(
        {k: v + 1 for k, v in load_file(str(started_in / "base.safetensors")).items()}, elsewhere / "base.safetensors"
    )
    shutil.copy(started_in / "base.json", elsewhere / "base.json")
    monkeypatch.chdir(elsewhere)
    got = exported(export_hf.main([str(step), "--out", str(tmp_path / "here")]))
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name


def test_a_relative_init_from_the_checkpoint_did_not_record_is_refused_in_one_line(lora_run, tmp_path, monkeypatch):
    _, step = lora_run
    old = tmp_path / "step_00000002"  # as a checkpoint written before runs recorded where they began
    shutil.copytree(step, old)
    meta = json.loads((old / "shardlab.json").read_text())
    del meta["line"]
    (old / "shardlab.json").write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        export_hf.main([str(old), "--out", str(tmp_path / "out")])
    message = str(e.value)
    assert "\n" not in message and not (tmp_path / "out").exists()
    assert message.startswith("checkpoint.init_from=base.safetensors in ") and "pass --base <" in message
    base = lora_run[0] / "base.safetensors"
    assert export_hf.main([str(old), "--base", str(base), "--out", str(tmp_path / "out")]).is_dir()  # the fix works
