"""shardlab-evaluate: a linear probe and kNN on frozen features of a vision checkpoint (or of a random trunk), an LM
checkpoint's perplexity, and one-line answers to mistakes."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from omegaconf import OmegaConf

from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError
from shardlab.runner import build_task, run_rank
from shardlab.train import run_tool
from shardlab_commands import consolidate, evaluate
from shardlab_tasks.image_classification import evaluation as trunk_evaluation
from shardlab_tasks.image_classification.probe import knn_scores, standardize, top_k_accuracy, train_linear
from tests.conftest import compose_config
from tests.ssl_configs import TINY_VISION

# tests/ssl_configs.py's tiny RegNetY classifier, trained 3 steps, checkpointed at the last.
VISION_RUN = [
    *TINY_VISION,
    "data.num_train=120",
    "data.num_valid=60",
    "optimization.batch_size=20",
    "optimization.max_steps=3",
    "lr_scheduler.warmup_steps=0",
    "validation.batch_size=30",
    "checkpoint.interval_steps=3",
]
PROBE = ["--epochs", "3", "--k", "5"]


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vision_run")
    run_rank(compose_config(VISION_RUN), run_dir, dist_env.detect())
    return run_dir / "checkpoints" / "step_00000003"


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory, corpus_cache):
    from tests.conftest import TINY_LM

    run_dir = tmp_path_factory.mktemp("lm_run")
    overrides = ["data.max_corpus_mb=0.05", "optimization.max_steps=4", "validation.interval_steps=4"]
    # batch 1: the trainer's validation then covers every block of the split, as the tool does
    overrides += ["validation.num_batches=0", "validation.batch_size=1", "checkpoint.interval_steps=4"]
    overrides += [f"data.cache_dir={corpus_cache}"]
    result = run_rank(compose_config([*TINY_LM, *overrides]), run_dir, dist_env.detect())
    # evaluate reads data from its own command line (never the checkpoint's config): it names the same cache
    return run_dir / "checkpoints" / "step_00000004", result["final"], f"data.cache_dir={corpus_cache}"


# ---- the probes on features ------------------------------------------------------------------------------------------
def separable(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Five classes around distinct centres in 16-d, unit noise: linearly separable up to a few overlaps."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)) * 4
    labels = torch.arange(num) % 5
    return centres[labels] + torch.randn(num, 16, generator=g) + 10, labels  # + 10: standardize must cope


def test_linear_probe_reaches_high_accuracy_on_separable_features_and_is_seeded():
    (train_x, train_y), (test_x, test_y) = separable(500, seed=1), separable(200, seed=2)
    train_n, test_n = standardize(train_x, test_x)
    linear = train_linear(train_n, train_y, 5, epochs=20, batch_size=64, lr=0.1, weight_decay=5e-4, seed=0)
    assert top_k_accuracy(linear(test_n), test_y) > 95
    again = train_linear(train_n, train_y, 5, epochs=20, batch_size=64, lr=0.1, weight_decay=5e-4, seed=0)
    assert torch.equal(linear.weight, again.weight)
    other = train_linear(train_n, train_y, 5, epochs=20, batch_size=64, lr=0.1, weight_decay=5e-4, seed=1)
    assert not torch.equal(linear.weight, other.weight)


def test_linear_probe_trains_under_no_grad():
    x, y = separable(100, seed=1)
    with torch.no_grad():
        linear = train_linear(x, y, 5, epochs=2, batch_size=50, lr=0.1, weight_decay=0.0, seed=0)
    assert linear.weight.abs().max() > 0.05  # moved from its N(0, 0.01) start


def test_knn_on_identical_train_and_test_features_is_exact():
    x = torch.randn(300, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 7, (300,), generator=torch.Generator().manual_seed(1))
    assert top_k_accuracy(knn_scores(x, y, x, num_classes=7, k=20, temperature=0.07, chunk=64), y) == 100.0


def test_knn_weighs_neighbours_by_similarity_over_temperature():
    # Two near neighbours of class 0 and three farther ones of class 1: a sharp vote follows the near ones, a flat
    # vote (high temperature) the majority.
    train = torch.tensor([[1.0, 0.1], [1.0, -0.1], [1.0, 1.0], [1.0, 1.1], [1.0, 0.9]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    query = torch.tensor([[1.0, 0.0]])
    assert knn_scores(train, labels, query, 2, k=5, temperature=0.01).argmax() == 0
    assert knn_scores(train, labels, query, 2, k=5, temperature=100.0).argmax() == 1


def test_image_classification_features_are_what_its_classifier_sees():
    task = build_task(compose_config(VISION_RUN))
    model = task.build_model().eval()
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model.fc(task.features(model, images)), model(images))


# ---- the command on vision checkpoints -------------------------------------------------------------------------------
def test_vision_checkpoint_folder_and_safetensors_give_the_same_figures(vision_checkpoint, tmp_path, capsys):
    from_folder = evaluate.main([str(vision_checkpoint), *PROBE])
    out = capsys.readouterr().out
    assert "linear probe: top-1" in out and "kNN: top-1" in out
    assert set(from_folder) == {"linear_top1", "linear_top5", "knn_top1"}
    assert all(0 <= v <= 100 for v in from_folder.values())

    weights_file = consolidate.consolidate(vision_checkpoint, tmp_path / "model.safetensors")
    assert evaluate.main([str(weights_file), *PROBE, "--out", str(tmp_path / "r.json")]) == from_folder
    report = OmegaConf.load(tmp_path / "r.json")
    assert report.results.linear_top1 == from_folder["linear_top1"] and report.task == "image_classification"


def test_random_trunk_of_a_checkpoints_architecture_is_the_composed_one(vision_checkpoint):
    random_of_checkpoint = evaluate.main([str(vision_checkpoint), "--random-init", "--knn", *PROBE])
    composed = evaluate.main(["--random-init", "--knn", *PROBE, *VISION_RUN])
    assert random_of_checkpoint == composed  # same architecture, same seed: the same trunk
    trained = evaluate.main([str(vision_checkpoint), "--knn", *PROBE])
    reseeded = evaluate.main(["--random-init", "--knn", *PROBE, *VISION_RUN, "seed=7"])
    assert trained != composed and reseeded != composed


def test_a_supervised_checkpoint_is_probed_on_an_image_folder_with_other_classes(vision_checkpoint, tmp_path):
    from PIL import Image

    # Two classes (dark, bright) in train/ and val/: the checkpoint's classifier has 10 outputs, which the probe
    # does not use; its model is built as trained and only the probe's data changes.
    for split, count in (("train", 6), ("val", 4)):
        for label, shade in (("dark", 30), ("bright", 220)):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (20, 20), (shade, shade - 10 * i, 128)).save(tmp_path / split / label / f"{i}.png")
    folder = [f"data.path={tmp_path}", "data.source=folder", "data.image_size=16", "data.num_workers=2"]
    results = evaluate.main([str(vision_checkpoint), "--knn", "--k", "3", "--batch-size", "5", *folder])
    assert results["knn_top1"] == 100.0  # brightness alone separates the classes


def test_features_cache_is_reused_and_keyed_by_the_weights(vision_checkpoint, tmp_path, capsys):
    first = evaluate.main([str(vision_checkpoint), *PROBE, "--cache-dir", str(tmp_path)])
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 1
    capsys.readouterr()
    assert evaluate.main([str(vision_checkpoint), *PROBE, "--cache-dir", str(tmp_path)]) == first
    assert "features: read from" in capsys.readouterr().out
    evaluate.main([str(vision_checkpoint), "--random-init", *PROBE, "--cache-dir", str(tmp_path)])
    assert len(list(tmp_path.glob("features-*.safetensors"))) == 2


# ---- the splits: train, valid (choosing recipes), test (reported) ----------------------------------------------------
def test_embedded_test_split_is_disjoint_and_the_same_whatever_the_train_and_validation_sizes():
    from shardlab_tasks.image_classification.config import ImageDataConfig
    from shardlab_tasks.image_classification.data import generate_shapes, open_datasets, open_test

    data = ImageDataConfig(image_size=16, num_train=80, num_valid=40, num_test=40, augment=False)
    train, valid, _ = open_datasets(data)
    test = open_test(data)
    assert (len(train), len(valid), len(test)) == (80, 40, 40)
    # train and validation stay the first draw's images (the runs and parity tests before the test split see them)
    images, labels = generate_shapes(120, 0, 16)
    assert torch.equal(train.images, images[:80]) and torch.equal(valid.labels, labels[80:])
    rows = {bytes(x.flatten().tolist()) for x in torch.cat([train.images, valid.images])}
    assert not any(bytes(x.flatten().tolist()) in rows for x in test.images)  # no test image is a train/valid one
    assert set(test.labels.tolist()) == set(range(10))
    other_sizes = open_test(ImageDataConfig(image_size=16, num_train=20, num_valid=10, num_test=40))
    assert torch.equal(other_sizes.images, test.images) and torch.equal(other_sizes.labels, test.labels)
    other_seed = open_test(ImageDataConfig(image_size=16, num_train=80, num_valid=40, num_test=40, seed=1))
    assert not torch.equal(other_seed.images, test.images)


def test_fake_test_split_follows_the_validation_samples():
    from shardlab_tasks.image_classification.config import ImageDataConfig
    from shardlab_tasks.image_classification.data import open_datasets, open_test

    data = ImageDataConfig(source="fake", image_size=8, num_train=6, num_valid=4, num_test=3, num_fake_classes=5)
    train, valid, _ = open_datasets(data)
    test = open_test(data)
    seen = [train[i][0] for i in range(6)] + [valid[i][0] for i in range(4)]
    assert len(test) == 3 and not any(torch.equal(test[i][0], x) for i in range(3) for x in seen)


def test_evaluate_judges_the_test_split_unless_asked_for_validation(vision_checkpoint, tmp_path, capsys):
    sizes = ["data.num_valid=60", "data.num_test=40"]
    test = evaluate.main([str(vision_checkpoint), "--knn", *PROBE, *sizes, "--out", str(tmp_path / "t.json")])
    assert "(on the 40 images of the test split)" in capsys.readouterr().out
    assert OmegaConf.load(tmp_path / "t.json").meta.settings.split == "test"
    valid = evaluate.main([str(vision_checkpoint), "--knn", *PROBE, *sizes, "--split", "val"])
    assert "(on the 60 images of the valid split)" in capsys.readouterr().out
    assert valid == evaluate.main([str(vision_checkpoint), "--knn", *PROBE, *sizes, "--split", "valid"])
    assert "BatchNorm" not in capsys.readouterr().out  # a trained trunk keeps its statistics by default
    assert test != valid


def test_recompute_bn_gives_each_layer_the_train_splits_batch_statistics_by_hand():
    from torch import nn
    from torch.utils.data import TensorDataset

    from shardlab_tasks.image_classification.probe import recompute_bn_stats

    g = torch.Generator().manual_seed(0)
    conv, bn1, bn2 = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm1d(4)
    with torch.no_grad():
        for p in (conv.weight, conv.bias, bn1.weight, bn1.bias):
            p.copy_(torch.randn(p.shape, generator=g))
    head = nn.BatchNorm1d(4)  # not on the features' path, as a self-supervised projection head's
    head.running_mean.fill_(3.0)
    model = nn.ModuleDict({"conv": conv, "bn1": bn1, "bn2": bn2, "head": head})

    def features(images):  # as the self-supervised task's: it puts the model in eval mode itself
        model.eval()
        return model["bn2"](model["bn1"](model["conv"](images)).relu().mean((2, 3)))

    images = torch.randn(12, 3, 5, 5, generator=g) * 3 + 1
    count = recompute_bn_stats(model, features, TensorDataset(images, torch.zeros(12)), 6, 0, torch.device("cpu"))
    assert count == 2 and torch.equal(head.running_mean, torch.full((4,), 3.0)) and int(head.num_batches_tracked) == 0

    # by hand: two batches of 6, each BN normalizing with its batch's statistics; running = mean over the batches of
    # each batch's mean and unbiased variance (torch's cumulative average, momentum=None)
    def stats(x, dims):
        return (
            x.mean(dims),
            x.var(dims, unbiased=True),
            (x - x.mean(dims, keepdim=True)) / (x.var(dims, unbiased=False, keepdim=True) + 1e-5).sqrt(),
        )

    expected = {"bn1": [], "bn2": []}
    with torch.no_grad():
        for batch in images.split(6):
            h = conv(batch)
            mean, var, normed = stats(h, (0, 2, 3))
            expected["bn1"].append((mean, var))
            h = (normed * bn1.weight[:, None, None] + bn1.bias[:, None, None]).relu().mean((2, 3))
            expected["bn2"].append(stats(h, (0,))[:2])
    for name, bn in (("bn1", bn1), ("bn2", bn2)):
        torch.testing.assert_close(bn.running_mean, torch.stack([m for m, _ in expected[name]]).mean(0))
        torch.testing.assert_close(bn.running_var, torch.stack([v for _, v in expected[name]]).mean(0))
        assert bn.momentum == 0.1 and not bn.training and int(bn.num_batches_tracked) == 2
    assert not conv.weight.requires_grad or conv.weight.grad is None


def test_a_random_trunk_is_probed_with_batchnorm_statistics_of_the_train_split(vision_checkpoint, capsys):
    recomputed = evaluate.main([str(vision_checkpoint), "--random-init", "--knn", *PROBE])
    assert "BatchNorm: running statistics of" in capsys.readouterr().out
    as_initialised = evaluate.main([str(vision_checkpoint), "--random-init", "--knn", *PROBE, "--no-recompute-bn"])
    assert "BatchNorm" not in capsys.readouterr().out
    assert recomputed != as_initialised


def test_averaged_weights_and_a_random_trunk_get_batchnorm_statistics_of_their_own_by_default():
    """--ema's average holds parameters only (its BatchNorm buffers are the student's) and --random-init's buffers are
    its init's: both re-estimate them unless told not to; a trained trunk keeps its own."""
    from argparse import Namespace

    def resolved(**given) -> bool:
        args = Namespace(**{"split": None, "random_init": False, "ema": False, "recompute_bn": None, **given})
        trunk_evaluation.resolve_split(args, ("linear", "knn"))
        return args.recompute_bn

    assert resolved(ema=True) and resolved(random_init=True) and not resolved()
    assert not resolved(ema=True, recompute_bn=False) and resolved(recompute_bn=True)


def test_the_feature_cache_is_keyed_by_split_batchnorm_statistics_and_ema_weights(tmp_path):
    import argparse

    cfg = compose_config(VISION_RUN)
    base = dict(random_init=False, checkpoint=tmp_path, ema=False, split="test", recompute_bn=False)
    key = trunk_evaluation.cache_key(argparse.Namespace(**base), cfg, {"step": 3})
    assert key == trunk_evaluation.cache_key(argparse.Namespace(**base), cfg, {"step": 3})
    for change in ({"split": "valid"}, {"recompute_bn": True}, {"ema": True}):
        assert trunk_evaluation.cache_key(argparse.Namespace(**{**base, **change}), cfg, {"step": 3}) != key, change


# ---- the command on LM checkpoints -----------------------------------------------------------------------------------
def test_lm_perplexity_equals_the_trainers_validation_perplexity(lm_checkpoint, capsys):
    checkpoint, final, cache = lm_checkpoint
    results = evaluate.main([str(checkpoint), "--batch-size", "16", cache])
    torch.testing.assert_close(results["ppl"], final["ppl"], rtol=1e-5, atol=0)
    torch.testing.assert_close(results["loss"], final["loss"], rtol=1e-5, atol=0)
    assert "perplexity:" in capsys.readouterr().out


def test_lm_perplexity_of_the_whole_corpus_covers_both_splits(lm_checkpoint):
    checkpoint, _, cache = lm_checkpoint
    valid = evaluate.main([str(checkpoint), "--perplexity", "--batch-size", "64", cache])
    train = evaluate.main([str(checkpoint), "--split", "train", "--batch-size", "64", cache])
    whole = evaluate.main([str(checkpoint), "--split", "all", "--batch-size", "64", cache])
    assert whole["tokens"] == train["tokens"] + valid["tokens"]
    assert min(train["ppl"], valid["ppl"]) <= whole["ppl"] <= max(train["ppl"], valid["ppl"])


def test_lm_perplexity_of_another_corpus_counts_every_token_of_it(lm_checkpoint, tmp_path):
    checkpoint, _, _ = lm_checkpoint
    text = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(60))
    (tmp_path / "held_out.txt").write_text(text)
    results = evaluate.main([str(checkpoint), f"data.path={tmp_path / 'held_out.txt'}", "--split", "all"])
    # byte tokens: the text and one end-of-document token, scored in whole blocks of data.seq_len (32). One file is
    # one document, which the split cuts inside (docs/corpora.md: fewer documents than the split needs), and each
    # split is scored in its own whole blocks: less than a block of each split goes unscored.
    tokens = len(text.encode()) + 1
    assert results["tokens"] % 32 == 0 and tokens - 2 * 32 < results["tokens"] <= tokens
    assert 1 < results["ppl"] < 320


# ---- mistakes: one line, exit code 2 ---------------------------------------------------------------------------------
def answer(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_tool(lambda: evaluate.main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_mistakes_are_answered_in_one_line(vision_checkpoint, lm_checkpoint, tmp_path, capsys):
    lm, _, _ = lm_checkpoint
    (tmp_path / "not_a_checkpoint").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "images" / "train").mkdir(parents=True)
    (tmp_path / "images" / "val").mkdir()
    assert "is not a shardlab checkpoint" in answer([str(tmp_path / "not_a_checkpoint")], capsys)
    assert "is not a .safetensors file" in answer([str(tmp_path / "notes.txt")], capsys)
    assert "give a checkpoint" in answer([], capsys)
    assert "--linear needs a vision model; use --perplexity" in answer([str(lm), "--linear"], capsys)
    assert "--perplexity needs a language model" in answer([str(vision_checkpoint), "--perplexity"], capsys)
    assert "a checkpoint brings its own model" in answer([str(vision_checkpoint), "model=regnet_y_400mf"], capsys)
    assert "data.colour" in answer([str(vision_checkpoint), "data.colour=1"], capsys)
    no_classes = answer([str(vision_checkpoint), f"data.path={tmp_path / 'images'}", "data.source=folder"], capsys)
    assert "has no class folders" in no_classes
    assert "--split train: the probe trains on the train split" in answer(
        [str(vision_checkpoint), "--split", "train"], capsys
    )
    assert "--split test: a corpus has train and valid splits" in answer([str(lm), "--split", "test"], capsys)
    assert "data.num_test is 0" in answer([str(vision_checkpoint), "data.num_test=0"], capsys)


def test_a_source_without_labels_is_refused():
    with pytest.raises(ConfigError, match="has no labels"):
        trunk_evaluation.labelled_data(OmegaConf.create({"data": {"source": "unlabelled_folder", "path": "/x"}}))


# ---- a checkpoint's config steers no reads (issue 41) ----------------------------------------------------------------
OPENED: list[str] = []
"""Every path opened while a test records them (an audit hook cannot be removed, so it appends only when armed)."""
_ARMED = {"on": False}


def _audit(event: str, args: tuple) -> None:
    if _ARMED["on"] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def test_evaluate_never_reads_the_data_a_checkpoints_config_names(lm_checkpoint, tmp_path):
    """A shared checkpoint whose config names a private file (data.path) and a cache (data.cache_dir): the tool
    evaluates on the defaults and its own command line, opens neither, and writes nothing beside them."""
    checkpoint, _, _ = lm_checkpoint
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "secret.txt").write_text("the user's secret " * 200)
    (private / "secret.txt").chmod(0o600)
    crafted = tmp_path / "step_00000004"
    shutil.copytree(checkpoint, crafted)
    meta = json.loads((crafted / "shardlab.json").read_text())
    meta["config"]["data"].update(path=str(private / "secret.txt"), cache_dir=str(private / "cache"))
    (crafted / "shardlab.json").write_text(json.dumps(meta))
    own_cache = tmp_path / "own-cache"
    OPENED.clear()
    _ARMED["on"] = True
    try:
        results = evaluate.main([str(crafted), f"data.cache_dir={own_cache}", "--batch-size", "64"])
    finally:
        _ARMED["on"] = False
    assert not [p for p in OPENED if str(private) in p], "the checkpoint's data.path or cache_dir was opened"
    assert sorted(p.name for p in private.iterdir()) == ["secret.txt"], "nothing written beside the private file"
    assert results["tokens"] > 0 and own_cache.is_dir()  # evaluated on the default corpus, in the cache it was told
