"""Every choice key and every range of the schemas, refused when the config is composed, in one line that names the key
and lists the valid values (shardlab.config.choice / bounded, checked by field_errors).

The tables are made from the schemas, not written here: a new choice or range in a schema already composed below is
tested as soon as it exists; a new schema (a task's, a model's) that declares one fails
``test_every_declared_key_has_a_test_entry`` until SETUPS composes it.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from shardlab.cli import checks
from shardlab.cli.preflight import compose_config, preflight
from shardlab.config import TrainConfig, declared_values, field_errors, range_text
from shardlab.errors import ConfigError
from shardlab_tasks.lm.config import RopeScalingConfig

SETUPS: dict[str, tuple[list[str], dict[str, typing.Any]]] = {
    "lm": ([], {}),
    "dtypes": (["distributed=ddp", "distributed.param_dtype=bf16", "distributed.reduce_dtype=fp32"], {}),
    "moe": (["model=moe_tiny"], {}),
    # model.rope_scaling is null in every conf/model option and an override cannot merge into a null section: set
    # it after composing (as a pretrained Llama 3.1's config.json does), and check it as the pre-flight does
    "rope": (["model=llama_tiny"], {"model.rope_scaling": RopeScalingConfig()}),
    "dpo": (["task=dpo"], {}),
    "vision": (["task=image_classification", "model=regnet_y_400mf", "data.source=fake"], {}),
    "swav": (["task=swav", "data.source=embedded"], {}),
    "simclr": (["task=simclr"], {}),
    "dino": (["task=dino"], {}),
}
"""The configs whose composition, together, holds every schema shardlab and its task plug-ins register: the
command line of each, and values set after composing."""

BAD = "not_a_choice"


@functools.cache
def composed(setup: str) -> DictConfig:
    overrides, after = SETUPS[setup]
    cfg = compose_config(overrides)
    for key, value in after.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def _table() -> dict[str, tuple[str, typing.Any, type]]:
    """Each declared key -> (the first setup composing it, its field's metadata, the schema declaring it)."""
    table: dict[str, tuple[str, typing.Any, type]] = {}
    for setup in SETUPS:
        for key, _, meta, schema in declared_values(composed(setup)):
            table.setdefault(key, (setup, meta, schema))
    return table


TABLE = _table()
CHOICES = sorted(key for key, (_, meta, _) in TABLE.items() if "choices" in meta)
RANGES = sorted(key for key, (_, meta, _) in TABLE.items() if "choices" not in meta and "registry" not in meta)
REGISTRY_KEYS = sorted(key for key, (_, meta, _) in TABLE.items() if "registry" in meta)


def declared_fields(schema: type) -> set[tuple[str, str]]:
    """(schema, field) of every field with metadata in ``schema`` and the sections it nests, null ones included."""
    found, hints = set(), typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        nested = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
        if nested:
            found |= declared_fields(nested[0])
        elif f.metadata:
            found.add((schema.__qualname__, f.name))
    return found


def test_every_declared_key_has_a_test_entry():
    """Every schema in Hydra's ConfigStore (the run's, each task's, model's, data's, optimizer's, schedule's), every
    field that declares choices, a range or a registry, is composed by one of SETUPS and so has its test."""
    composed_fields = {
        (schema.__qualname__, key.rpartition(".")[2])
        for setup in SETUPS
        for key, _, _, schema in declared_values(composed(setup))
    }
    schemas = {TrainConfig}
    for group in ConfigStore.instance().repo["schema"].values():
        for entry in group.values() if isinstance(group, dict) else [group]:
            schemas.add(OmegaConf.get_type(entry.node))
    missing = set().union(*(declared_fields(s) for s in schemas)) - composed_fields
    assert not missing, f"no setup of SETUPS composes these fields; add one: {sorted(missing)}"
    assert len(CHOICES) >= 20 and len(RANGES) >= 30  # the tables are made, not empty


def refusal(setup: str, key: str, value: str) -> str:
    """The one line the pre-flight answers with for ``key=value`` on top of ``setup``."""
    overrides, after = SETUPS[setup]
    with pytest.raises(ConfigError) as e:
        if not after:  # the command line, as a user types it
            preflight([*overrides, f"{key}={value}"])
        else:
            cfg = composed(setup).copy()
            OmegaConf.update(cfg, key, value)
            checks.check(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("key", CHOICES)
def test_a_value_outside_the_choices_is_refused_at_composition_listing_them(key):
    setup, meta, _ = TABLE[key]
    is_list = isinstance(OmegaConf.select(composed(setup), key), ListConfig)
    message = refusal(setup, key, f"[{BAD}]" if is_list else BAD)
    listed = ", ".join(meta["choices"])
    if is_list:
        assert message == f"{key} must be a non-empty list of {listed}, got ['{BAD}']"
    else:
        assert message == f"{key} must be one of {listed}, got '{BAD}'"


@pytest.mark.parametrize("key", CHOICES)
def test_every_listed_choice_passes(key):
    setup, meta, _ = TABLE[key]
    for value in meta["choices"]:
        cfg = composed(setup).copy()
        OmegaConf.update(cfg, key, [value] if isinstance(OmegaConf.select(cfg, key), ListConfig) else value)
        assert field_errors(cfg) == [], value


def outside(meta: typing.Any, low: bool) -> float | None:
    """A value just outside the field's lower (``low``) or upper bound, or None where it has none."""
    if low:
        return meta["gt"] if "gt" in meta else meta["ge"] - 1 if "ge" in meta else None
    return meta["lt"] if "lt" in meta else meta["le"] + 1 if "le" in meta else None


RANGE_CASES = [(key, low) for key in RANGES for low in (True, False) if outside(TABLE[key][1], low) is not None]


@pytest.mark.parametrize(("key", "low"), RANGE_CASES)
def test_a_number_outside_its_range_is_refused_naming_the_key_and_range(key, low):
    setup, meta, _ = TABLE[key]
    value = outside(meta, low)
    cfg = composed(setup).copy()
    current = OmegaConf.select(cfg, key)
    OmegaConf.update(cfg, key, [value] * len(current) if isinstance(current, ListConfig) else value)
    errors = field_errors(cfg)
    assert len(errors) == 1 and errors[0].startswith(f"{key} must be "), errors
    assert range_text(meta) in errors[0] and ", got " in errors[0]


def test_every_range_has_a_case():
    assert {key for key, _ in RANGE_CASES} == set(RANGES)


def test_each_setup_composes_within_every_choice_and_range():
    for setup in SETUPS:
        assert field_errors(composed(setup)) == [], setup


def test_the_bounds_are_said_as_a_reader_writes_them():
    cases = [
        ("optimizer.momentum", 1.0, "optimizer.momentum must be in [0, 1), got 1.0"),
        ("optimizer.eps", 0.0, "optimizer.eps must be > 0 (it keeps a denominator off zero), got 0.0"),
        ("lr_scheduler.min_lr_ratio", 1.5, "lr_scheduler.min_lr_ratio must be in [0, 1], got 1.5"),
        ("optimizer.betas", [0.9], "optimizer.betas must be a list of 2 values in [0, 1), got [0.9]"),
        (
            "distributed.ac_every_k_units",
            1,
            "distributed.ac_every_k_units must be >= 2, got 1; every unit (k=1) is activation_checkpointing=full",
        ),
        (
            "distributed.pipeline_schedule",
            "zbv_zero_bubble",
            "distributed.pipeline_schedule must be one of gpipe, "
            "1f1b, interleaved_1f1b, got 'zbv_zero_bubble' (its forward-only pass fails in torch 2.14, so validation "
            "cannot run through it)",
        ),
        (
            "distributed.ac_save_ops",
            [],
            "distributed.ac_save_ops must be a non-empty list of matmul, attention, got []",
        ),
    ]
    for key, value, expected in cases:
        cfg = composed("lm").copy()
        OmegaConf.update(cfg, key, value)
        assert field_errors(cfg) == [expected]


def registry_names(registry: str) -> list[str]:
    """The names an open set knows today (what the refusal must list)."""
    from shardlab.distributed import load_backends
    from shardlab.memory import devices
    from shardlab.registry import BACKENDS, LR_SCHEDULERS, OPTIMIZERS, TASKS

    load_backends()
    known = {
        "TASKS": TASKS.names,
        "OPTIMIZERS": OPTIMIZERS.names,
        "LR_SCHEDULERS": LR_SCHEDULERS.names,
        "BACKENDS": BACKENDS.names,
        "DEVICES": lambda: [n for n in devices.known() if n != "auto"],
        "MODELS": lambda: ["gpt", "llama"],  # the LM's (model.arch is first composed by the lm setup)
        "torchvision RegNet builders": lambda: ["regnet_y_400mf", "regnet_x_400mf"],
    }
    return list(known[registry]())


@pytest.mark.parametrize("key", REGISTRY_KEYS)
def test_a_name_no_registry_knows_is_refused_listing_the_known_names(key):
    """Registry-named keys are open sets (plug-ins and user_dirs add names): refused by the registry at the
    pre-flight, with every name it knows listed."""
    setup, meta, _ = TABLE[key]
    message = refusal(setup, key, BAD)
    assert key in message and BAD in message, message
    assert all(name in message for name in registry_names(meta["registry"])), message
    assert "known" in message or "one of" in message, message


def test_the_codes_own_tables_agree_with_the_schemas_choices():
    """Modules that map a choice to code keep their own table of it: each must hold exactly the schema's values."""
    from shardlab.config import AC_SAVE_OP_GROUPS, PIPELINE_SCHEDULES
    from shardlab.distributed.activation_checkpointing import SAVE_OP_GROUPS
    from shardlab.distributed.pipeline import SCHEDULES
    from shardlab_tasks.image_classification.data import SOURCES
    from shardlab_tasks.lm.finetuning.dpo import LOSS_TYPES
    from shardlab_tasks.lm.models.moe import SCORE_FUNCS
    from shardlab_tasks.lm.models.moe_experts import EXPERT_IMPLS

    choices = {key: TABLE[key][1]["choices"] for key in CHOICES}
    assert tuple(SCHEDULES) == PIPELINE_SCHEDULES == choices["distributed.pipeline_schedule"]
    assert tuple(SAVE_OP_GROUPS) == AC_SAVE_OP_GROUPS == choices["distributed.ac_save_ops"]
    assert tuple(SOURCES) == choices["data.source"]
    assert tuple(LOSS_TYPES) == choices["task.dpo.loss_type"]
    assert tuple(SCORE_FUNCS) == choices["model.moe.score_func"]
    assert tuple(EXPERT_IMPLS) == choices["model.moe.experts_impl"]


def test_the_cli_refuses_a_choice_in_one_line_with_exit_code_2_and_writes_nothing(tmp_path, cli_forks):
    args = ["distributed.pipeline_schedule=2f2b", f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path}/c"]
    out = cli_forks.run(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "error: distributed.pipeline_schedule must be one of gpipe, 1f1b, interleaved_1f1b, got '2f2b'"
    )
    assert list(tmp_path.iterdir()) == []  # no run folder, no cache, no lock
