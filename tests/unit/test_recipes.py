"""The ImageNet recipes (conf/experiment/*.yaml, selected with +experiment=NAME): each names every setting that
differs from its method's embedded default, counts its steps in epochs of ImageNet-1k at its batch, plans at its shape
without error (a dry run on the meta device, as ``python -m shardlab.train ... dry_run=true`` does), and docs/vision.md
shows the values the files hold, so the docs cannot drift from what runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from shardlab.cli.preflight import compose_config
from shardlab.config import CONF_DIR
from shardlab.runner import run_job

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((CONF_DIR / "experiment").glob("*.yaml"))
IMAGENET_TRAIN, IMAGENET_VAL = 1_281_167, 50_000

NAMED = [  # the toy defaults of these would not do on ImageNet: every recipe sets each itself
    *("task.projection_dims", "task.temperature", "model.flavor"),
    *("data.image_size", "data.num_global_crops", "data.global_crop_scale", "data.num_local_crops"),
    *("data.color_jitter", "data.grayscale_prob", "data.blur_prob"),
    *("optimizer.lr", "optimizer.weight_decay", "lr_scheduler.warmup_steps", "lr_scheduler.min_lr_ratio"),
    *("optimization.max_steps", "optimization.batch_size", "distributed.world_size"),
    *("validation.batch_size", "validation.interval_steps", "checkpoint.interval_steps"),
]
NAMED_BY_METHOD = {
    "swav": [
        *("task.num_prototypes", "task.epsilon", "task.freeze_prototypes_steps", "task.queue_length"),
        "task.warmup_temperature_steps",
    ],
    "swav+queue": ["task.queue_start_step"],
    "multicrop": ["data.local_crop_size", "data.local_crop_scale"],
}


def method(path: Path) -> str:
    """The task a recipe selects (its ``override /task: NAME``)."""
    found = re.search(r"^\s*- override /task: (\w+)", path.read_text(), re.MULTILINE)
    assert found, f"{path.name}: a recipe names its task with '- override /task: NAME' in its defaults"
    return found[1]


def recipe(path: Path):
    """The recipe's own settings (not what it inherits), with its model flavor from the option it picks."""
    raw = OmegaConf.load(path)
    model = re.search(r"^\s*- override /model: (\w+)", path.read_text(), re.MULTILINE)
    if model and OmegaConf.select(raw, "model.flavor") is None:
        OmegaConf.update(raw, "model.flavor", OmegaConf.load(CONF_DIR / "model" / f"{model[1]}.yaml").flavor)
    return raw


def test_the_swav_and_simclr_recipes_are_at_imagenet_scale():
    names = {p.stem for p in RECIPES}
    assert {"swav_in1k", "simclr_in1k"} <= names, names
    for name in ("swav_in1k", "simclr_in1k"):
        raw = recipe(CONF_DIR / "experiment" / f"{name}.yaml")
        assert (raw.optimization.batch_size, raw.distributed.world_size, raw.data.image_size) == (4096, 32, 224)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipe_names_every_setting_that_differs_from_the_toy_default(path):
    raw = recipe(path)
    needed = list(NAMED)
    if method(path) == "swav":
        needed += NAMED_BY_METHOD["swav"] + (NAMED_BY_METHOD["swav+queue"] if raw.task.queue_length else [])
    if OmegaConf.select(raw, "data.num_local_crops"):
        needed += NAMED_BY_METHOD["multicrop"]
    missing = [key for key in needed if OmegaConf.select(raw, key) is None]
    assert not missing, f"{path.name} inherits the embedded default of {missing}; name them"
    assert raw.data.image_size >= 224 and raw.model.flavor.startswith("regnet_")


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipes_steps_are_whole_epochs_of_imagenet_at_its_batch(path):
    raw = recipe(path)
    per_epoch = IMAGENET_TRAIN / (raw.optimization.batch_size * raw.optimization.get("update_freq", 1))
    counts = {
        key: OmegaConf.select(raw, key)
        for key in (
            "optimization.max_steps",
            "lr_scheduler.warmup_steps",
            "task.freeze_prototypes_steps",
            "task.queue_start_step",
            "task.freeze_last_layer_steps",
            "task.warmup_teacher_temperature_steps",
        )
    }
    for key, steps in counts.items():
        if steps:  # null (not the method's) or 0 (off)
            epochs = round(steps / per_epoch)
            assert epochs >= 1 and steps == round(epochs * per_epoch), f"{path.name}: {key}={steps} is not whole epochs"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipe_dry_runs_at_its_shape(path, tmp_path, capsys):
    # The ImageNet shape without ImageNet: fake images of its size, classes and counts (drawn lazily: nothing read).
    overrides = [f"+experiment={path.stem}", "data.source=fake", "data.num_fake_classes=1000"]
    overrides += [f"data.num_train={IMAGENET_TRAIN}", f"data.num_valid={IMAGENET_VAL}"]
    overrides += ["dry_run=true", "distributed.plan_device=h100_80gb"]
    cfg = compose_config(overrides)
    assert cfg.task.name == method(path)
    raw = recipe(path)
    for key in ("optimization.max_steps", "optimizer.lr", "task.temperature", "distributed.world_size"):
        assert OmegaConf.select(cfg, key) == OmegaConf.select(raw, key), f"{key}: the composed run is not the recipe"
    assert run_job(cfg, tmp_path, overrides) is None  # the CLI's path: every check, then the plan; nothing started
    out = capsys.readouterr().out
    per_rank = raw.optimization.batch_size // raw.distributed.world_size
    assert f"({cfg.distributed.backend}, {per_rank} samples per micro-batch)" in out, out
    device, capacity = map(float, re.search(r"= ([\d.]+) GiB of ([\d.]+)\n", out).groups())
    assert device < capacity, f"{path.name} does not fit an H100 at its shape: {device} GiB of {capacity}"
    assert not any((tmp_path / "checkpoints").glob("*")) and "planned in" in out


UNSET = object()


def cell_text(value) -> str:
    """A value as the docs' recipe table shows it: yaml's true/false and null, Python's numbers and lists, - for
    unset."""
    if value is UNSET:
        return "-"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)


def test_docs_show_each_recipes_values_as_the_file_holds_them():
    """docs/vision.md's recipe table: a column per recipe file, a row per key; each cell is the file's value (``-``:
    the recipe does not set it, e.g. a SwAV key in SimCLR's)."""
    text = (REPO / "docs" / "vision.md").read_text()
    table = re.search(r"<!-- recipes: conf/experiment -->\n(.*?)\n\n", text, re.DOTALL)
    assert table, "docs/vision.md lacks the recipe table after '<!-- recipes: conf/experiment -->'"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[1].splitlines()]
    header, body = rows[0], rows[2:]
    columns = [re.sub(r"[`*]", "", c) for c in header[1:]]
    assert sorted(columns) == [p.stem for p in RECIPES], "one column per conf/experiment/*.yaml"
    wrong = []
    for row in body:
        key = row[0].strip("`")
        for name, cell in zip(columns, row[1:], strict=True):
            value = OmegaConf.select(recipe(CONF_DIR / "experiment" / f"{name}.yaml"), key, default=UNSET)
            shown = cell_text(value)
            if cell.strip("`") != shown:
                wrong.append(f"{key} of {name}: docs {cell}, file {shown}")
    assert not wrong, wrong
    shown_keys = {row[0].strip("`") for row in body}
    for path in RECIPES:  # every key a recipe sets is in the table (bookkeeping keys aside)
        raw = recipe(path)
        keys = {f"{s}.{k}" for s in raw if s != "defaults" for k in raw[s]}
        hidden = keys - shown_keys - {"data.num_workers", "logging.interval_steps", "optimization.update_freq"}
        assert not hidden, f"{path.name} sets {sorted(hidden)}, which the docs' table does not show"
