"""model.pretrained for the vision tasks: torchvision's RegNet weights as the trunk of image classification and of
the self-supervised tasks, the head new; refused in one line where they do not fit; probed by shardlab-evaluate."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from shardlab.distributed import env as dist_env
from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import model_on_meta
from shardlab.errors import ConfigError
from shardlab.runner import build_task, run_rank
from shardlab_commands import evaluate
from shardlab_tasks.image_classification import pretrained
from tests.conftest import compose_config
from tests.ssl_configs import TINY_REGNET, TINY_SSL
from tests.vision_weights import features, images, regnet_y_400mf_file, tiny_file

RUN = ["optimization.batch_size=8", "optimization.max_steps=2", "lr_scheduler.warmup_steps=0"]
RUN += ["validation.interval_steps=0", "logging.interval_steps=1", "logging.progress_bar=false"]
RUN += ["logging.tensorboard=false"]
RUN += ["data.num_train=64", "data.num_valid=32", "validation.batch_size=16", "checkpoint.interval_steps=2"]


@pytest.fixture(scope="module")
def y400(tmp_path_factory):
    return regnet_y_400mf_file(tmp_path_factory.mktemp("tv") / "regnet_y_400mf.pth")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_file(tmp_path_factory.mktemp("tv") / "tiny.pth")


def built(*overrides: str, load: bool = True):
    """The task of ``overrides`` and its model as one process starts it: on meta, materialized from the seed, then
    (``load``) model.pretrained read into it."""
    task = build_task(compose_config(list(overrides)), world_size=1)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    if load:
        assert task.load_pretrained(model, torch.device("cpu")) is not None
    return task, model.eval()


def trunk_state(model, prefix: str = "") -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in model.state_dict().items() if k.startswith(prefix)}


# ---- what is loaded ------------------------------------------------------------------------------------------------
def test_regnet_y_400mf_weights_give_torchvisions_features_and_a_new_seeded_classifier(y400):
    source, path = y400
    task, model = built("task=image_classification", "model=regnet_y_400mf", f"model.pretrained={path}")
    batch = images(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(task.features(model, batch), features(source, batch), rtol=1e-4, atol=1e-5)
    state, expected = trunk_state(model), source.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in state if not k.startswith("fc."))  # buffers too
    # the classifier: the data's 10 classes, as the seed initialises it without the file (not ImageNet's 1000)
    _, seeded = built("task=image_classification", "model=regnet_y_400mf", load=False)
    assert model.fc.weight.shape == (10, 440) and torch.equal(model.fc.weight, seeded.fc.weight)


@pytest.mark.parametrize("method", ["swav", "simclr", "dino"])
def test_the_self_supervised_trunk_is_torchvisions_and_its_heads_are_seeded(tiny, method):
    source, path = tiny
    common = [f"task={method}", *TINY_SSL]
    task, model = built(*common, f"model.pretrained={path}")
    batch = images(4, 16)
    torch.testing.assert_close(task.features(model, batch), features(source, batch), rtol=1e-4, atol=1e-5)
    _, seeded = built(*common, load=False)
    heads = {k: v for k, v in model.state_dict().items() if not k.startswith("trunk.")}
    assert heads and all(torch.equal(v, seeded.state_dict()[k]) for k, v in heads.items())
    trunk = trunk_state(model, "trunk.")
    assert trunk and all(torch.equal(v, source.state_dict()[k]) for k, v in trunk.items())


def test_a_run_starts_from_the_file_and_trains_and_its_checkpoint_starts_another_run(tiny, tmp_path):
    _, path = tiny
    seen = {}

    def after_fit(trainer):
        seen["initialized_from"] = trainer.initialized_from
        return {}

    cfg = compose_config(["task=image_classification", *TINY_REGNET, *RUN, f"model.pretrained={path}"])
    result = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=after_fit)
    train = [r for r in result["history"] if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert seen["initialized_from"] == path
    # its checkpoint starts a run without the file: where the first weights came from is no model shape
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    cfg = compose_config(["task=image_classification", *TINY_REGNET, *RUN, f"checkpoint.init_from={step}"])
    run_rank(cfg, tmp_path / "next", dist_env.detect(), after_fit=after_fit)
    assert seen["initialized_from"] == step


# ---- what is refused -----------------------------------------------------------------------------------------------
def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        build_task(compose_config(list(overrides)), world_size=1)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_weights_of_another_shape_are_refused_naming_the_first_misfit_and_the_flavor_they_are(y400, tiny, tmp_path):
    _, path = y400
    message = refused("task=image_classification", "model=regnet_y_1_6gf", f"model.pretrained={path}")
    assert "stem.0.weight" not in message and "is [" in message and "in the trunk" in message
    assert "it is torchvision's regnet_y_400mf: use model.arch=regnet model.flavor=regnet_y_400mf" in message
    state = torch.load(tiny[1], weights_only=True)
    del state["trunk_output.block1.block1-0.f.se.fc1.weight"]
    torch.save(state, tmp_path / "missing.pth")
    message = refused("task=swav", *TINY_SSL, f"model.pretrained={tmp_path / 'missing.pth'}")
    assert "has no trunk_output.block1.block1-0.f.se.fc1.weight, which the trunk has (shape [" in message
    torch.save({**torch.load(tiny[1], weights_only=True), "extra.weight": torch.ones(1)}, tmp_path / "extra.pth")
    message = refused("task=image_classification", *TINY_REGNET, f"model.pretrained={tmp_path / 'extra.pth'}")
    assert "the file's extra.weight has no place in the trunk" in message


def test_a_file_that_is_no_state_dict_is_refused_in_one_line(tiny, tmp_path):
    vision = ["task=image_classification", *TINY_REGNET]
    torch.save({"model": torch.load(tiny[1], weights_only=True)}, tmp_path / "wrapped.pth")
    assert "holds a dict with keys ['model'], not a state dict" in refused(
        *vision, f"model.pretrained={tmp_path / 'wrapped.pth'}"
    )
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pth")  # a pickled class: weights_only refuses to build it
    message = refused(*vision, f"model.pretrained={tmp_path / 'module.pth'}")
    assert "is not a state dict that torch.load(weights_only=True) reads" in message
    assert "weights_only=False" not in message  # torch's advice to turn the restriction off is not passed on
    (tmp_path / "notes.txt").write_text("hello")
    assert "is not a state dict" in refused(*vision, f"model.pretrained={tmp_path / 'notes.txt'}")
    assert "cannot be opened (No such file" in refused(*vision, f"model.pretrained={tmp_path / 'gone.pth'}")
    assert "both give the starting weights" in refused(*vision, f"model.pretrained={tiny[1]}", "checkpoint.init_from=x")


def test_a_fifo_or_a_folder_is_refused_without_blocking_and_a_file_over_the_cap_unread(tiny, tmp_path, monkeypatch):
    vision = ["task=image_classification", *TINY_REGNET]
    os.mkfifo(tmp_path / "fifo.pth")
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(refused(*vision, f"model.pretrained={tmp_path}/fifo.pth")))
    worker.start()
    worker.join(timeout=20)
    assert outcome and "is not a regular file" in outcome[0]  # opening a FIFO to read would wait for a writer
    assert "is not a regular file" in refused(*vision, f"model.pretrained={tmp_path}")
    monkeypatch.setattr(pretrained, "MAX_BYTES", os.path.getsize(tiny[1]) - 1)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a file over the cap was read"))
    assert f"more than the {pretrained.MAX_BYTES} of any torchvision" in refused(*vision, f"model.pretrained={tiny[1]}")


# ---- shardlab-evaluate probes it -------------------------------------------------------------------------------------
def test_evaluate_probes_the_files_trunk_and_a_checkpoint_that_started_from_it_without_the_file(tiny, tmp_path):
    from shardlab_tasks.image_classification.data import open_datasets
    from shardlab_tasks.image_classification.evaluation import labelled_data

    source, path = tiny
    arch = ["task=image_classification", *TINY_REGNET, "data.num_train=64", "data.num_test=32"]
    probe = ["--epochs", "3", "--k", "5", "--cache-dir", str(tmp_path / "cache")]
    results = evaluate.main([*arch, f"model.pretrained={path}", *probe])
    assert set(results) == {"linear_top1", "linear_top5", "knn_top1"}
    (cached,) = (tmp_path / "cache").glob("features-*.safetensors")
    train_set, _, _ = open_datasets(labelled_data(compose_config(arch)))
    train_images = torch.stack([train_set[i][0] for i in range(len(train_set))])
    # the features the probe trained on are torchvision's model's (BatchNorm's own statistics: none re-estimated)
    torch.testing.assert_close(load_file(str(cached))["train_features"], features(source, train_images), rtol=1e-4,
                               atol=1e-5)  # fmt: skip
    random = evaluate.main([*arch, "--random-init", *probe])
    assert len(list((tmp_path / "cache").glob("features-*"))) == 2 and random != results

    with pytest.raises(ConfigError, match="give one"):
        evaluate.main([str(tmp_path), f"model.pretrained={path}"])
    # a checkpoint of a run that started from the file is its own weights: the file may be gone by then
    copy = tmp_path / "moved.pth"
    copy.write_bytes(path.read_bytes())
    run_rank(compose_config([*arch, *RUN, f"model.pretrained={copy}"]), tmp_path / "run", dist_env.detect())
    copy.unlink()
    assert set(evaluate.main([str(tmp_path / "run" / "checkpoints" / "step_00000002"), "--knn", "--k", "5"])) == {
        "knn_top1"
    }
