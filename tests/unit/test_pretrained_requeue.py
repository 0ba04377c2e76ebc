"""A requeue of a model.pretrained run whose folder was deleted: the same command is refused in pre-flight, in one
line naming model.pretrained and saying a resume needs the folder too (docs/finetuning.md, "Keep the folder"); with
the folder back at its path, the same command resumes the run's checkpoint."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_LM
from tests.hf_folders import make_folder
from tests.unit.test_cli import run_cli

pytestmark = pytest.mark.e2e  # a training command and its requeue: CI runs it after the suite (tests/conftest.py)

STEPS = ["optimization.max_steps=2", "checkpoint.interval_steps=2", "lr_scheduler.warmup_steps=0"]


def test_a_requeue_without_its_pretrained_folder_is_refused_in_one_line_and_resumes_once_it_is_back(
    tmp_path, corpus_cache, cli_forks
):
    folder = make_folder("llama3_tied", tmp_path / "hf")
    command = [
        *TINY_LM, *STEPS, f"model.pretrained={folder}", f"data.cache_dir={corpus_cache}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    code, _, err = run_cli(*command)
    assert code == 0, err
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()
    folder.rename(tmp_path / "moved")
    # the requeue, refused in pre-flight: a fork of the warmed CLI (conftest's cli_forks) spares an interpreter start
    refused = cli_forks.run(*command, "optimization.max_steps=3")  # its checkpoint has the weights
    code, err = refused.returncode, refused.stderr
    lines = err.strip().splitlines()
    assert code != 0 and "Traceback" not in err
    assert lines[-1].startswith(f"error: model.pretrained: {folder} does not exist;"), err
    assert "config.json and tokenizer" in lines[-1] and "a resume from a checkpoint too" in lines[-1]
    assert not (tmp_path / "run" / "checkpoints" / "step_00000003").exists()
    (tmp_path / "moved").rename(folder)
    code, out, err = run_cli(*command, "optimization.max_steps=3")
    assert code == 0, err
    assert "step_00000002" in out + err and (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()
