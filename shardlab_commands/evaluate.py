"""Evaluate a checkpoint: a vision trunk by a linear probe and kNN on its frozen features (VISSL's benchmark), a
language model by its perplexity on a corpus (fairseq's eval-lm).

    shardlab-evaluate runs/ssl/swav/checkpoints/step_00001000             # linear probe, kNN top-1: test split
    shardlab-evaluate CHECKPOINT --split valid                             # the split recipes are chosen on
    shardlab-evaluate CHECKPOINT --linear data.path=/imagenet data.num_workers=16 --batch-size 512
    shardlab-evaluate CHECKPOINT --random-init                             # same architecture, random weights
    shardlab-evaluate CHECKPOINT --ema                                     # the EMA weights (DINO's teacher)
    shardlab-evaluate --random-init task=image_classification model=regnet_cifar model.depth=8
    shardlab-evaluate task=image_classification model=regnet_y_400mf model.pretrained=regnet_y_400mf.pth
    shardlab-evaluate runs/lm/default/checkpoints/step_00000300                     # validation perplexity
    shardlab-evaluate model.safetensors data.path=held_out.txt --split all          # a whole other corpus
    shardlab-evaluate CHECKPOINT +data.sources='{web: {path: /a}, code: {path: /b}}'  # a mixture, by source
    shardlab-evaluate CHECKPOINT --lm-eval hellaswag,arc_easy                     # lm-evaluation-harness
    shardlab-evaluate CHECKPOINT --lm-eval my_task --lm-eval-include my_tasks/    # task YAMLs of your own

CHECKPOINT is a step_N folder (any backend and world size) or a .safetensors file from shardlab-consolidate. The
model is rebuilt from the checkpoint's own description (task and training config) through the task registry and
loaded in one process, in eval mode. Arguments without a leading ``--`` are overrides: of the checkpoint's config
(``data.*`` picks the evaluation data: data.path, data.source, data.num_workers, data.image_size, ...), or, with
--random-init and no checkpoint, the Hydra overrides that name the architecture as for ``python -m shardlab.train``.
Without a checkpoint, ``model.pretrained=FILE`` among those overrides gives the weights a training run would start
from (torchvision's RegNet weights as the trunk, docs/vision.md), loaded by the task as the trainer loads them.

Vision (--linear, --knn; both by default): the trunk's pooled features (``Task.features``) of the train split and of the
split judged on (--split: test by default, which nothing is tuned on; valid, which recipes are chosen on) of a labelled
image source (embedded, folder = an ImageFolder tree, fake) are extracted once, unaugmented, and cached in memory (and
in --cache-dir, keyed by model, data and split, if given); the linear probe trains on the train split's standardized
features and reports top-1/top-5 on the judged split; kNN votes among the k most cosine-similar train features. A random
trunk (--random-init) and averaged weights (--ema) have their BatchNorm statistics re-estimated on the train split first
(--recompute-bn/--no-recompute-bn: any trunk, or none). Language models (--perplexity, the default): the task's loss
over every block of data.seq_len tokens of the chosen split, as the trainer's validation computes it. --lm-eval TASKS
(comma-separated) exports the checkpoint to Hugging Face (shardlab-export; --export-dir keeps it) and runs
EleutherAI's lm-evaluation-harness on it with a context window of data.seq_len (shardlab_tasks/lm/harness.py says when
its rolling log-likelihood equals the perplexity here). A run trained on a mixture is given its sources again as
``data.sources`` (a checkpoint's paths are never read; each source's weight and text_field default to the run's): each
source's loss and ppl, and the mixture's (the weighted mean of the sources' losses), as its validation logged them.
Everything is seeded; the same command gives the same figures.
``--out FILE`` writes them as JSON with the settings beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from shardlab.checkpoint import weights
from shardlab.distributed.materialize import materialize
from shardlab.errors import CheckpointError, ConfigError, DataError, first_cause
from shardlab.jobs.preflight import GROUPS, check_group_choices, compose_config
from shardlab.runner import build_task
from shardlab.task import Task
from shardlab.train import run_tool
from shardlab_commands import provenance

VISION_MODES = ("linear", "knn")


# ---- the model -------------------------------------------------------------------------------------------------------
def checkpoint_config(checkpoint: Path, overrides: list[str], user_dir: str | None) -> tuple[DictConfig, dict]:
    """The training config a checkpoint describes, with ``overrides`` (key=value) applied, and its description
    (``user_dir``: the plug-ins of a run that had them)."""
    if checkpoint.is_dir() and not (checkpoint / "shardlab.json").is_file():
        raise CheckpointError(
            f"{checkpoint} is not a shardlab checkpoint (no shardlab.json); give a step_N folder or a .safetensors file"
        )
    info = weights.describe(checkpoint)
    cfg = weights.training_config(checkpoint, info, user_dir)
    groups = [o for o in overrides if o.partition("=")[0].lstrip("+~") in GROUPS]
    if groups:
        raise ConfigError(
            f"{groups[0]}: a checkpoint brings its own {groups[0].partition('=')[0]}; give key=value overrides of "
            "its config (e.g. data.path=...), or --random-init without a checkpoint to choose an architecture"
        )
    trained_sources = own_data_paths(cfg, checkpoint)
    if holds_its_trunk_file(cfg):
        cfg.model.pretrained = None  # the checkpoint holds those weights now: the file need not exist any more
    OmegaConf.set_struct(cfg, True)  # a mistyped key is an error, not a new key nothing reads
    if "sources" in cfg.get("data", {}):
        OmegaConf.set_struct(cfg.data.sources, False)  # its names are the user's; complete_sources checks the keys
    # +data.sources=... as training spells it (the + adds to the schema's empty mapping there; here it is emptied)
    overrides = [o.lstrip("+") for o in overrides]
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as e:
        raise ConfigError(f"{' '.join(overrides)}: {first_cause(e)} (keys of the checkpoint's config)") from None
    complete_sources(cfg, trained_sources)
    return cfg, info


def holds_its_trunk_file(cfg: DictConfig) -> bool:
    """Whether ``cfg`` (a checkpoint's) names the torchvision weights file its vision run started from in
    model.pretrained; a language model's model.pretrained folder gives its architecture too, and stays."""
    from shardlab.registry import MODELS

    arch = cfg.get("model", {}).get("arch")
    vision = arch in MODELS.names() and MODELS.module_of(arch) == "shardlab_tasks.image_classification.model"
    return vision and bool(cfg.model.get("pretrained"))


DATA_PATH_KEYS = ("path", "cache_dir", "sources")
"""The data keys that name files to read or folders to write (data.sources: a mixture's corpora, each with its path):
a tool takes them from its own command line or the defaults, never from the checkpoint it is given (a shared
checkpoint's data.path could name any file the user can read, which the evaluation would tokenize into the cache and
decode back)."""


HAD_PATH = "had_path"
"""In own_data_paths' answer: whether the run's source had a path of its own (its value is never kept)."""


def own_data_paths(cfg: DictConfig, checkpoint: Path) -> dict[str, dict]:
    """Set cfg.data's DATA_PATH_KEYS to the defaults of the task's data schema (the command's overrides merge over
    them afterwards). Returns the checkpoint's data.sources less their paths (name -> weight, text_field, and
    HAD_PATH: whether it had one): what a source the command line names again keeps of its training
    (complete_sources). A source that is no mapping is a CheckpointError naming ``checkpoint``'s description."""
    from hydra.core.config_store import ConfigStore

    try:
        defaults = OmegaConf.to_container(ConfigStore.instance().load(f"schema/data/{cfg.task.name}.yaml").node)
    except Exception:  # noqa: BLE001  (a plug-in task without a registered data schema: no default path)
        defaults = {}
    data = cfg.get("data", {})
    trained = data.get("sources")
    trained = OmegaConf.to_container(trained) if isinstance(trained, DictConfig) else {}
    for key in DATA_PATH_KEYS:
        if key in data:
            cfg.data[key] = defaults.get(key)
    for name, source in trained.items():
        if not isinstance(source, dict):  # training's schema would have refused it: the file was edited since
            described = checkpoint / "shardlab.json" if checkpoint.is_dir() else weights.config_file(checkpoint)
            raise CheckpointError(
                f"{described}: config.data.sources.{name} is {source!r}, not a source ({{path, weight, text_field}}); "
                "the file was changed after training: restore it"
            )
    return {
        name: {**{k: v for k, v in source.items() if k != "path"}, HAD_PATH: bool(source.get("path"))}
        for name, source in trained.items()
    }


def complete_sources(cfg: DictConfig, trained: dict[str, dict]) -> None:
    """Give each source of the command line's data.sources the keys it leaves out: its training's (weight, text_field:
    the mixture is weighed as it was trained) for a name the checkpoint had, else the schema's; refuse a key no
    source has (training's schema would), and a source without a path that the run read from a corpus of its own
    (else it would be scored on the embedded corpus under that source's name)."""
    sources = cfg.get("data", {}).get("sources")
    if not sources:
        return
    from shardlab_tasks.lm.config import LMSourceConfig

    schema = dataclasses.asdict(LMSourceConfig())
    for name, source in sources.items():
        if not isinstance(source, DictConfig):
            raise ConfigError(f"data.sources.{name}: expected {{path: ..., weight: ...}}, got {source!r}")
        unknown = sorted(set(source) - set(schema))
        if unknown:
            raise ConfigError(f"data.sources.{name}.{unknown[0]} is not a key of a source; known: {', '.join(schema)}")
        for key, default in schema.items():
            if key not in source:
                source[key] = trained.get(name, {}).get(key, default)
        if not source.path and trained.get(name, {}).get(HAD_PATH):
            raise ConfigError(
                f"data.sources.{name}.path: the run trained {name} on a corpus of its own (its path is never read "
                f"from the checkpoint); give data.sources.{name}.path=..."
            )


def composed_config(overrides: list[str]) -> DictConfig:
    """The config Hydra overrides compose to, as for a training run (for --random-init without a checkpoint)."""
    check_group_choices(overrides)
    try:
        return compose_config(overrides)
    except Exception as e:
        raise ConfigError(f"{' '.join(overrides)}: {first_cause(e)}") from None


def build_model(
    cfg: DictConfig, checkpoint: Path | None, ema: bool = False, pretrained: bool = False
) -> tuple[Task, torch.nn.Module]:
    """The task and its model in this process: seeded init (cfg.seed), then the checkpoint's weights if given (their
    keys and shapes must fit the model the config describes); ``ema``: its optimization.ema average instead (DINO's
    teacher); ``pretrained``: without a checkpoint, the weights model.pretrained names, as a run starts from them
    (Task.load_pretrained: the trunk read, the head seeded)."""
    try:
        task = build_task(cfg, world_size=1, check_budget=False)
        with torch.device("meta"):
            model = task.build_model()
    except DataError as e:
        if checkpoint is None:
            raise
        raise DataError(
            f"{e} (building {checkpoint}'s model reads the data it was trained on, e.g. to count classes; "
            "if that is gone, give the model key it derived, e.g. model.num_classes=N)"
        ) from None
    if checkpoint is not None:  # before materializing: a crafted config must not allocate first
        weights.check_shapes(checkpoint, model)
    from_folder = pretrained and checkpoint is None
    # What the folder fills is not drawn first, as a run starting from it does (Task.pretrained_keys).
    materialize(model, torch.device("cpu"), task.init_tensor, cfg.seed, task.pretrained_keys() if from_folder else None)
    if from_folder:
        task.load_pretrained(model, torch.device("cpu"))
    if checkpoint is not None:
        try:
            if ema:
                model.load_state_dict(weights.read_full(checkpoint, ema=True))
            else:
                weights.load_into(model, checkpoint)
        except CheckpointError:
            raise
        except Exception as e:  # DCP's and load_state_dict's shape and key mismatches
            raise CheckpointError(f"{checkpoint} does not fit the model its config describes ({first_cause(e)})") from e
    return task, model.eval()


# ---- vision: features, linear probe, kNN -----------------------------------------------------------------------------
def labelled_data(cfg: DictConfig):
    """The image-source settings of cfg.data (any vision task's: the keys the image-classification data reads),
    unaugmented, or a ConfigError for a source without labels."""
    from shardlab_tasks.image_classification.config import ImageDataConfig
    from shardlab_tasks.image_classification.data import SOURCES, source_of

    given = OmegaConf.to_container(cfg.data, resolve=True)
    names = {f.name for f in dataclasses.fields(ImageDataConfig)}
    data = ImageDataConfig(**{k: v for k, v in given.items() if k in names})
    if source_of(data) not in SOURCES:
        raise ConfigError(
            f"data.source={data.source} has no labels to probe with; use a labelled source: embedded, "
            "folder (data.path with train/<class>/ and val/<class>/) or fake"
        )
    return dataclasses.replace(data, augment=False)


def settle_split(data, args) -> None:
    """A folder without test/ is judged on its val/ (ImageNet's test labels are not public, so its val/ is what
    everyone reports), unless --split test was asked for; a source drawn with data.num_test=0 has no test split."""
    from shardlab_tasks.image_classification.data import folder_test_split, source_of

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


def eval_datasets(data, args):
    """(train split, the split judged on: args.split)."""
    from shardlab_tasks.image_classification.data import open_datasets, open_test

    train_set, valid_set, _ = open_datasets(data)
    return train_set, (valid_set if args.split == "valid" else open_test(data))


def features_and_labels(task, model, data, args, device, cache_key: str) -> dict[str, torch.Tensor]:
    """{train,eval}_{features,labels} (eval: the split judged on): extracted once, or read back from --cache-dir.
    With args.recompute_bn the BatchNorm statistics are re-estimated on the train split first."""
    from safetensors.torch import load_file, save_file

    from shardlab_tasks.image_classification.probe import extract_features, recompute_bn_stats

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


def evaluate_trunk(task, model, cfg, args, modes: list[str], device, info: dict | None) -> dict[str, float]:
    from shardlab_tasks.image_classification.data import count_classes
    from shardlab_tasks.image_classification.probe import knn_scores, standardize, top_k_accuracy, train_linear

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


# ---- language models: perplexity -------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_perplexity(task, model, cfg, args, device) -> dict[str, float]:
    """The task's loss summed over every block of the split, then its metrics (loss, ppl) from the totals. A mixture
    (data.sources): each source's blocks in turn with their source's number, so its metrics are those training's
    validation logs for it (shardlab_tasks/lm/mixture.py: each source's loss and ppl, and the mixture's, weighed)."""
    from torch.utils.data import DataLoader

    from shardlab_tasks.lm.mixture import MixtureValid

    seq_len = cfg.data.seq_len
    if cfg.data.get("sources"):
        task.prepare_data()  # every source's cache, built first as data.path's is (task.mixture: names, weights)
        dataset = MixtureValid([split_blocks(corpus, args.split, seq_len) for corpus in task.mixture.corpora])
    else:
        dataset = split_blocks(task.corpus(), args.split, seq_len)
    if len(dataset) == 0:
        raise DataError(f"the {args.split} split holds no block of data.seq_len={seq_len} tokens; lower data.seq_len")
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, collate_fn=task.collate)
    model.to(device)
    sums: dict[str, float] = {}
    for batch in loader:
        _, stats = task.loss(model, batch, device)
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    metrics = task.summarize(sums)
    metrics["tokens"] = int(sums["count"])
    mixture = task.mixture if cfg.data.get("sources") else None
    for name in mixture.names if mixture is not None else []:
        metrics[f"{name}/tokens"] = int(sums.get(f"count/{name}", 0))
    print_perplexity(metrics, mixture, cfg, args)
    return metrics


def split_blocks(corpus: Path, split: str, seq_len: int):
    """The blocks of one split of a preprocessed corpus; all: every document, both splits less one too short for a
    block (a one-file corpus)."""
    from torch.utils.data import ConcatDataset

    from shardlab_tasks.lm.cache import read_corpus_meta
    from shardlab_tasks.lm.data import open_split

    splits = [split]
    if split == "all":
        tokens = read_corpus_meta(corpus)
        splits = [s for s in ("train", "valid") if tokens.get(f"{s}_tokens", 1 << 62) > seq_len] or ["train"]
    return ConcatDataset([open_split(corpus, s, seq_len) for s in splits])


def print_perplexity(metrics: dict, mixture, cfg, args) -> None:
    """A line of the figures; a mixture's, then one per source."""
    shown = (
        "the mixture " + ", ".join(f"{n} x{w:.3g}" for n, w in zip(mixture.names, mixture.weights, strict=True))
        if mixture is not None
        else cfg.data.path or "the embedded corpus"
    )
    print(
        f"perplexity: {metrics['ppl']:.4f}  loss {metrics['loss']:.4f}  ({metrics['tokens']} tokens of the "
        f"{args.split} split of {shown}, blocks of {cfg.data.seq_len})",
        flush=True,
    )
    for name in mixture.names if mixture is not None else []:
        if f"{name}/loss" not in metrics:
            print(f"  {name}: no block in its {args.split} split", flush=True)
            continue
        path = cfg.data.sources[name].path or "the embedded corpus"
        print(
            f"  {name}: perplexity {metrics[f'{name}/ppl']:.4f}  loss {metrics[f'{name}/loss']:.4f}  "
            f"({metrics[f'{name}/tokens']} tokens of {path})",
            flush=True,
        )


# ---- language models: lm-evaluation-harness --------------------------------------------------------------------------
def evaluate_lm_eval(checkpoint: Path, cfg: DictConfig, args) -> dict:
    """The harness's metrics per task on the checkpoint's Hugging Face export (in --export-dir, or a temporary
    folder removed afterwards)."""
    import tempfile

    from shardlab_commands import export_hf
    from shardlab_tasks.lm.harness import run_harness, summarize, task_manager

    if cfg.task.name != "lm":
        raise ConfigError(f"{checkpoint} is a {cfg.task.name} checkpoint; --lm-eval needs a language model")
    tasks = [t for t in args.lm_eval.split(",") if t]
    manager = task_manager(tasks, args.lm_eval_include)  # a missing extra or task: refused before the export
    settings = dict(
        max_length=cfg.data.seq_len,
        device=args.device,
        batch_size=args.batch_size,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        bootstrap_iters=args.bootstrap_iters,
    )
    with tempfile.TemporaryDirectory(prefix="shardlab-hf-") as tmp:
        out = args.export_dir or Path(tmp)
        export_hf.main([str(checkpoint), "--out", str(out)])
        raw = run_harness(out, tasks, manager, **settings)
    metrics = summarize(raw)
    for task, values in metrics.items():
        shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items() if not k.endswith("_stderr"))
        print(f"lm-eval {task}: {shown}", flush=True)
    return {"lm_eval": metrics, "lm_eval_samples": raw.get("samples", {})}


# ---- the command -----------------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line as arguments: the options, the checkpoint and the overrides apart, each combination that
    cannot be evaluated refused in one line."""
    args = command_parser().parse_intermixed_args(argv)  # overrides may come before or after the options
    args.split_asked = args.split is not None
    args.split = "valid" if args.split == "val" else args.split
    paths = [item for item in args.items if "=" not in item]
    args.overrides = [item for item in args.items if "=" in item]
    if len(paths) > 1:
        raise ConfigError(f"one checkpoint at a time, got {len(paths)}: {' '.join(paths)}")
    args.checkpoint = Path(paths[0]).expanduser() if paths else None
    args.pretrained = next((o.partition("=")[2] for o in args.overrides if o.startswith("model.pretrained=")), None)
    refuse_unusable(args)
    return args


def command_parser() -> argparse.ArgumentParser:
    """The options: what is evaluated and where, then the probes' and the harness's own (probe_options,
    harness_options)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="*", metavar="CHECKPOINT | key=value", help="a checkpoint, then overrides")
    parser.add_argument("--linear", action="store_true", help="linear probe on frozen features (vision)")
    parser.add_argument("--knn", action="store_true", help="kNN classifier on frozen features (vision)")
    parser.add_argument("--perplexity", action="store_true", help="perplexity on data.path's split (language models)")
    parser.add_argument("--random-init", action="store_true", help="skip the checkpoint's weights: a seeded init")
    parser.add_argument("--ema", action="store_true", help="the run's average of the weights (optimization.ema)")
    parser.add_argument("--batch-size", type=int, default=None, help="per forward; default validation.batch_size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="the linear probe's init and batch order")
    parser.add_argument(
        "--split",
        choices=("test", "valid", "val", "train", "all"),
        default=None,
        help="vision: the split judged on, test (default; nothing is tuned on it) or valid (for choosing recipes); "
        "perplexity: valid (default), train or all (every document)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures and settings as JSON")
    parser.add_argument("--user-dir", help="the plug-in folder of a run trained with user_dir= (imported: trust it)")
    probe_options(parser.add_argument_group("linear probe and kNN"))
    harness_options(parser.add_argument_group("lm-evaluation-harness (pip install -e '.[lm-eval]')"))
    return parser


def probe_options(vision: argparse._ArgumentGroup) -> None:
    vision.add_argument("--epochs", type=int, default=100, help="linear probe: passes over the cached features")
    vision.add_argument("--lr", type=float, default=0.1, help="linear probe: peak learning rate (cosine decay)")
    vision.add_argument("--weight-decay", type=float, default=5e-4, help="linear probe: weight decay")
    vision.add_argument("--probe-batch-size", type=int, default=256, help="linear probe: features per SGD step")
    vision.add_argument("--k", type=int, default=20, help="kNN: neighbours that vote")
    vision.add_argument("--temperature", type=float, default=0.07, help="kNN: vote weight exp(similarity / T)")
    vision.add_argument("--cache-dir", type=Path, default=None, help="keep extracted features here for reruns")
    vision.add_argument(
        "--recompute-bn",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="re-estimate BatchNorm running statistics on the train split before extracting features "
        "(default: on with --random-init, whose statistics are its init's, and with --ema, whose are the student's; "
        "off for a trained trunk)",
    )


def harness_options(harness: argparse._ArgumentGroup) -> None:
    harness.add_argument("--lm-eval", metavar="TASKS", help="comma-separated lm-eval task names, e.g. hellaswag,piqa")
    harness.add_argument("--lm-eval-include", type=Path, action="append", default=[], help="a folder of task YAMLs")
    harness.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    harness.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt; default the task's")
    harness.add_argument("--bootstrap-iters", type=int, default=100_000, help="resamples for stderr; 0: none")
    harness.add_argument("--export-dir", type=Path, default=None, help="keep the Hugging Face export here")


def refuse_unusable(args: argparse.Namespace) -> None:
    """A ConfigError for the first combination of parsed arguments that names nothing to evaluate, two sources of
    weights, or a count below one."""
    if args.checkpoint is None and not args.random_init and not args.pretrained:
        raise ConfigError(
            "give a checkpoint (a step_N folder or a .safetensors file), or the overrides of an architecture with "
            "model.pretrained=FILE (its weights) or --random-init (e.g. task=image_classification model=regnet_cifar)"
        )
    if args.checkpoint is not None and args.pretrained:
        raise ConfigError(
            "model.pretrained: the checkpoint's weights are evaluated, not the file its run started from; give one"
        )
    if args.lm_eval is not None and (args.checkpoint is None or args.random_init):
        raise ConfigError("--lm-eval evaluates a trained checkpoint's export; give a checkpoint, without --random-init")
    for name in ("batch_size", "epochs", "probe_batch_size", "k"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def chosen_modes(args, task: Task, where: str) -> list[str]:
    """The evaluations asked for, or the task's default ones; a ConfigError for one the model cannot do."""
    has_trunk = type(task).features is not Task.features
    is_lm = task.unit == "tokens"
    asked = [m for m in (*VISION_MODES, "perplexity") if getattr(args, m)]
    for mode in asked:
        if mode in VISION_MODES and not has_trunk:
            raise ConfigError(
                f"{where} is a {task.cfg.task.name} checkpoint without an image trunk; --{mode} needs a vision model"
                + ("; use --perplexity" if is_lm else "")
            )
        if mode == "perplexity" and not is_lm:
            raise ConfigError(f"{where} is a {task.cfg.task.name} checkpoint; --perplexity needs a language model")
    modes = asked or (list(VISION_MODES) if has_trunk else ["perplexity"] if is_lm else [])
    if modes:
        resolve_split(args, modes)
        return modes
    raise ConfigError(f"{where}: task {task.cfg.task.name} has neither an image trunk nor a token loss to evaluate")


def resolve_split(args, modes: list[str]) -> None:
    """args.split for what is evaluated: a trunk is judged on test (default) or valid, never on the images its probe
    trains on; a corpus has train and valid splits (valid by default). args.recompute_bn: on for a random trunk and for
    averaged weights (--ema): neither has running statistics of its own (the average is of parameters; its buffers are
    the student's), so each is probed as torch.optim.swa_utils.update_bn leaves an averaged model."""
    if modes == ["perplexity"]:
        if args.split == "test":
            raise ConfigError("--split test: a corpus has train and valid splits; use --split valid, train or all")
        args.split = args.split or "valid"
        return
    if args.split in ("train", "all"):
        raise ConfigError(
            f"--split {args.split}: the probe trains on the train split, so it is judged on held-out images; use "
            "--split test (the default) or valid"
        )
    args.split = args.split or "test"
    if args.recompute_bn is None:
        args.recompute_bn = args.random_init or args.ema


def recorded_script() -> Path:
    """What --out records as the command that ran: a clone's shardlab-evaluate (shardlab_bench/tables.py --rerun runs a
    benchmark or a tools/ script), or this module in an install, which has no tools/."""
    script = provenance.REPO / "tools" / "evaluate.py"
    return script if script.is_file() else Path(__file__)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    meta = provenance.collect(str(recorded_script()), argv) if args.out is not None else None
    where = str(args.checkpoint or args.pretrained or "the randomly initialised model")
    if args.checkpoint is not None:
        # data.* choose what to evaluate on; the model is built as it was trained (e.g. its classes from its data)
        cfg, info = checkpoint_config(args.checkpoint, args.overrides, args.user_dir)
        model_overrides = [o for o in args.overrides if not o.lstrip("+~").startswith("data.")]
        model_cfg, _ = checkpoint_config(args.checkpoint, model_overrides, args.user_dir)
        note_trained_mixture(cfg, info)
    else:
        cfg, info = composed_config(args.overrides), None
        model_cfg = cfg
    args.batch_size = args.batch_size or cfg.validation.batch_size
    torch.manual_seed(args.seed)
    if args.lm_eval is not None:
        results = evaluate_lm_eval(args.checkpoint, cfg, args)
        if args.perplexity:
            resolve_split(args, ["perplexity"])  # both asked for: the perplexity beside the harness's figures
            task, model = build_model(model_cfg, args.checkpoint)
            data_task = task if cfg is model_cfg else build_task(cfg, world_size=1, check_budget=False)
            results.update(evaluate_perplexity(data_task, model, cfg, args, torch.device(args.device)))
        if args.out is not None:
            write_report(args, cfg, info, {k: v for k, v in results.items() if k != "lm_eval_samples"}, meta)
        return results
    pretrained = bool(args.pretrained) and not args.random_init  # --random-init: the seeded init, nothing read
    task, model = build_model(model_cfg, None if args.random_init else args.checkpoint, args.ema, pretrained)
    modes = chosen_modes(args, task, where)
    described = f"{where} (task {cfg.task.name}" + (f", step {info.get('step')}" if info else "")
    print(f"evaluating {described}{', random init seed ' + str(cfg.seed) if args.random_init else ''})", flush=True)
    device = torch.device(args.device)
    if modes == ["perplexity"]:
        data_task = task if cfg is model_cfg else build_task(cfg, world_size=1, check_budget=False)
        results = evaluate_perplexity(data_task, model, cfg, args, device)
    else:
        results = evaluate_trunk(task, model, cfg, args, modes, device, info)
    if args.out is not None:
        write_report(args, cfg, info, results, meta)
    return results


def note_trained_mixture(cfg: DictConfig, info: dict) -> None:
    """A run trained on data.sources, evaluated on no corpus of the command line's: say what is evaluated instead,
    and how to evaluate its sources (their paths are never read from the checkpoint)."""
    trained = ((info.get("config") or {}).get("data") or {}).get("sources") or {}
    if trained and not cfg.data.get("sources") and cfg.data.get("path") is None:
        print(
            f"note: {', '.join(trained)} (the run's data.sources) are not read from its checkpoint: evaluating on the "
            "embedded corpus; give +data.sources='{name: {path: ...}, ...}' (weights default to the run's) for each "
            "source's figures and the mixture's",
            flush=True,
        )


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


def write_report(args, cfg: DictConfig, info: dict | None, results: dict, meta: dict) -> None:
    """The figures as JSON, with what they were measured on (provenance: command, commit, machine, load) and the
    trunk's training step, for shardlab_bench/tables.py's ssl_probe table."""

    def plain(v):
        return str(v) if isinstance(v, Path) else [plain(x) for x in v] if isinstance(v, list) else v

    settings = {k: plain(v) for k, v in vars(args).items() if k != "items"}
    report = {
        "meta": provenance.finish({**meta, "settings": settings}),
        "results": results,
        "task": cfg.task.name,
        "step": None if args.random_init else (info or {}).get("step"),
        "random_init": args.random_init,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": OmegaConf.to_container(cfg.data, resolve=True),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


def cli() -> None:
    """The console script (pyproject.toml's [project.scripts]): a mistake is one line and exit code 2."""
    run_tool(main)


if __name__ == "__main__":
    cli()
