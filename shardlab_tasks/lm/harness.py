"""EleutherAI's lm-evaluation-harness (``lm-eval``) on a shardlab language model, through its Hugging Face export.

The checkpoint is exported as shardlab-export does (a GPT2LMHeadModel or LlamaForCausalLM, fp32, with the run's
own tokenizer) and the harness loads that folder with its ``HFLM``: the model the harness scores is the one
transformers loads, and tests/unit/test_lm_eval.py holds it to shardlab's own numbers.

The harness's context window is ``data.seq_len`` (not transformers' ``n_positions``), so its rolling log-likelihood
(wikitext-style tasks) cuts a text into the blocks shardlab's perplexity uses: it predicts a document's first token
from the beginning-of-text token, which the export sets to shardlab's end-of-document token, as shardlab predicts a
document's first token from the previous document's end. The two agree exactly on a document that follows an
end-of-document token in the corpus and whose length is a multiple of data.seq_len; on other texts they differ only at
the edges (the harness's last window re-reads earlier tokens, shardlab drops a partial last block).

lm-eval is an optional extra (``pip install -e '.[lm-eval]'``), imported only here.
"""

from __future__ import annotations

import difflib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from shardlab.errors import ConfigError, DataError

INSTALL = "pip install -e '.[lm-eval]'"


def import_harness():
    """lm_eval's entry points, or a ConfigError naming the extra."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ConfigError(f"--lm-eval needs lm-evaluation-harness with its hf models ({e}); {INSTALL}") from None
    return lm_eval, HFLM, TaskManager


OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub (HF_ENDPOINT's host) cannot be reached from here, or None: offline by the user's
    flags, or its host name does not resolve. Asked before the harness is imported: offline, its hub client is told so
    (OFFLINE_FLAGS), and a dataset the cache lacks fails at once, not after a minute of retries."""
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:  # first: the flags task_manager sets for this reason must not hide it
        return f"{host} does not resolve ({e.strerror or e})"
    flags = [f for f in OFFLINE_FLAGS if os.environ.get(f, "").lower() in ("1", "true", "yes", "on")]
    return f"{flags[0]} is set" if flags else None


def check_task_names(names: list[str], known: list[str], include: list[Path]) -> None:
    """Refuse task names the harness does not know, in one line with the nearest known name."""
    unknown = [n for n in names if n not in known and "*" not in n]
    if not unknown:
        return
    near = difflib.get_close_matches(unknown[0], known, n=1)
    where = f" in lm-eval's tasks or {', '.join(map(str, include))}" if include else " in lm-eval's tasks"
    hint = f" Did you mean '{near[0]}'?" if near else " Give a folder of task YAMLs with --lm-eval-include."
    raise ConfigError(f"--lm-eval: no task '{unknown[0]}'{where}.{hint}")


def task_manager(tasks: list[str], include: list[Path]):
    """The harness's TaskManager over its own tasks and the ``include`` folders, once every name in ``tasks`` is
    known there (checked before anything is exported)."""
    if hub_unreachable() is not None:  # before the hub client reads its flags (at its import)
        os.environ.update({flag: "1" for flag in OFFLINE_FLAGS})
    _, _, TaskManager = import_harness()
    for folder in include:
        if not folder.is_dir():
            raise ConfigError(f"--lm-eval-include {folder}: not a folder; give the folder that holds the task YAMLs")
    paths = [str(p) for p in include]
    # Indexing the harness's own ~15,000 task YAMLs takes ~30 s on 2 cores: skipped when the named tasks are all
    # in the given folders.
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=paths or None)
    check_task_names(tasks, manager.all_tasks, include)
    return manager


def run_harness(
    export_dir: Path,
    tasks: list[str],
    manager,
    *,
    max_length: int,
    device: str,
    batch_size: int,
    limit: float | None = None,
    num_fewshot: int | None = None,
    bootstrap_iters: int = 100_000,
) -> dict:
    """simple_evaluate on the export in ``export_dir``: the harness's results dict (``results`` per task, and
    ``samples``, each document's scores)."""
    lm_eval, HFLM, _ = import_harness()
    model = HFLM(
        pretrained=str(export_dir),
        tokenizer=str(export_dir),  # the run's own tokenizer, as exported, never one from the hub
        max_length=max_length,
        device=device,
        dtype="float32",
        batch_size=batch_size,
    )
    try:
        return lm_eval.simple_evaluate(
            model=model,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            log_samples=True,
        )
    except ConnectionError as e:  # datasets' "Couldn't reach '<name>' on the Hub", online or offline
        offline = hub_unreachable()
        raise DataError(
            f"--lm-eval {','.join(tasks)}: {e}{f'; {offline}' if offline else ''}; the harness downloads a task's "
            "dataset from the Hugging Face Hub on first use (cached in HF_HOME): run it once where the hub is "
            "reachable, or give task YAMLs over local files (--lm-eval-include)"
        ) from None


def summarize(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from the harness's results, its ``,none`` filter suffixes dropped."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        out[task] = {
            key.removesuffix(",none"): value
            for key, value in metrics.items()
            if key != "alias" and isinstance(value, int | float)
        }
    return out
