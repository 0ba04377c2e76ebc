"""shardlab.trainer.assemble: a trainer comes back whole (its checkpointer included) for a run and for a backend=auto
trial alike, and a trial leaves the run folder as it found it."""

from __future__ import annotations

from shardlab.checkpoint.manager import Checkpointer
from shardlab.distributed import env as dist_env
from shardlab.registry import BACKENDS
from shardlab.runner import prepare_data, rank_task
from shardlab.runner.autotune import time_steps
from shardlab.trainer import assemble


def assembled(cfg, run_dir, trial: bool):
    task = rank_task(cfg)
    backend = BACKENDS.build(cfg.distributed.backend, cfg.distributed, dist_env.detect(), key="distributed.backend")
    return assemble(cfg, task, backend, run_dir, prepare_data=lambda: prepare_data(task), trial=trial), backend


def test_a_trial_is_assembled_whole_and_leaves_the_run_folder_alone(tiny_lm, tmp_path):
    cfg = tiny_lm("checkpoint.async_save=true", "checkpoint.save=false")
    trainer, backend = assembled(cfg, tmp_path, trial=True)
    try:
        assert isinstance(trainer.checkpointer, Checkpointer)  # not only after a restore
        assert trainer.checkpointer.root == tmp_path / cfg.checkpoint.dir
        assert trainer.checkpointer._async is None  # a trainer that never saves makes no saver's process group
        assert trainer.resumed_from is None and trainer.initialized_from is None
        seconds, units = time_steps(trainer, 2)
        assert len(seconds) == 2 and units > 0 and trainer.state.step == 2
        assert list(tmp_path.iterdir()) == []
    finally:
        backend.teardown()


def test_a_run_is_assembled_with_its_checkpointer_and_model_in_place(tiny_lm, tmp_path):
    cfg = tiny_lm()
    trainer, backend = assembled(cfg, tmp_path, trial=False)
    try:
        assert isinstance(trainer.checkpointer, Checkpointer)
        params = list(trainer.model.parameters())
        assert params and all(p.device == backend.param_device for p in params)  # materialized, off meta
        assert trainer.state.components["scheduler"] is trainer.scheduler
        assert trainer.memory_estimate.peak > 0  # the plan of the model assemble built on meta
    finally:
        backend.teardown()
