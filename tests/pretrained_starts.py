"""How a run from a pretrained file starts, seen from a test: which names its seeded init drew, and the weights the
old path (every tensor drawn, then the file read over them) gives. Shared by tests/unit/test_pretrained_init.py
(the LM's Hugging Face folder) and tests/unit/test_vision_pretrained_init.py (a vision trunk)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardlab.distributed import env as dist_env
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.registry import BACKENDS
from shardlab.runner import build_task, prepare_data, rank_task
from shardlab.trainer import assemble


def recording(task) -> list[str]:
    """Names the task's init_tensor is asked to fill, in order (the instance's method is replaced)."""
    drawn: list[str] = []
    init = task.init_tensor

    def record(name, tensor, generator):
        drawn.append(name)
        init(name, tensor, generator)

    task.init_tensor = record
    return drawn


@dataclass
class Start:
    """What assemble left: the model's state, the names drawn from the seed, the parameters' names (a tied weight
    once), the trainer's initialized_from, and the rank's task."""

    state: dict[str, torch.Tensor]
    drawn: list[str]
    parameters: list[str]
    initialized_from: object
    task: object


def started(cfg, run_dir: Path, trial: bool = False) -> Start:
    task = rank_task(cfg)
    drawn = recording(task)
    backend = BACKENDS.build(cfg.distributed.backend, cfg.distributed, dist_env.detect(), key="distributed.backend")
    try:
        trainer = assemble(cfg, task, backend, run_dir, prepare_data=lambda: prepare_data(task), trial=trial)
        state = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
        parameters = [n for n, _ in trainer.model.named_parameters()]
    finally:
        backend.teardown()
    return Start(state, drawn, parameters, trainer.initialized_from, task)


def full_init_then_load(cfg) -> dict[str, torch.Tensor]:
    """Every tensor drawn from (seed, name), then the file read over the ones it holds: the start without the skip."""
    task = build_task(cfg, world_size=1)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, cfg.seed)
    task.load_pretrained(model, torch.device("cpu"))
    return {n: t.detach() for n, t in model.state_dict().items()}
