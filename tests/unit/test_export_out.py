"""shardlab-export never harms what it did not write: an --out that is, lies in or contains what the export reads
(the run's model.pretrained, the step folder, the run's folder), a folder of someone else's files, or a symbolic link
to any of these is refused in one line before anything is read, in every mode, and the folder is byte-identical
afterwards; every mode writes into a staged folder renamed into place, marked as an export's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.checkpoint.export_folder import EXPORT_MARKER
from shardlab.errors import ConfigError
from shardlab_commands import export_hf
from tests.hf_folders import make_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus_cache) -> dict[str, Path]:
    """A 1-step LoRA run on a transformers-made Llama folder: {"base", "run", "step"}."""
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank
    from tests.conftest import TINY_LM

    root = tmp_path_factory.mktemp("export_out")
    base = make_folder("llama3", root / "base")
    (base / "README.md").write_text("the model card")
    run = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"model.pretrained={base}", "model.lora.rank=4"]
    run += ["model.lora.target_modules=[attn.q]", "optimization.max_steps=1", "checkpoint.interval_steps=1"]
    run += ["validation.interval_steps=0"]
    run_rank(compose_config(run), root / "run", dist_env.detect())
    return {"base": base, "run": root / "run", "step": root / "run" / "checkpoints" / "step_00000001"}


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every path under ``folder`` (the folder itself too): a file's bytes, a link's target, a folder's mark."""
    out: dict[str, bytes | str] = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        key = str(path.relative_to(folder))
        out[key] = f"-> {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir() else path.read_bytes()
    return out


def targets(lora_run: dict[str, Path], tmp_path: Path) -> dict[str, tuple[Path, Path, str]]:
    """case -> (--out, the folder to compare before and after, the refusal's words)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "config.json").write_text("{}")  # a config.json no longer makes a folder an earlier export
    links = {}
    for name in ("base", "step", "mine"):
        links[name] = tmp_path / f"link_to_{name}"
        links[name].symlink_to(mine if name == "mine" else lora_run[name], target_is_directory=True)
    base, step, run = lora_run["base"], lora_run["step"], lora_run["run"]
    return {
        "base folder": (base, base, "is model.pretrained"),
        "inside the base": (base / "sub", base, "is inside model.pretrained"),
        "step folder": (step, run, "is the checkpoint"),
        "inside the step": (step / "hf", run, "is inside the checkpoint"),
        "run folder": (run, run, "contains the checkpoint"),
        "beside the step": (run / "hf", run, "is inside the run's folder"),
        "above the run": (run.parent, run, "contains the checkpoint"),
        "an unrelated folder": (mine, mine, "holds files an export did not write"),
        "a link to the base": (links["base"], base, "is a symbolic link"),
        "a link to the step": (links["step"], run, "is a symbolic link"),
        "a link to another's": (links["mine"], mine, "is a symbolic link"),
        "through a link": (links["step"] / "hf", run, "is inside the checkpoint"),
    }


@pytest.mark.parametrize("mode", [[], ["--adapter-only"]], ids=["merged", "adapter-only"])
def test_an_out_that_is_or_holds_what_the_export_did_not_write_is_refused_and_left_as_it_was(lora_run, tmp_path, mode):
    for case, (out, watched, words) in targets(lora_run, tmp_path).items():
        before = snapshot(watched)
        with pytest.raises(ConfigError, match=f"^--out {re.escape(str(out))} {words}") as refused:
            export_hf.main([str(lora_run["step"]), "--out", str(out), *mode])
        assert "\n" not in str(refused.value), case
        assert snapshot(watched) == before, case
        assert not any(p.name.startswith(".") for p in watched.parent.iterdir()), case  # no staging folder left


def test_the_refusal_is_one_line_and_a_non_zero_exit_from_the_command(lora_run):
    base = lora_run["base"]
    before = snapshot(base)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "shardlab_commands.export_hf", str(lora_run["step"]), "--adapter-only", "--out",
         str(base)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--out {base} is model.pretrained" in lines[0], done.stderr
    assert snapshot(base) == before


@pytest.mark.parametrize("mode", [[], ["--adapter-only"]], ids=["merged", "adapter-only"])
def test_every_mode_stages_marks_and_replaces_only_its_own_earlier_export(lora_run, tmp_path, mode, monkeypatch):
    out = tmp_path / "export"
    step = str(lora_run["step"])
    export_hf.main([step, "--out", str(out), *mode])
    assert (out / EXPORT_MARKER).is_file()
    (out / "stale.txt").write_text("from the earlier export")
    export_hf.main([step, "--out", str(out), *mode])  # its own: replaced whole
    assert (out / EXPORT_MARKER).is_file() and not (out / "stale.txt").exists()
    before = snapshot(out)

    from shardlab.checkpoint import hf_folder
    from shardlab_tasks.lm.hf import peft

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(peft, "write_peft_adapter", broken)
    monkeypatch.setattr(hf_folder, "_write_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf.main([step, "--out", str(out), *mode])
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging folder left behind
    with pytest.raises(OSError, match="disk full"):
        export_hf.main([step, "--out", str(tmp_path / "new"), *mode])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # a cut-short first export leaves nothing


def test_an_empty_folder_is_written(lora_run, tmp_path):
    (tmp_path / "empty").mkdir()
    out = export_hf.main([str(lora_run["step"]), "--adapter-only", "--out", str(tmp_path / "empty")])
    assert (out / "adapter_config.json").is_file() and (out / EXPORT_MARKER).is_file()


def test_a_lora_base_changed_since_the_run_recorded_it_is_refused_at_resume_and_export(tmp_path, corpus_cache):
    """The run records its base's digest (weight files' names, sizes, headers); another model put at that path (here
    the same family re-saved in other shards, as an export over the base would leave it) is refused in one line."""
    import shutil

    from shardlab.checkpoint import weights
    from shardlab.cli.preflight import compose_config
    from shardlab.distributed import env as dist_env
    from shardlab.errors import CheckpointError, IncompatibleCheckpointError
    from shardlab.runner import run_rank
    from tests.conftest import TINY_LM

    base = make_folder("llama3", tmp_path / "base")
    run = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"model.pretrained={base}", "model.lora.rank=4"]
    run += ["model.lora.target_modules=[attn.q]", "checkpoint.interval_steps=1", "validation.interval_steps=0"]
    run_rank(compose_config([*run, "optimization.max_steps=1"]), tmp_path / "run", dist_env.detect())
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert weights.describe(step)["model_config"]["lora"]["base_digest"]
    shutil.copytree(base, tmp_path / "same")  # the same files elsewhere: the same base (--base for a moved one)
    export_hf.main([str(step), "--base", str(tmp_path / "same"), "--out", str(tmp_path / "moved")])

    shutil.rmtree(base)
    make_folder("llama3", base, seed=0, max_shard_size="30KB")  # the same model, other shards: not the files recorded
    refusal = rf"^the frozen base {re.escape(str(base))} is not the one .* trained its"
    with pytest.raises(CheckpointError, match=refusal):
        export_hf.main([str(step), "--out", str(tmp_path / "merged")])
    with pytest.raises(IncompatibleCheckpointError, match="is not the one .* trained its adapters on") as refused:
        run_rank(compose_config([*run, "optimization.max_steps=2"]), tmp_path / "run", dist_env.detect())
    assert "\n" not in str(refused.value)
    from shardlab_commands import generate

    with pytest.raises(CheckpointError, match="is not the one the run trained its adapters on"):
        generate.load_model(step)  # a tool rebuilding the run from its checkpoint's config checks it too
    assert sorted((tmp_path / "run" / "checkpoints").iterdir()) == [step]  # nothing trained on the other base
    assert not (tmp_path / "merged").exists()
