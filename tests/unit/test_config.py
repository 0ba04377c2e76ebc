"""Config composition and validation: every mistake comes back as one ConfigError naming the key and the fix."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from shardlab.cli.preflight import preflight
from shardlab.errors import ConfigError
from shardlab.registry import Registry
from shardlab.runner import build_task
from tests.conftest import compose_config


def test_default_config_composes_every_section():
    cfg = compose_config([])
    for section in (
        "task",
        "model",
        "data",
        "optimizer",
        "lr_scheduler",
        "distributed",
        "optimization",
        "validation",
        "checkpoint",
        "logging",
    ):
        assert section in cfg
    assert cfg.task.name == "lm" and cfg.model.arch == "gpt" and cfg.distributed.backend == "single"


def test_group_choice_sets_its_section():
    cfg = compose_config(["distributed=fully_sharded", "optimizer=sgd", "lr_scheduler=inverse_sqrt"])
    assert (cfg.distributed.backend, cfg.optimizer.name, cfg.lr_scheduler.name) == (
        "fully_sharded",
        "sgd",
        "inverse_sqrt",
    )


def test_task_defaults_win_over_generic_section_defaults():
    cfg = compose_config([])
    assert cfg.lr_scheduler.warmup_steps == 30  # set by conf/task/lm.yaml, not the schema's 0


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model=gpt_tyni", "Did you mean 'gpt_tiny'"),
        ("task=lmm", "Did you mean 'lm'"),
        ("optimizer=adamm", "Did you mean 'adamw'"),
        ("lr_scheduler=cosin", "Did you mean 'cosine'"),
        ("optimization.batch_size=abc", "optimization.batch_size"),
        ("optimization.bach_size=3", "bach_size"),
    ],
)
def test_preflight_answers_bad_overrides_in_one_line(override, expected):
    with pytest.raises(ConfigError) as e:
        preflight([override])
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optimizer.lr=inf", "optimizer.lr must be a finite number, got inf; give a finite value"),
        ("optimizer.eps=nan", "optimizer.eps must be a finite number, got nan; give a finite value"),
        ("optimizer.weight_decay=inf", "optimizer.weight_decay must be a finite number, got inf"),
        ("optimizer.momentum=nan", "optimizer.momentum must be a finite number, got nan"),
        ("optimizer.betas=[0.9,nan]", "optimizer.betas[1] must be a finite number, got nan"),
        ("model.init_std=nan", "model.init_std must be a finite number, got nan"),
        ("data.max_corpus_mb=nan", "data.max_corpus_mb must be a finite number, got nan"),
        ("optimization.clip_norm=-inf", "optimization.clip_norm must be a finite number, got -inf"),
        ("optimizer.eps=-1", "optimizer.eps must be > 0 (it keeps a denominator off zero), got -1.0"),
        ("optimizer.eps=0", "optimizer.eps must be > 0"),
        ("optimizer.momentum=1", "optimizer.momentum must be in [0, 1), got 1.0"),
        ("optimization.max_nonfinite_steps=0", "optimization.max_nonfinite_steps must be >= 1, got 0"),
    ],
)
def test_a_number_that_is_not_finite_or_out_of_range_is_refused_in_one_line(override, expected):
    """Range checks alone let inf through (inf > 0): optimizer.lr=inf trained NaN losses and ended "completed"."""
    with pytest.raises(ConfigError) as e:
        preflight([override])
    assert str(e.value) == expected or str(e.value).startswith(expected), str(e.value)
    assert "\n" not in str(e.value)


def test_the_cli_refuses_lr_inf_in_one_line_with_exit_code_2_and_writes_nothing(tmp_path, cli_forks):
    run = tmp_path / "run"
    args = ["optimizer.lr=inf", f"hydra.run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}"]
    out = cli_forks.run(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "error: optimizer.lr must be a finite number, got inf; give a finite value"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run folder, no cache, no lock


def test_validation_collects_every_problem_at_once():
    cfg = compose_config(
        ["optimizer.lr=-1", "optimization.batch_size=0", "optimization.max_steps=10", "lr_scheduler.warmup_steps=-1"]
    )
    with pytest.raises(ConfigError) as e:
        build_task(cfg, world_size=1)
    message = str(e.value)
    assert "optimizer.lr must be > 0" in message
    assert "optimization.batch_size must be > 0" in message
    assert "lr_scheduler.warmup_steps must be >= 0, got -1" in message


def test_unknown_backend_names_known_ones_and_suggests():
    with pytest.raises(ConfigError, match="known: ddp, fully_sharded, single. Did you mean 'fully_sharded'"):
        build_task(compose_config(["distributed.backend=fuly_sharded"]), world_size=1)


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        (["distributed.backend=ddp", "distributed.cpu_offload=true"], 2, "cpu_offload needs distributed.backend"),
        (["distributed.backend=fully_sharded", "distributed.sharding_degree=3"], 4, "sharding_degree (3) must divide"),
        (["distributed.backend=fully_sharded", "optimization.batch_size=5"], 2, "must be divisible by the world size"),
        (
            ["distributed.backend=fully_sharded", "distributed.param_dtype=fp16", "distributed.reduce_dtype=bf16"],
            2,
            "mix fp16 and bf16",
        ),
        (["distributed.offload_activations=true", "distributed.activation_checkpointing=full"], 1, "choose one"),
        (["distributed.world_size=2"], 1, "needs distributed.backend=ddp or fully_sharded"),
        (["distributed.cpu_allocator=tight"], 1, "cpu_allocator must be one of auto, lean, fast, got 'tight'"),
        (["data.seq_len=512"], 1, "data.seq_len (512) must be in [1, model.max_seq_len=256]"),
        (["model.num_heads=5"], 1, "model.num_heads (5) must divide model.dim"),
        (["model.num_heads=0"], 1, "model.num_heads must be >= 1, got 0"),
        (["model.mlp_ratio=0.001"], 1, "must give an MLP at least 1 wide"),
        (["model.init_std=-0.02"], 1, "model.init_std must be > 0, got -0.02"),
        (["task=image_classification", "model.dropout=1.0"], 1, "model.dropout must be in [0, 1), got 1.0"),
        (["distributed.backend=fully_sharded", "distributed.sharding_degree=0"], 2, "sharding_degree (0) must divide"),
        (["distributed.backend=ddp", "distributed.prefetch_units=1"], 2, "prefetch_units applies to fully_sharded"),
        (["distributed.backend=ddp", "distributed.reduce_scatter=all_reduce"], 2, "reduce_scatter applies to fully"),
        (["distributed.reduce_dtype=fp16"], 1, "distributed.reduce_dtype: one process reduces no gradients"),
        (["+distributed.prefetch=2"], 1, "distributed.prefetch is not a known key of distributed"),
        (["+model.foo=1"], 1, "model.foo is not a known key of model"),
        (["distributed=fully_sharded", "distributed.wrap_min_num_params=1000"], 1, "task lm declares its FSDP units"),
    ],
)
def test_invalid_combinations_are_rejected_before_launch(overrides, world, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        build_task(compose_config(overrides), world_size=world)


def test_plan_per_rank_state_divides_by_the_shard_group_under_hybrid_sharding():
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory.estimate import estimate
    from shardlab.memory.layout import layout_of
    from shardlab.memory.plan import profile_config

    cfg = compose_config(["model=gpt_1_3b", "distributed=fully_sharded", "distributed.sharding_degree=2"])
    task = build_task(cfg, world_size=8)
    profile, ctx = profile_config(cfg, task, 8, model_on_meta(task))
    hybrid = estimate(profile, layout_of(cfg.distributed, 8), ctx)
    cfg.distributed.sharding_degree = -1
    full = estimate(profile, layout_of(cfg.distributed, 8), ctx)
    # 16 bytes/param over the 2 ranks of a shard group, not the 8 of the job: 4x the fully sharded state
    assert hybrid.state == pytest.approx(4 * full.state, rel=1e-6)
    assert full.state == pytest.approx(16 * profile.params / 8, rel=1e-6)


def test_activation_checkpointing_recomputes_units_on_one_process_too(tiny_lm, tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    def wrapped(trainer) -> dict:
        return {"wrapped": sum(isinstance(m, CheckpointWrapper) for m in trainer.model.modules())}

    cfg = tiny_lm("distributed.activation_checkpointing=full", "optimization.max_steps=2")
    assert run_rank(cfg, tmp_path, dist_env.detect(), after_fit=wrapped)["wrapped"] == cfg.model.num_layers


def test_registry_raises_error_when_name_unknown():
    registry: Registry = Registry("widget")
    registry.register("sprocket")(lambda: 1)
    assert registry.build("sprocket") == 1
    with pytest.raises(ConfigError, match=r"^x.y: 'sprockt' is not a known widget; known: sprocket. Did you mean"):
        registry.get("sprockt", key="x.y")


def test_registry_refuses_two_factories_under_one_name():
    registry: Registry = Registry("widget")
    registry.register("a")(lambda: 1)
    twice = r"^widget 'a' is registered twice: by .*test_config.py:\d+ and by .*test_config.py:\d+; give yours"
    with pytest.raises(ConfigError, match=twice):
        registry.register("a")(lambda: 2)


@dataclass
class SprocketConfig:
    kind: str = "?"
    """Which sprocket."""
    teeth: int = 12
    """Teeth on the wheel."""


def test_a_registration_carries_its_schema_with_the_name_as_default():
    registry: Registry = Registry("widget", section="widget", name_key="kind")
    registry.register("sprocket", dataclass=SprocketConfig)(lambda cfg: cfg.teeth)
    node = ConfigStore.instance().load("schema/widget/sprocket.yaml").node
    assert OmegaConf.get_type(node) is SprocketConfig and (node.kind, node.teeth) == ("sprocket", 12)
    with pytest.raises(ConfigError, match=r"^widget 'gear' \(.*test_config.py:\d+\): data= is a task's data section"):
        registry.register("gear", data=SprocketConfig)(lambda cfg: 1)


def test_a_lazy_registration_imports_its_factory_when_first_used_and_admits_it_again():
    registry: Registry = Registry("widget")
    registry.register_lazy("dumps", "json:dumps")
    assert registry.build("dumps", [1]) == "[1]"
    registry.register("dumps")(json.dumps)  # the object a lazy entry names registering itself is no clash
    with pytest.raises(ConfigError, match=r"^widget 'dumps' is registered twice: by .*test_config.py:\d+ and by"):
        registry.register_lazy("dumps", "json:loads")


def test_every_builtin_option_names_its_registered_schema():
    """conf/<section>/*.yaml name schema/<section>/<name>: composing each one proves the registration stored it."""
    for option in ("adamw", "sgd", "cpu_adam"):
        assert compose_config([f"optimizer={option}"]).optimizer.name == option
    for option in ("cosine", "inverse_sqrt", "constant"):
        assert compose_config([f"lr_scheduler={option}"]).lr_scheduler.name == option
    vision = compose_config(["task=image_classification", "model=regnet_y_400mf"])
    assert (vision.model.arch, vision.data.num_train) == ("regnet", 5000)
    assert compose_config([]).model.arch == "gpt"
