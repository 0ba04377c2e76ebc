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
import json
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from shardlab.checkpoint import weights
from shardlab.cli.preflight import GROUPS, check_group_choices, compose_config
from shardlab.distributed.materialize import materialize
from shardlab.errors import CheckpointError, ConfigError, DataError, first_cause
from shardlab.registry import TASKS
from shardlab.runner import build_task
from shardlab.task import Evaluation, EvaluationRequest, Task
from shardlab.train import run_tool
from shardlab_commands import provenance

MODES = {
    "linear": ("--linear", "a vision model"),
    "knn": ("--knn", "a vision model"),
    "perplexity": ("--perplexity", "a language model"),
    "lm_eval": ("--lm-eval TASKS", "a language model"),
}
"""The evaluations the command line can ask for (argparse's names; Evaluation.modes names them so): each one's
option, and what it needs, for the line that refuses it on a task whose Evaluation does not offer it."""


# ---- the configs -----------------------------------------------------------------------------------------------------
def checkpoint_config(checkpoint: Path, overrides: list[str], user_dir: str | None) -> tuple[DictConfig, dict, dict]:
    """The training config a checkpoint describes, with ``overrides`` (key=value) applied, its description, and its
    data section as saved, before own_data_paths reset its paths (``user_dir``: the plug-ins of a run that had
    them)."""
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
    trained = OmegaConf.to_container(cfg.data) if isinstance(cfg.get("data"), DictConfig) else {}
    own_data_paths(cfg)
    if holds_its_starting_weights(cfg):
        cfg.model.pretrained = None  # the checkpoint holds those weights now: the file need not exist any more
    OmegaConf.set_struct(cfg, True)  # a mistyped key is an error, not a new key nothing reads
    if "sources" in cfg.get("data", {}):
        OmegaConf.set_struct(cfg.data.sources, False)  # its names are the user's; Evaluation.data_config checks them
    # +data.sources=... as training spells it (the + adds to the schema's empty mapping there; here it is emptied)
    overrides = [o.lstrip("+") for o in overrides]
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as e:
        raise ConfigError(f"{' '.join(overrides)}: {first_cause(e)} (keys of the checkpoint's config)") from None
    return cfg, info, trained


def holds_its_starting_weights(cfg: DictConfig) -> bool:
    """Whether a checkpoint's model.pretrained (the weights its run started from) can go: its task, registered by
    its class, lists the key among resumable_model_changes (it shapes nothing: a vision trunk's torchvision file),
    so the checkpoint holds all it gave. A language model's model.pretrained folder gives its architecture and
    tokenizer too (and a LoRA run's base weights), and stays."""
    if not cfg.get("model", {}).get("pretrained"):
        return False
    factory = TASKS.get(cfg.task.name, key="task.name")
    return isinstance(factory, type) and "pretrained" in getattr(factory, "resumable_model_changes", ())


DATA_PATH_KEYS = ("path", "cache_dir", "sources")
"""The data keys that name files to read or folders to write (data.sources: a mixture's corpora, each with its path):
a tool takes them from its own command line or the defaults, never from the checkpoint it is given (a shared
checkpoint's data.path could name any file the user can read, which the evaluation would tokenize into the cache and
decode back)."""


def own_data_paths(cfg: DictConfig) -> None:
    """Set cfg.data's DATA_PATH_KEYS to the defaults of the task's data schema (the command's overrides merge over
    them afterwards)."""
    from hydra.core.config_store import ConfigStore

    try:
        defaults = OmegaConf.to_container(ConfigStore.instance().load(f"schema/data/{cfg.task.name}.yaml").node)
    except Exception:  # noqa: BLE001  (a plug-in task without a registered data schema: no default path)
        defaults = {}
    data = cfg.get("data", {})
    for key in DATA_PATH_KEYS:
        if key in data:
            cfg.data[key] = defaults.get(key)


def composed_config(overrides: list[str]) -> DictConfig:
    """The config Hydra overrides compose to, as for a training run (for --random-init without a checkpoint)."""
    check_group_choices(overrides)
    try:
        return compose_config(overrides)
    except Exception as e:
        raise ConfigError(f"{' '.join(overrides)}: {first_cause(e)}") from None


def configs(args: argparse.Namespace) -> tuple[DictConfig, DictConfig, dict | None, dict | None]:
    """(the config evaluated on, the model's config, the checkpoint's description, its data section as saved): with a
    checkpoint, data.* choose what to evaluate on and the model is built as it was trained (e.g. its classes from its
    data); without one, both are the config the overrides compose to."""
    if args.checkpoint is None:
        cfg = composed_config(args.overrides)
        return cfg, cfg, None, None
    cfg, info, trained = checkpoint_config(args.checkpoint, args.overrides, args.user_dir)
    model_overrides = [o for o in args.overrides if not o.lstrip("+~").startswith("data.")]
    model_cfg, _, _ = checkpoint_config(args.checkpoint, model_overrides, args.user_dir)
    return cfg, model_cfg, info, trained


def saved_config_file(checkpoint: Path | None) -> Path | None:
    """The file that holds ``checkpoint``'s training config, for the errors that name it."""
    if checkpoint is None:
        return None
    return checkpoint / "shardlab.json" if checkpoint.is_dir() else weights.config_file(checkpoint)


# ---- the task and its model ------------------------------------------------------------------------------------------
def model_task(cfg: DictConfig, checkpoint: Path | None) -> Task:
    """The task of the model's config, checked, in this process."""
    try:
        return build_task(cfg, world_size=1, check_budget=False)
    except DataError as e:
        raise reading_trained_data(e, checkpoint) from None


def reading_trained_data(e: DataError, checkpoint: Path | None) -> DataError:
    """``e``, raised building a checkpoint's task or model, with what the user can do about it."""
    if checkpoint is None:
        return e
    return DataError(
        f"{e} (building {checkpoint}'s model reads the data it was trained on, e.g. to count classes; "
        "if that is gone, give the model key it derived, e.g. model.num_classes=N)"
    )


def load_model(
    task: Task, cfg: DictConfig, checkpoint: Path | None, ema: bool = False, pretrained: bool = False
) -> torch.nn.Module:
    """``task``'s model in this process, in eval mode: seeded init (cfg.seed), then the checkpoint's weights if given
    (their keys and shapes must fit the model the config describes); ``ema``: its optimization.ema average instead
    (DINO's teacher); ``pretrained``: without a checkpoint, the weights model.pretrained names, as a run starts from
    them (Task.load_pretrained: the trunk read, the head seeded)."""
    try:
        with torch.device("meta"):
            model = task.build_model()
    except DataError as e:
        raise reading_trained_data(e, checkpoint) from None
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
    return model.eval()


def build_model(
    cfg: DictConfig, checkpoint: Path | None, ema: bool = False, pretrained: bool = False
) -> tuple[Task, torch.nn.Module]:
    """The task of ``cfg`` and its model with the weights load_model gives it."""
    task = model_task(cfg, checkpoint)
    return task, load_model(task, cfg, checkpoint, ema, pretrained)


def model_loader(task: Task, cfg: DictConfig, args: argparse.Namespace, info: dict | None) -> Callable:
    """EvaluationRequest.model: the weights asked for, loaded on the first call, which says what is evaluated."""
    loaded: list[torch.nn.Module] = []

    def model() -> torch.nn.Module:
        if not loaded:
            where = str(args.checkpoint or args.pretrained or "the randomly initialised model")
            described = f"{where} (task {cfg.task.name}" + (f", step {info.get('step')}" if info else "")
            seeded = f", random init seed {cfg.seed}" if args.random_init else ""
            print(f"evaluating {described}{seeded})", flush=True)
            pretrained = bool(args.pretrained) and not args.random_init  # --random-init: the seeded init, nothing read
            loaded.append(load_model(task, cfg, None if args.random_init else args.checkpoint, args.ema, pretrained))
        return loaded[0]

    return model


def exporter(checkpoint: Path | None) -> Callable[[Path], None] | None:
    """EvaluationRequest.export: shardlab-export of ``checkpoint`` into a folder."""
    if checkpoint is None:
        return None

    def export(out: Path) -> None:
        from shardlab_commands import export_hf

        export_hf.main([str(checkpoint), "--out", str(out)])

    return export


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


def evaluation_of(task: Task) -> Evaluation:
    """The task's Evaluation, or one line saying it has none and which hook gives one."""
    evaluation = task.evaluation()
    if evaluation is None:
        raise ConfigError(
            f"task {task.cfg.task.name} offers no evaluation: shardlab-evaluate asks Task.evaluation for one; "
            "implement it to return a shardlab.task.Evaluation (docs/tutorial.md)"
        )
    return evaluation


def chosen_modes(args: argparse.Namespace, evaluation: Evaluation, task: str, where: str) -> tuple[str, ...]:
    """The evaluations asked for, or the default ones of ``task``'s Evaluation; a ConfigError for one it does not
    offer."""
    asked = tuple(m for m in MODES if getattr(args, m) not in (None, False))
    for mode in asked:
        if mode not in evaluation.modes:
            offered = " or ".join(MODES[m][0] if m in MODES else m for m in evaluation.modes)
            raise ConfigError(
                f"{where} is a {task} checkpoint; {MODES[mode][0].split()[0]} needs "
                f"{MODES[mode][1]}" + (f"; use {offered}" if offered else "")
            )
    modes = asked or evaluation.default_modes
    if not modes:
        raise ConfigError(f"{where}: task {task}'s Evaluation offers no default evaluation; ask for one of its modes")
    return tuple(modes)


def recorded_script() -> Path:
    """What --out records as the command that ran: a clone's shardlab-evaluate (shardlab_bench/tables.py --rerun runs a
    benchmark or a tools/ script), or this module in an install, which has no tools/."""
    script = provenance.REPO / "tools" / "evaluate.py"
    return script if script.is_file() else Path(__file__)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    meta = provenance.collect(str(recorded_script()), argv) if args.out is not None else None
    where = str(args.checkpoint or args.pretrained or "the randomly initialised model")
    cfg, model_cfg, info, trained = configs(args)
    args.batch_size = args.batch_size or cfg.validation.batch_size
    torch.manual_seed(args.seed)
    task = model_task(model_cfg, args.checkpoint)
    evaluation = evaluation_of(task)
    evaluation.data_config(cfg, trained, saved_config_file(args.checkpoint))
    modes = chosen_modes(args, evaluation, cfg.task.name, where)
    evaluation.settle(modes, args)
    request = EvaluationRequest(
        cfg=cfg,
        modes=modes,
        settings=args,
        info=info,
        model=model_loader(task, model_cfg, args, info),
        data_task=lambda: task if cfg is model_cfg else build_task(cfg, world_size=1, check_budget=False),
        export=exporter(args.checkpoint),
    )
    results = evaluation.evaluate(request)
    if args.out is not None:
        reported = {k: v for k, v in results.items() if k not in evaluation.report_leaves_out}
        write_report(args, cfg, info, reported, meta)
    return results


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
