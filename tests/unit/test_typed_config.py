"""The composed config becomes the dataclasses of its schemas once (shardlab.config.typed), where a run is put
together: the trainer, the backend and the checkpointer read them, and what the run records is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from shardlab.config import (
    CheckpointConfig,
    DistributedConfig,
    TaskConfig,
    TrainConfig,
    as_container,
    section_types,
    typed,
    with_section_types,
)
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.conftest import compose_config

OLD_CHECKPOINT = Path(__file__).parent.parent / "data" / "checkpoint_0b6f597" / "step_00000002"


def test_the_trainer_backend_and_checkpointer_read_the_typed_config_and_the_record_is_the_composed_one(
    tiny_lm, tmp_path
):
    from shardlab_tasks.lm.config import GPTConfig, LMDataConfig

    cfg = tiny_lm("optimization.max_steps=2", "validation.interval_steps=0", "checkpoint.interval_steps=0")

    def seen(trainer) -> dict:
        return {
            "types": [type(x) for x in (trainer.cfg, trainer.cfg.model, trainer.cfg.data, trainer.cfg.task)],
            "backend": type(trainer.backend.cfg),
            "checkpoint": type(trainer.checkpointer.cfg),
        }

    result = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=seen)
    assert result["types"] == [TrainConfig, GPTConfig, LMDataConfig, TaskConfig]
    assert (result["backend"], result["checkpoint"]) == (DistributedConfig, CheckpointConfig)
    meta = json.loads((tmp_path / "checkpoints" / "step_00000002" / "shardlab.json").read_text())
    composed = OmegaConf.to_container(cfg, resolve=True)
    assert json.dumps(meta["config"]) == json.dumps(composed)  # the same keys, order and values as before
    assert meta["model_config"] == composed["model"]


@pytest.mark.parametrize("overrides", [[], ["task=dpo"], ["task=swav", "data.source=embedded"], ["model=llama_tiny"]])
def test_a_config_sent_to_spawned_ranks_as_text_is_typed_as_its_launcher_composed_it(overrides):
    composed = compose_config(overrides)
    text = OmegaConf.create(OmegaConf.to_yaml(composed, resolve=True))
    again = typed(with_section_types(text, section_types(composed)))
    launcher = typed(composed)
    for section in ("task", "model", "data"):
        assert type(getattr(again, section)) is type(getattr(launcher, section))
    assert json.dumps(as_container(again)) == json.dumps(OmegaConf.to_container(composed, resolve=True))


def test_a_config_without_schemas_types_the_generic_sections_and_keeps_the_plugin_ones_as_dictconfigs():
    composed = compose_config(["task=dpo"])
    plain = typed(OmegaConf.create(OmegaConf.to_container(composed, resolve=True)))
    assert isinstance(plain.distributed, DistributedConfig) and isinstance(plain.checkpoint, CheckpointConfig)
    assert all(isinstance(getattr(plain, s), DictConfig) for s in ("task", "model", "data"))
    assert plain.task.dpo.beta == composed.task.dpo.beta


def test_a_checkpoints_config_read_back_carries_no_schema_so_the_tasks_own_choice_check_answers_an_override():
    """Why the task plug-ins keep their choice checks beside the schema walker: shardlab-evaluate reads the config a
    checkpoint recorded (untyped), the walker finds no schema there, and the LM task's own check refuses the value."""
    from shardlab.errors import ConfigError
    from shardlab_commands import evaluate

    with pytest.raises(ConfigError, match=r"^data.format='bogus' is not a data format; known: text, chat"):
        evaluate.main([str(OLD_CHECKPOINT), "data.format=bogus"])


def test_a_value_left_missing_that_no_check_reads_is_refused_in_one_line_when_the_run_is_typed():
    from omegaconf import MISSING

    from shardlab.errors import ConfigError
    from shardlab.trainer import run_config

    cfg = compose_config([])
    OmegaConf.update(cfg, "logging.wandb.entity", MISSING)
    with pytest.raises(ConfigError, match=r"^logging.wandb.entity has no value \(\?\?\?\): give it one"):
        run_config(cfg)


def test_the_runs_task_holds_the_trainers_typed_config_so_a_validation_batch_it_lowers_is_validated_and_recorded(
    tiny_lm, tmp_path, monkeypatch
):
    """One config object in a run: the task reads and writes the trainer's dataclasses (Task.use_config, called by
    assemble), so the validation batch fit_validation_batch lowers is the one validation reads and the checkpoint
    records, also where the task was built from the pre-flight's own composition (shardlab.cli.checks.checked)."""
    import copy

    from shardlab.runner import build_task
    from shardlab.trainer import Trainer

    cfg = tiny_lm("optimization.max_steps=1", "validation.interval_steps=1", "validation.batch_size=100000")
    task = build_task(copy.deepcopy(cfg), 1)  # the pre-flight's task holds its own DictConfig, not run_rank's
    validated, loader = [], Trainer._loader

    def recorded_loader(self, dataset, order, start, batch_size, num_batches=None):
        if dataset is self.task.valid_dataset:
            validated.append(batch_size)
        return loader(self, dataset, order, start, batch_size, num_batches)

    monkeypatch.setattr(Trainer, "_loader", recorded_loader)
    result = run_rank(cfg, tmp_path, dist_env.detect(), task=task, after_fit=lambda t: {"trainer": t})
    trainer = result["trainer"]
    held = len(trainer.task.valid_dataset)
    assert trainer.task.cfg is trainer.cfg and isinstance(trainer.task.cfg, TrainConfig)
    assert 0 < held < 100000 and trainer.cfg.validation.batch_size == held
    assert validated and set(validated) == {held}
    meta = json.loads((tmp_path / "checkpoints" / "step_00000001" / "shardlab.json").read_text())
    assert meta["config"]["validation"]["batch_size"] == held


def test_the_section_model_pretrained_writes_is_the_runs_typed_one_and_recorded_also_for_a_task_built_typed(
    tiny_lm, tmp_path
):
    """apply_pretrained writes the Hugging Face folder's model section into the config the task is built from: the
    DictConfig a run types afterwards (the run trains, hands the task and records that section), or a typed config
    (its section replaced by the folder schema's dataclass, as typing the DictConfig makes it)."""
    from shardlab_tasks.lm.config import LlamaConfig
    from shardlab_tasks.lm.task_choice import build_lm_task
    from tests.hf_folders import make_folder

    folder = make_folder("llama3", tmp_path / "hf")
    cfg = tiny_lm(f"model.pretrained={folder}", "optimization.max_steps=1", "validation.interval_steps=0")
    result = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=lambda t: {"trainer": t})
    trainer = result["trainer"]
    model = trainer.task.cfg.model
    assert trainer.task.cfg is trainer.cfg and type(model) is LlamaConfig
    assert (model.num_kv_heads, model.rope_theta, model.pretrained) == (2, 500000.0, str(folder.resolve()))
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "shardlab.json").read_text())
    assert meta["model_config"] == as_container(model)

    built_typed = build_lm_task(typed(tiny_lm(f"model.pretrained={folder}")))
    assert type(built_typed.cfg.model) is LlamaConfig and built_typed.cfg.model == model
    assert built_typed.cfg.data.tokenizer == str(folder.resolve() / "tokenizer.json")
