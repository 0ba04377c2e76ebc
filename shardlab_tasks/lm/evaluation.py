"""shardlab-evaluate for the LM task (Task.evaluation): the perplexity of a checkpoint on a corpus (fairseq's eval-lm),
and EleutherAI's lm-evaluation-harness on its Hugging Face export (shardlab_tasks/lm/harness.py).

The perplexity is the task's loss summed over every block of data.seq_len tokens of the chosen split, as the trainer's
validation computes it. A run trained on a mixture is given its sources again as ``data.sources`` (a checkpoint's
paths are never read; each source's weight and text_field default to the run's): each source's loss and ppl, and the
mixture's, as its validation logged them."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import ConcatDataset, DataLoader

from shardlab.errors import CheckpointError, ConfigError, DataError
from shardlab.task import Evaluation, EvaluationRequest, setting
from shardlab_tasks.lm.config import LMSourceConfig
from shardlab_tasks.lm.corpus.cache import read_corpus_meta
from shardlab_tasks.lm.corpus.data import open_split
from shardlab_tasks.lm.corpus.mixture import MixtureValid
from shardlab_tasks.lm.harness import run_harness, summarize, task_manager


class LMEvaluation(Evaluation):
    """--perplexity (the default) and --lm-eval TASKS; both asked for: the harness's figures, then the perplexity."""

    modes = ("perplexity", "lm_eval")
    default_modes = ("perplexity",)
    report_leaves_out = ("lm_eval_samples",)

    def data_config(self, cfg: DictConfig, trained: dict | None, described: Path | None) -> None:
        if trained is None:
            return
        complete_sources(cfg, trained_sources(trained, described))
        note_trained_mixture(cfg, trained)

    def settle(self, modes: tuple[str, ...], settings: Any) -> None:
        """A corpus has train and valid splits (valid by default); the harness has no split."""
        if "perplexity" not in modes:
            return
        if settings.split == "test":
            raise ConfigError("--split test: a corpus has train and valid splits; use --split valid, train or all")
        settings.split = settings.split or "valid"

    def evaluate(self, request: EvaluationRequest) -> dict[str, Any]:
        results: dict[str, Any] = {}
        if "lm_eval" in request.modes:
            results.update(evaluate_harness(request))
        if "perplexity" in request.modes:
            model = request.model()
            data_task = request.data_task()
            results.update(evaluate_perplexity(data_task, model, request.cfg, request.settings))
        return results


# ---- the run's mixture, given again on the command line ------------------------------------------------------------
HAD_PATH = "had_path"
"""In trained_sources' answer: whether the run's source had a path of its own (its value is never kept)."""


def trained_sources(trained: dict, described: Path | None) -> dict[str, dict]:
    """The checkpoint's data.sources (``trained``: its data section as saved) less their paths (name -> weight,
    text_field, and HAD_PATH: whether it had one): what a source the command line names again keeps of its training
    (complete_sources). A source that is no mapping is a CheckpointError naming ``described``."""
    sources = trained.get("sources") or {}
    for name, source in sources.items():
        if not isinstance(source, dict):  # training's schema would have refused it: the file was edited since
            raise CheckpointError(
                f"{described}: config.data.sources.{name} is {source!r}, not a source ({{path, weight, text_field}}); "
                "the file was changed after training: restore it"
            )
    return {
        name: {**{k: v for k, v in source.items() if k != "path"}, HAD_PATH: bool(source.get("path"))}
        for name, source in sources.items()
    }


def complete_sources(cfg: DictConfig, trained: dict[str, dict]) -> None:
    """Give each source of the command line's data.sources the keys it leaves out: its training's (weight, text_field:
    the mixture is weighed as it was trained) for a name the checkpoint had, else the schema's; refuse a key no
    source has (training's schema would), and a source without a path that the run read from a corpus of its own
    (else it would be scored on the embedded corpus under that source's name)."""
    sources = cfg.get("data", {}).get("sources")
    if not sources:
        return
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


def note_trained_mixture(cfg: DictConfig, trained: dict) -> None:
    """A run trained on data.sources, evaluated on no corpus of the command line's: say what is evaluated instead,
    and how to evaluate its sources (their paths are never read from the checkpoint)."""
    sources = trained.get("sources") or {}
    if sources and not setting(cfg.data, "sources") and setting(cfg.data, "path") is None:
        print(
            f"note: {', '.join(sources)} (the run's data.sources) are not read from its checkpoint: evaluating on the "
            "embedded corpus; give +data.sources='{name: {path: ...}, ...}' (weights default to the run's) for each "
            "source's figures and the mixture's",
            flush=True,
        )


# ---- perplexity ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_perplexity(task, model, cfg, args) -> dict[str, float]:
    """The task's loss summed over every block of the split, then its metrics (loss, ppl) from the totals. A mixture
    (data.sources): each source's blocks in turn with their source's number, so its metrics are those training's
    validation logs for it (shardlab_tasks/lm/corpus/mixture.py: each source's loss and ppl, and the mixture's,
    weighed)."""
    device = torch.device(args.device)
    seq_len = cfg.data.seq_len
    if setting(cfg.data, "sources"):
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
    mixture = task.mixture if setting(cfg.data, "sources") else None
    for name in mixture.names if mixture is not None else []:
        metrics[f"{name}/tokens"] = int(sums.get(f"count/{name}", 0))
    print_perplexity(metrics, mixture, cfg, args)
    return metrics


def split_blocks(corpus: Path, split: str, seq_len: int):
    """The blocks of one split of a preprocessed corpus; all: every document, both splits less one too short for a
    block (a one-file corpus)."""
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


# ---- lm-evaluation-harness -------------------------------------------------------------------------------------------
def evaluate_harness(request: EvaluationRequest) -> dict:
    """The harness's metrics per task on the checkpoint's Hugging Face export (in --export-dir, or a temporary
    folder removed afterwards), and its per-sample records (lm_eval_samples, which --out leaves out)."""
    cfg, args = request.cfg, request.settings
    if request.export is None:
        raise ConfigError("--lm-eval evaluates a trained checkpoint's export; give a checkpoint, without --random-init")
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
        request.export(out)
        raw = run_harness(out, tasks, manager, **settings)
    metrics = summarize(raw)
    for task, values in metrics.items():
        shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items() if not k.endswith("_stderr"))
        print(f"lm-eval {task}: {shown}", flush=True)
    return {"lm_eval": metrics, "lm_eval_samples": raw.get("samples", {})}
