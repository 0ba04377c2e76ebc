"""distributed.compile without compiling a model: refusals before training, the cache directory, units compiled in
place (names unchanged), validation left eager, and the first step's timeout window. Parity lives in
tests/distributed/test_compile.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from shardlab.config import DistributedConfig
from shardlab.distributed import compile as shardlab_compile
from shardlab.distributed.base import Backend
from shardlab.distributed.env import DistEnv
from shardlab.errors import ConfigError
from shardlab.runner import build_task


def test_compile_without_a_cpp_compiler_is_refused_in_one_line_before_training(tiny_lm, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(ConfigError, match=r"distributed.compile: .*/nonexistent/g\+\+ is not on PATH") as error:
        build_task(tiny_lm("distributed.compile=true"))
    assert "\n" not in str(error.value)


def test_a_compile_timeout_shorter_than_the_collective_timeout_is_refused(tiny_lm):
    with pytest.raises(ConfigError, match=r"distributed.compile_timeout_s \(60\) is shorter than .*timeout_s \(600\)"):
        build_task(tiny_lm("distributed.compile=true", "distributed.compile_timeout_s=60"))


def test_eager_runs_skip_every_compile_check(tiny_lm, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    build_task(tiny_lm("distributed.compile_timeout_s=60"))  # compile off: neither the compiler nor the window matter


def test_cache_dir_is_the_config_key_else_the_environment_else_a_per_user_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    d = DistributedConfig(compile=True)
    assert shardlab_compile.use_cache_dir(d) == tmp_path / "home" / ".cache" / "shardlab" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    assert shardlab_compile.use_cache_dir(d) == tmp_path / "env"
    d.compile_cache_dir = str(tmp_path / "key")
    assert shardlab_compile.use_cache_dir(d) == tmp_path / "key"
    assert Path(shardlab_compile.os.environ["TORCHINDUCTOR_CACHE_DIR"]) == tmp_path / "key"  # what inductor reads
    assert (tmp_path / "key").is_dir()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def test_units_are_compiled_in_place_keeping_parameter_names_and_the_module_call_eager():
    model = nn.Sequential(Block(), Block())
    names = list(model.state_dict())
    shardlab_compile.compile_units(list(model))
    assert list(model.state_dict()) == names  # no _orig_mod. prefix: checkpoints move between compiled and eager
    for unit in model:
        assert unit.forward is not Block.forward.__get__(unit)  # the forward is the compiled one
        assert unit._compiled_call_impl is None  # __call__ (where FSDP's hooks run) is not traced


def test_validation_runs_compiled_code_eagerly_and_training_compiles_it():
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=counting_backend)
    backend = Backend(DistributedConfig(compile=True), DistEnv(0, 1, 0, "localhost", 0, "none"))
    x = torch.ones(3)
    with torch.no_grad(), backend.forward_context():
        fn(x)
    assert graphs == []  # validation: no graph was built
    with backend.forward_context():
        fn(x)
    assert len(graphs) == 1


def test_first_step_runs_under_the_compile_timeout_then_all_ranks_meet_before_the_short_one(monkeypatch):
    calls = []
    monkeypatch.setattr(shardlab_compile.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(shardlab_compile.dist, "set_timeout", lambda t, group: calls.append(("timeout", t, group)))
    monkeypatch.setattr(shardlab_compile.dist, "barrier", lambda: calls.append(("barrier",)))
    d = OmegaConf.structured(DistributedConfig(compile=True, timeout_s=600, compile_timeout_s=1800))
    groups = [None, "mesh"]
    first = shardlab_compile.FirstSteps(d, groups)
    assert calls == [("timeout", timedelta(seconds=1800), g) for g in groups]
    calls.clear()
    assert first.ended(41.5) is None
    assert calls == [("barrier",)] + [("timeout", timedelta(seconds=600), g) for g in groups]
    calls.clear()
    line = first.ended(0.5)
    assert line.startswith("compile: the first step took 41.5 s, the second 0.50 s: ~41.0 s compiling")
    assert first.ended(0.5) is None and calls == []  # reported once; the timeout is not touched again
