"""shardlab-evaluate for the vision tasks (image classification and the self-supervised ones, Task.evaluation): a
linear probe and kNN on the trunk's frozen features (Task.features), VISSL's benchmark.

The features of the train split and of the split judged on (test by default, which nothing is tuned on; valid, which
recipes are chosen on) of a labelled image source are extracted once, unaugmented, and kept in memory (and in
--cache-dir, keyed by everything they depend on). A random trunk and averaged weights have their BatchNorm statistics
re-estimated on the train split first (probe.recompute_bn_stats)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from shardlab.errors import ConfigError, DataError
from shardlab.task import Evaluation, EvaluationRequest
from shardlab_tasks.image_classification.config import ImageDataConfig
from shardlab_tasks.image_classification.data import (
    SOURCES,
    count_classes,
    folder_test_split,
    open_datasets,
    open_test,
    source_of,
)
from shardlab_tasks.image_classification.probe import (
    extract_features,
    knn_scores,
    recompute_bn_stats,
    standardize,
    top_k_accuracy,
    train_linear,
)


class TrunkEvaluation(Evaluation):
    """The linear probe (--linear) and kNN (--knn) of a trunk's features; both by default."""

    modes = ("linear", "knn")
    default_modes = ("linear", "knn")

    def settle(self, modes: tuple[str, ...], settings: Any) -> None:
        resolve_split(settings, modes)

    def evaluate(self, request: EvaluationRequest) -> dict[str, float]:
        model = request.model()
        return evaluate_trunk(self.task, model, request.cfg, request.settings, request.modes, request.info)


def resolve_split(args, modes) -> None:
    """args.split: a trunk is judged on test (default) or valid, never on the images its probe trains on.
    args.recompute_bn: on for a random trunk and for averaged weights (--ema): neither has running statistics of its
    own (the average is of parameters; its buffers are the student's), so each is probed as
    torch.optim.swa_utils.update_bn leaves an averaged model."""
    if args.split in ("train", "all"):
        raise ConfigError(
            f"--split {args.split}: the probe trains on the train split, so it is judged on held-out images; use "
            "--split test (the default) or valid"
        )
    args.split = args.split or "test"
    if args.recompute_bn is None:
        args.recompute_bn = args.random_init or args.ema


def labelled_data(cfg: DictConfig) -> ImageDataConfig:
    """The image-source settings of cfg.data (any vision task's: the keys the image-classification data reads),
    unaugmented, or a ConfigError for a source without labels."""
    given = OmegaConf.to_container(cfg.data, resolve=True)
    names = {f.name for f in dataclasses.fields(ImageDataConfig)}
    data = ImageDataConfig(**{k: v for k, v in given.items() if k in names})
    if source_of(data) not in SOURCES:
        raise ConfigError(
            f"data.source={data.source} has no labels to probe with; use a labelled source: embedded, "
            "folder (data.path with train/<class>/ and val/<class>/) or fake"
        )
    return dataclasses.replace(data, augment=False)


def settle_split(data: ImageDataConfig, args) -> None:
    """A folder without test/ is judged on its val/ (ImageNet's test labels are not public, so its val/ is what
    everyone reports), unless --split test was asked for; a source drawn with data.num_test=0 has no test split."""
    if args.split != "test":
        return
    if source_of(data) != "folder":
        if data.num_test < 1:
            raise ConfigError("data.num_test is 0: there is no test split; set data.num_test=N or use --split valid")
        return
    if folder_test_split(Path(data.path).expanduser().resolve()) is None:
        if args.split_asked:
            raise DataError(
                f"--split test: data.path {data.path} has no test/ directory; add test/<class>/<image> or use "
                "--split valid"
            )
        print(f"note: {data.path} has no test/ split: judging on its val/ split", flush=True)
        args.split = "valid"


def eval_datasets(data: ImageDataConfig, args):
    """(train split, the split judged on: args.split)."""
    train_set, valid_set, _ = open_datasets(data)
    return train_set, (valid_set if args.split == "valid" else open_test(data))


def features_and_labels(task, model, data, args, device, cache_key: str) -> dict[str, torch.Tensor]:
    """{train,eval}_{features,labels} (eval: the split judged on): extracted once, or read back from --cache-dir.
    With args.recompute_bn the BatchNorm statistics are re-estimated on the train split first."""
    from safetensors.torch import load_file, save_file

    cache = args.cache_dir / f"features-{cache_key}.safetensors" if args.cache_dir else None
    if cache is not None and cache.is_file():
        print(f"features: read from {cache}", flush=True)
        return load_file(str(cache))
    train_set, eval_set = eval_datasets(data, args)
    started = time.perf_counter()
    model.to(device)
    if args.recompute_bn:
        count = recompute_bn_stats(
            model, lambda images: task.features(model, images), train_set, args.batch_size, data.num_workers, device
        )
        print(
            f"BatchNorm: running statistics of {count} layers re-estimated on the {len(train_set)} train images",
            flush=True,
        )
    out = {}
    for split, dataset in (("train", train_set), ("eval", eval_set)):
        feats, labels = extract_features(
            lambda images: task.features(model, images),
            dataset,
            args.batch_size,
            data.num_workers,
            device,
            name=f"features ({split if split == 'train' else args.split})",
        )
        out[f"{split}_features"], out[f"{split}_labels"] = feats, labels
    seconds = time.perf_counter() - started
    print(
        f"features: {out['train_features'].shape[1]}-d, {len(train_set)} train and {len(eval_set)} {args.split} images "
        f"in {seconds:.1f} s",
        flush=True,
    )
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file(out, str(cache.with_suffix(".tmp")))
        cache.with_suffix(".tmp").replace(cache)  # published whole: a killed run leaves no half-written cache
    return out


def evaluate_trunk(task, model, cfg, args, modes, info: dict | None) -> dict[str, float]:
    """The probes asked for (``modes``) on the features of the train split and of args.split, printed and returned."""
    device = torch.device(args.device)
    data = labelled_data(cfg)
    settle_split(data, args)
    f = features_and_labels(task, model, data, args, device, cache_key(args, cfg, info))
    train_x, train_y = f["train_features"].to(device), f["train_labels"].to(device)
    valid_x, valid_y = f["eval_features"].to(device), f["eval_labels"].to(device)
    num_classes = count_classes(data)
    results: dict[str, float] = {}
    if "linear" in modes:
        started = time.perf_counter()
        train_n, valid_n = standardize(train_x, valid_x)
        linear = train_linear(
            train_n, train_y, num_classes, args.epochs, args.probe_batch_size, args.lr, args.weight_decay, args.seed
        )
        with torch.no_grad():
            scores = linear(valid_n)
        results["linear_top1"] = top_k_accuracy(scores, valid_y, 1)
        results["linear_top5"] = top_k_accuracy(scores, valid_y, 5)
        print(
            f"linear probe: top-1 {results['linear_top1']:.2f}%  top-5 {results['linear_top5']:.2f}%  "
            f"({args.epochs} epochs, lr {args.lr}, {time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    if "knn" in modes:
        scores = knn_scores(train_x, train_y, valid_x, num_classes, args.k, args.temperature)
        results["knn_top1"] = top_k_accuracy(scores, valid_y, 1)
        print(f"kNN: top-1 {results['knn_top1']:.2f}%  (k={args.k}, temperature {args.temperature})", flush=True)
    print(f"(on the {len(valid_y)} images of the {args.split} split)", flush=True)
    return results


def cache_key(args, cfg: DictConfig, info: dict | None) -> str:
    """What the features depend on: the weights (checkpoint path and step, its EMA average or not, or the random
    init's seed), the model, the data settings, the split and whether BatchNorm statistics were re-estimated."""
    key = {
        "checkpoint": None if args.random_init or args.checkpoint is None else str(args.checkpoint.resolve()),
        "pretrained": None if args.random_init else file_identity(getattr(args, "pretrained", None)),
        "step": (info or {}).get("step"),
        "ema": bool(args.ema) and not args.random_init,
        "seed": cfg.seed if args.random_init else None,
        "task": cfg.task.name,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": dataclasses.asdict(labelled_data(cfg)),
        "split": args.split,
        "recompute_bn": bool(args.recompute_bn),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def file_identity(path: str | None) -> list | None:
    """A weights file as the features depend on it: where it is, its size and when it last changed."""
    if not path:
        return None
    resolved = Path(path).expanduser().resolve()
    st = resolved.stat()
    return [str(resolved), st.st_size, st.st_mtime_ns]
