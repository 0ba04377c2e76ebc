"""Binarize a corpus for the LM task (the fairseq-preprocess analogue), optionally training its tokenizer first.

    shardlab-preprocess /my/text/dir                          # -> ~/.cache/shardlab/<name>-<hash>/
    shardlab-preprocess /data/shards --text-field text         # *.jsonl(.gz/.zst): a line; *.parquet: a row
    shardlab-preprocess /my/text/dir --tokenizer gpt2/tokenizer.json
    shardlab-preprocess --train-tokenizer bpe --vocab-size 4096   # a byte-level BPE of the embedded corpus
    shardlab-preprocess /data/web --tasks 4                    # 4 shards, by 4 local processes
    sbatch --array=0-63 --wrap "shardlab-preprocess /data/web --shards 64"   # one task per shard
    shardlab-preprocess /data/web --shards 64 --slurm --nodes 2 --tasks-per-node 32  # the same, submitit

Training runs this step themselves on first use (data.path=..., data.tokenizer=...) and reuse the result; run it
ahead of time to preprocess once for many jobs. Output: train.bin / valid.bin (uint16 token ids, uint32 for
vocabularies above 65,536), meta.json, and with --train-tokenizer the tokenizer.json to train with.

With --shards or --tasks the corpus's files are cut into shards that tasks tokenize at once
(shardlab_tasks/lm/corpus/shards.py): a task of a Slurm array or of a multi-task job takes its part from Slurm's
environment, and the task that finishes the last shard writes the manifest (meta.json). A task that dies leaves its
shards unfinished and the others whole: rerunning the same command redoes only those. The tokens are those one process
writes, token for token.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from shardlab.errors import ConfigError, DataError
from shardlab.train import run_tool
from shardlab_tasks.lm.config import LMDataConfig
from shardlab_tasks.lm.corpus.cache import corpus_sources, prepare_corpus, preprocess_shards, read_corpus_meta
from shardlab_tasks.lm.corpus.corpus import iter_texts
from shardlab_tasks.lm.corpus.tokenizer import FileTokenizer, load_tokenizer, train_bpe


def main(argv: list[str] | None = None) -> Path:
    defaults = LMDataConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "path", nargs="?", default=None, help="text/JSONL file or directory; omit for the embedded corpus"
    )
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--tokenizer", default=defaults.tokenizer, help="'byte' or the path of a tokenizer.json")
    parser.add_argument("--eod-token", default=defaults.eod_token, help="end-of-document token of --tokenizer")
    parser.add_argument("--train-tokenizer", choices=["bpe"], help="train a byte-level BPE on the corpus first")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the trained tokenizer")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=100.0, help="MB of the corpus to train it on")
    parser.add_argument(
        "--text-field", "--jsonl-field", default=defaults.text_field, help="JSONL key or Parquet/Arrow column of text"
    )
    parser.add_argument("--valid-percent", type=float, default=defaults.valid_percent)
    parser.add_argument("--max-corpus-mb", type=float, default=defaults.max_corpus_mb)
    parser.add_argument("--workers", type=int, default=defaults.num_preprocess_workers, help="-1: one per core")
    _shard_arguments(parser)
    args = parser.parse_args(argv)
    if args.shards or args.tasks > 1 or args.slurm or _slurm_task() is not None or args.task_index is not None:
        return _sharded(args)

    cache_dir = Path(args.cache_dir).expanduser()
    if args.train_tokenizer:
        if args.tokenizer != "byte":
            raise ConfigError("--train-tokenizer trains a new tokenizer; drop --tokenizer, or drop --train-tokenizer")
        sources, _ = corpus_sources(args.path)
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="tokenizer-", dir=cache_dir) as tmp:
            print(f"training a byte-level BPE ({args.vocab_size} tokens) on {args.tokenizer_sample_mb:g} MB ...")
            sample = iter_texts(sources, args.text_field, int(args.tokenizer_sample_mb * 2**20))
            tok_file = train_bpe(sample, args.vocab_size, Path(tmp) / "tokenizer.json")
            out = _prepare(args, FileTokenizer(tok_file), {"tokenizer.json": tok_file})
    else:
        out = _prepare(args, load_tokenizer(args.tokenizer, args.eod_token), None)
    meta = read_corpus_meta(out)  # through the one reader, as training reads it
    print(_summary(out, meta, f"{meta['documents']['train']} / {meta['documents']['valid']} documents"))
    tokenizer = str(out / "tokenizer.json") if args.train_tokenizer else None
    print(f"train with: python -m shardlab.train{_data_overrides(args, tokenizer)}")
    return out


def _summary(out: Path, meta: dict, what: str) -> str:
    """The line that says what a finished cache holds: its tokens of each split, ``what`` (documents or shards)."""
    return f"{out}: {meta['train_tokens']:,} train / {meta['valid_tokens']:,} valid tokens ({what}, {meta['dtype']})"


def _shard_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("as many tasks (docs/corpora.md#preprocessing-as-shards)")
    group.add_argument("--shards", type=int, default=0, help="cut the corpus into this many shards (default: --tasks)")
    group.add_argument("--tasks", type=int, default=1, help="local processes, each tokenizing its part of the shards")
    group.add_argument(
        "--task-index", type=int, help="this task's index (default: $SLURM_ARRAY_TASK_ID or $SLURM_PROCID)"
    )
    group.add_argument("--num-tasks", type=int, help="how many tasks share the shards (default: from Slurm)")
    group.add_argument("--slurm", action="store_true", help="submit the tasks as one Slurm job through submitit")
    for key in ("partition", "nodes", "tasks_per_node", "cpus_per_task", "timeout_min", "mem_gb"):
        group.add_argument(f"--{key.replace('_', '-')}", dest=key, help="--slurm: as hydra/launcher=slurm's key")


def _slurm_task() -> tuple[int, int] | None:
    """(index, count) of this process in a Slurm array, or in a job step of several tasks (srun, submitit)."""
    env = os.environ
    if "SLURM_ARRAY_TASK_ID" in env:
        first, last = int(env.get("SLURM_ARRAY_TASK_MIN", 0)), int(env.get("SLURM_ARRAY_TASK_MAX", 0))
        return int(env["SLURM_ARRAY_TASK_ID"]) - first, last - first + 1
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1))) > 1:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1)))
    return None


def _sharded(args) -> Path:
    if args.train_tokenizer or args.max_corpus_mb:
        raise ConfigError(
            "--shards/--tasks: train the tokenizer first (--train-tokenizer, one task) and drop --max-corpus-mb; "
            "then preprocess with --tokenizer <its tokenizer.json>"
        )
    if args.slurm:
        return _submit(args)
    if args.tasks > 1:
        return _local_tasks(args)
    index, count = _task(args)
    cores = len(os.sched_getaffinity(0))  # a Slurm task's own cores
    workers = args.workers if args.workers >= 0 else (cores if cores > 1 else 0)
    tok = load_tokenizer(args.tokenizer, args.eod_token)
    num_shards = args.shards or count
    out, meta = preprocess_shards(
        args.path, args.cache_dir, tok, args.valid_percent, args.text_field, num_shards, (index, count), workers
    )
    if meta is None:
        print(f"task {index} of {count} done; the manifest comes with the last shard ({out})", flush=True)
    else:  # this task wrote the manifest: its log (an array task's, on another node) says how to train
        shards = f"{len(meta['shards'])} shards"
        print(f"{_summary(out, meta, shards)}; train with{_data_overrides(args) or ' the defaults'}")
    return out


def _task(args) -> tuple[int, int]:
    if args.task_index is not None:
        count = args.num_tasks or args.shards or 1
        if not 0 <= args.task_index < count:
            raise ConfigError(f"--task-index {args.task_index} must be in 0..{count - 1} (--num-tasks {count})")
        return args.task_index, count
    return _slurm_task() or (0, 1)


def _task_argv(args, num_shards: int) -> list[str]:
    """This command for one task: the same corpus and settings, the same shards."""
    argv = [*([args.path] if args.path else []), "--cache-dir", args.cache_dir, "--tokenizer", args.tokenizer]
    argv += ["--text-field", args.text_field, "--valid-percent", str(args.valid_percent), "--shards", str(num_shards)]
    argv += ["--eod-token", args.eod_token] if args.eod_token else []
    return argv


def task_workers(workers: int, tasks: int, cores: int) -> int:
    """--workers for each of ``tasks`` local tasks: as given, or (-1) the machine's cores shared out, at least one
    each. A tokenizer file's library threads over every core unless told (--workers 0): N tasks so would run N x cores
    threads, and 4 BPE tasks on 2 cores lost a quarter of the rate per CPU-second (docs/corpora.md#scaling)."""
    return workers if workers >= 0 else max(1, cores // tasks)


def _local_tasks(args) -> Path:
    """--tasks N: N processes of this tool on this machine, one in-process tokenizer each, the cores shared out
    among them (task_workers); a task that fails is named, and the rerun redoes only its shards."""
    num_shards = args.shards or args.tasks
    workers = task_workers(args.workers, args.tasks, len(os.sched_getaffinity(0)))
    argv = _task_argv(args, num_shards) + ["--workers", str(workers), "--num-tasks", str(args.tasks)]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--task-index", str(t)]) for t in range(args.tasks)]
    failed = [(t, p.wait()) for t, p in enumerate(procs)]
    failed = [(t, rc) for t, rc in failed if rc != 0]
    if failed:
        names = ", ".join(f"task {t} (exit code {rc})" for t, rc in failed)
        raise DataError(f"{names} of {args.tasks} failed; rerun the same command: it redoes only their shards")
    return _finished(args, num_shards)


def _finished(args, num_shards: int) -> Path:
    out, meta = preprocess_shards(
        args.path, args.cache_dir, load_tokenizer(args.tokenizer, args.eod_token), args.valid_percent,
        args.text_field, num_shards, (0, num_shards), 0,
    )  # fmt: skip  # every shard is finished: this only checks and reports
    if meta is None:
        raise DataError(f"{out}: shards are missing after every task ended; rerun the same command")
    print(_summary(out, meta, f"{len(meta['shards'])} shards"))
    return out


def _submit(args) -> Path:
    """--slurm: one job of nodes x tasks_per_node tasks through submitit, with hydra/launcher=slurm's settings
    (conf/hydra/launcher/slurm.yaml) where not given; waits for it, then checks the manifest."""
    import submitit
    from omegaconf import OmegaConf

    from shardlab.config import CONF_DIR
    from shardlab.jobs.sbatch_paths import escape_slurm_output_paths

    preset = OmegaConf.load(CONF_DIR / "hydra" / "launcher" / "slurm.yaml")
    keys = ("partition", "nodes", "tasks_per_node", "cpus_per_task", "timeout_min", "mem_gb")
    params = {k: getattr(args, k) if getattr(args, k) is not None else preset.get(k) for k in keys}
    params = {k: (int(v) if k != "partition" and v is not None else v) for k, v in params.items() if v is not None}
    num_tasks = params.get("nodes", 1) * params.get("tasks_per_node", 1)
    num_shards = args.shards or num_tasks
    folder = Path(args.cache_dir).expanduser() / "preprocess-jobs" / "%j"
    escape_slurm_output_paths()  # a cache_dir with a '%' in it
    executor = submitit.AutoExecutor(folder=folder)
    executor.update_parameters(**{("slurm_" + k if k == "partition" else k): v for k, v in params.items()})
    argv = _task_argv(args, num_shards) + ["--workers", str(args.workers)]
    job = executor.submit(main, argv)  # each task finds its index in SLURM_PROCID of the job step
    print(f"submitted job {job.job_id}: {num_tasks} tasks over {num_shards} shards; logs in {folder}", flush=True)
    job.results()
    return _finished(args, num_shards)


def _data_overrides(args, tokenizer: str | None = None) -> str:
    """The data.* overrides that make training find this cache (the ones that differ from the defaults): without its
    tokenizer, training would key, and build, another cache. ``tokenizer``: the one trained here, else --tokenizer."""
    d = LMDataConfig()
    if tokenizer is None:  # the byte-level default stays the default ('byte'), never written as None
        given = args.tokenizer
        tokenizer = given if given == d.tokenizer else str(Path(given).expanduser().resolve())
    pairs = [
        ("path", str(Path(args.path).expanduser().resolve()) if args.path else None, d.path),
        ("tokenizer", tokenizer, d.tokenizer),
        ("eod_token", args.eod_token, d.eod_token),
        ("cache_dir", args.cache_dir, d.cache_dir),
        ("text_field", args.text_field, d.text_field),
        ("valid_percent", args.valid_percent, d.valid_percent),
        ("max_corpus_mb", args.max_corpus_mb, d.max_corpus_mb),
    ]
    return "".join(" " + _shell_word(f"data.{key}={_hydra_value(value)}") for key, value, default in pairs
                   if value != default)  # fmt: skip


def _shell_word(text: str) -> str:
    """``text`` as one shell word: bare where it can be, in double quotes around Hydra's single ones where that is
    safe (no $, `, \\, ! or "), else shlex's quoting."""
    if shlex.quote(text) == text or re.search(r'[$`\\!"]', text):
        return shlex.quote(text)
    return f'"{text}"'


def _hydra_value(value) -> str:
    """``value`` as Hydra's override grammar reads it back: quoted unless plainly a word, number or path (an end of
    document token such as <|endoftext|> is none of those)."""
    text = str(value)
    return text if re.fullmatch(r"[\w./+-]+", text) else "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _prepare(args, tokenizer, extra_files) -> Path:
    return prepare_corpus(
        args.path,
        args.cache_dir,
        tokenizer,
        args.valid_percent,
        args.max_corpus_mb,
        args.text_field,
        args.workers,
        extra_files,
    )


def cli() -> None:
    """The console script (pyproject.toml's [project.scripts]): a mistake is one line and exit code 2."""
    run_tool(main)


if __name__ == "__main__":
    cli()
