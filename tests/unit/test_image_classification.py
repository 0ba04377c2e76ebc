"""The image-classification plug-in: config composition, RegNet flavors, init, the three data sources and their
errors, and a short training run over a folder with an undecodable image."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardlab.distributed import env as dist_env
from shardlab.distributed.materialize import materialize
from shardlab.errors import ConfigError, DataError
from shardlab.runner import build_task, run_rank
from tests.conftest import compose_config

TINY_MODEL = ["model.depth=2", "model.w_0=8", "model.w_a=8", "model.group_width=8", "model.stem_width=8"]


def vision(*overrides: str):
    return compose_config(["task=image_classification", *overrides])


def one_line(error: Exception) -> str:
    message = str(error)
    assert "\n" not in message, message
    return message


# ---- config ------------------------------------------------------------------------------------------------------
def test_task_composes_small_regnet_embedded_data_sgd_cosine_warmup_and_label_smoothing():
    cfg = vision()
    assert cfg.task.name == "image_classification"
    assert (cfg.model.arch, cfg.data.source, cfg.data.path) == ("regnet_cifar", None, None)
    assert cfg.optimizer.name == "sgd" and cfg.lr_scheduler.name == "cosine" and cfg.lr_scheduler.warmup_steps > 0
    assert 0 < cfg.data.label_smoothing < 1


def test_model_choice_on_the_command_line_wins_over_the_task_default():
    cfg = vision("model=regnet_y_400mf", "distributed.backend=fully_sharded")
    assert (cfg.model.arch, cfg.model.flavor) == ("regnet", "regnet_y_400mf")


@pytest.mark.parametrize(
    "flavor, num_params",
    [("regnet_y_400mf", 4_344_144), ("regnet_y_1_6gf", 11_202_430), ("regnet_y_16gf", 83_590_140),
     ("regnet_y_128gf", 644_812_894)],
)  # fmt: skip
def test_flavor_configs_build_torchvision_regnets_on_meta(flavor, num_params):
    task = build_task(vision(f"model={flavor}", "data.source=fake"))  # fake: 1000 classes, like ImageNet
    with torch.device("meta"):
        model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == num_params  # torchvision's published sizes
    units = task.fsdp_units(model)
    assert units[0] is model.stem and units[-1] is model.fc
    assert sum(len(stage) for stage in model.trunk_output) == len(units) - 2


def test_unknown_flavor_raises_one_line_config_error_with_did_you_mean():
    with pytest.raises(ConfigError) as e:
        build_task(vision("model=regnet_y_400mf", "model.flavor=regnet_y_400gf"))
    assert one_line(e.value).startswith("model.flavor: 'regnet_y_400gf' is not a known RegNet flavor; known: ")
    assert "Did you mean 'regnet_y_400mf'?" in str(e.value)


def test_config_errors_are_collected_and_name_their_keys():
    with pytest.raises(ConfigError) as e:
        build_task(vision("model.w_0=12", "data.label_smoothing=1.0", "data.num_workers=-1"))
    message = one_line(e.value)
    for key in ("model.w_0", "data.label_smoothing", "data.num_workers"):  # data.source: tests/unit/test_config_fields
        assert key in message


def test_lm_path_never_imports_torchvision():
    """Nor, for a run without a pipeline, torch's pipelining: it imports torch._dynamo (~1 s at every CLI start)."""
    code = (
        "import sys; import shardlab.train, shardlab.cli.checks; from tests.conftest import compose_config; "
        "from shardlab.runner import build_task; build_task(compose_config(['task=lm'])); "
        "print(sorted(m for m in sys.modules if m.startswith(('torchvision', 'torch.distributed.pipelining'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- model -------------------------------------------------------------------------------------------------------
def test_init_fills_every_tensor_like_torchvision_and_is_deterministic():
    task = build_task(vision(*TINY_MODEL, "model.depth=4", "model.w_0=16", "model.w_a=16"))
    models = []
    for _ in range(2):
        with torch.device("meta"):
            model = task.build_model()
        materialize(model, torch.device("cpu"), task.init_tensor, seed=3)
        models.append(model)
    model = models[0]
    for (name, a), b in zip(model.state_dict().items(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and module.weight.numel() >= 2000:
            fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels
            assert module.weight.std().item() == pytest.approx(math.sqrt(2 / fan_out), rel=0.1), name
        if isinstance(module, nn.Conv2d) and module.bias is not None:  # squeeze-excitation: PyTorch's default
            bound = 1 / math.sqrt(module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1])
            assert module.bias.abs().max() <= bound and module.bias.std() > 0, name
        if isinstance(module, nn.BatchNorm2d):
            assert torch.equal(module.weight, torch.ones_like(module.weight))
            assert not module.bias.any() and not module.running_mean.any() and not module.num_batches_tracked
            assert torch.equal(module.running_var, torch.ones_like(module.running_var))
    assert model.fc.weight.std().item() == pytest.approx(0.01, rel=0.2) and not model.fc.bias.any()


def test_batchnorm_output_keeps_the_input_dtype():
    task = build_task(vision(*TINY_MODEL))
    model = task.build_model()
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert bn in task.full_precision_modules(model)
    assert bn(torch.randn(4, bn.num_features, 3, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert bn(torch.randn(4, bn.num_features, 3, 3)).dtype == torch.float32


def test_sync_batchnorm_without_a_process_group_is_batchnorm():
    from shardlab.distributed.sync_bn import SyncBatchNorm, convert_sync_batchnorm

    ref, mine = nn.BatchNorm2d(3), SyncBatchNorm(3)
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(mine(x), ref(x))
    torch.testing.assert_close(mine.running_var, ref.running_var)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    assert convert_sync_batchnorm(model, 0) is model and type(model[1]) is nn.BatchNorm2d  # one rank: unchanged


# ---- data --------------------------------------------------------------------------------------------------------
def test_embedded_images_are_deterministic_per_seed_and_balanced():
    from shardlab_tasks.image_classification.data import generate_shapes

    images, labels = generate_shapes(200, seed=5)
    again, again_labels = generate_shapes(200, seed=5)
    assert torch.equal(images, again) and torch.equal(labels, again_labels)
    assert images.shape == (200, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.bincount().tolist() == [20] * 10
    assert not torch.equal(generate_shapes(200, seed=6)[0], images)


def test_embedded_datasets_normalize_and_augment_with_the_global_rng():
    task = build_task(vision("data.num_train=40", "data.num_valid=20", "validation.batch_size=10"))
    task.prepare_data()
    assert (len(task.train_dataset), len(task.valid_dataset), task.num_classes()) == (40, 20, 10)
    image, label, skipped = task.valid_dataset[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and skipped == 0
    torch.manual_seed(0)
    first = task.train_dataset[0][0]
    torch.manual_seed(0)
    assert torch.equal(task.train_dataset[0][0], first)


@pytest.mark.parametrize("pad", [1, 4])
def test_reflect_pad_gives_the_bytes_of_torch_reflection_padding(pad):
    import torch.nn.functional as F

    from shardlab_tasks.image_classification.data import reflect_pad

    images = torch.randint(0, 256, (5, 3, 9, 12), dtype=torch.uint8)
    expected = F.pad(images.float(), [pad] * 4, mode="reflect").to(torch.uint8)
    assert torch.equal(reflect_pad(images, pad), expected)


def test_fake_source_gives_the_requested_size_and_classes():
    task = build_task(
        vision(
            "data.source=fake", "data.image_size=24", "data.num_train=4", "data.num_valid=8", "validation.batch_size=8"
        )
    )
    task.prepare_data()
    image, label, _ = task.train_dataset[0]
    assert image.shape == (3, 24, 24) and 0 <= label < 1000 and task.num_classes() == 1000


def write_images(directory, names, size=8):
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        Image.new("RGB", (size, size), (40 * i % 255, 90, 160)).save(directory / name)


@pytest.fixture
def image_tree(tmp_path):
    """train/ and val/ with two classes of 8x8 PNGs, and one file in train/b that is not an image."""
    for split, count in (("train", 4), ("val", 2)):
        for cls in ("a", "b"):
            write_images(tmp_path / split / cls, [f"{cls}{i}.png" for i in range(count)])
    (tmp_path / "train" / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return tmp_path


def folder_task(path, *overrides: str):
    task = build_task(vision(f"data.path={path}", "data.image_size=8", "validation.batch_size=4", *overrides))
    task.prepare_data()
    return task


@pytest.mark.parametrize("layout", ["no_split_dirs", "empty_class_dirs"])
def test_folder_without_class_folders_raises_one_line_data_error_naming_the_path(tmp_path, layout):
    if layout == "empty_class_dirs":
        (tmp_path / "train").mkdir()
        (tmp_path / "val").mkdir()
        write_images(tmp_path / "train", ["loose.png"])  # an image, but not in a class folder
    with pytest.raises(DataError) as e:
        folder_task(tmp_path)
    assert one_line(e.value).startswith("data.path: ") and str(tmp_path) in str(e.value)


def test_cli_answers_a_path_without_class_folders_in_one_line_with_exit_code_2(tmp_path, cli_forks):
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "val").mkdir()
    args = ["task=image_classification", f"data.path={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"]
    out = cli_forks.run(*args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        f"error: data.path: {tmp_path / 'data' / 'train'} has no class folders with images (Couldn't find any class "
        f"folder in {tmp_path / 'data' / 'train'}); expected {tmp_path / 'data' / 'train'}/<class>/<image>"
    )


def test_undecodable_image_raises_one_line_data_error_naming_the_file(image_tree):
    task = folder_task(image_tree)
    broken = next(i for i, (p, _) in enumerate(task.train_dataset.folder.samples) if p.endswith("broken.png"))
    with pytest.raises(DataError) as e:
        task.train_dataset[broken]
    assert str(image_tree / "train" / "b" / "broken.png") in one_line(e.value)
    assert "data.skip_corrupt=true" in str(e.value)


def test_undecodable_image_read_by_a_dataloader_worker_is_the_same_one_line(image_tree, tmp_path):
    """torch raises a worker's error again as "Caught DataError in DataLoader worker process 0. / Original
    Traceback ...": the user sees the error's own line, as with data.num_workers=0."""
    overrides = [
        f"data.path={image_tree}",
        "data.image_size=8",
        "data.num_workers=2",
        *TINY_MODEL,
        "optimization.batch_size=3",
        "optimization.max_steps=3",  # 9 samples: the whole train split, broken.png included
        "lr_scheduler.warmup_steps=0",
        "validation.interval_steps=0",
        "validation.batch_size=4",
        "checkpoint.save=false",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    with pytest.raises(DataError) as e:
        run_rank(vision(*overrides), tmp_path, dist_env.detect())
    assert one_line(e.value).startswith("data.path: ") or str(image_tree) in str(e.value), str(e.value)
    assert str(image_tree / "train" / "b" / "broken.png") in str(e.value) and "data.skip_corrupt=true" in str(e.value)
    assert "DataLoader worker" not in str(e.value)


def test_skip_corrupt_passes_over_the_file_counts_it_and_training_finishes(image_tree, tmp_path_factory, capsys):
    overrides = [
        f"data.path={image_tree}",
        "data.image_size=8",
        "data.skip_corrupt=true",
        *TINY_MODEL,
        "optimization.batch_size=3",
        "optimization.max_steps=3",  # 9 samples: the whole train split (with broken.png) once
        "lr_scheduler.warmup_steps=0",
        "validation.interval_steps=0",
        "validation.batch_size=4",
        "checkpoint.interval_steps=0",
        "logging.interval_steps=3",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    result = run_rank(vision(*overrides), tmp_path_factory.mktemp("skip_run"), dist_env.detect())
    train = [r for r in result["history"] if r["split"] == "train"]
    assert train[-1]["skipped"] == 1 and math.isfinite(train[-1]["loss"])
    assert result["final"]["top1"] in (0.0, 25.0, 50.0, 75.0, 100.0)  # one validation batch: val/'s 4 images
    assert "skipping undecodable image" in capsys.readouterr().err
