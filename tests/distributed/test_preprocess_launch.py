"""First runs on a corpus that takes longer to preprocess than distributed.timeout_s: preprocessing happens before
the process group exists, so under torchrun, local ranks and Slurm the run trains; two runs started at once on one
fresh cache preprocess it once and train on the same tokens; ranks that opened different corpora refuse in one line.

The corpus is text with a byte-level BPE tokenizer, sized to this machine: the fixture times the preprocessing of a
sample with the workers the runs use and writes enough for three timeouts' worth (machines here encode 3-8 MB/s
with two workers, so no fixed size is both long enough everywhere and short elsewhere); each test asserts that its
first preprocessing took longer than the 5 s timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.distributed.env import free_port
from shardlab_tasks.lm.corpus.cache import embedded_corpus_files, prepare_corpus, read_corpus_meta
from shardlab_tasks.lm.corpus.tokenizer import train_bpe
from tests.conftest import TINY_LM

pytestmark = pytest.mark.e2e  # torchrun and local-rank jobs as commands: CI runs it after the suite (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5
MIN_CORPUS_MB = 32
SAMPLE_MB = 8


def write_repeated(path: Path, text: str, mb: float) -> Path:
    with open(path, "w") as f:
        while f.tell() < mb * 2**20:
            f.write(text)
    return path


@pytest.fixture(scope="module")
def slow_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(a text file that takes ~3 timeouts to preprocess here, a 1,024-token BPE tokenizer.json trained on a slice)."""
    root = tmp_path_factory.mktemp("slow_corpus")
    text = "".join(p.read_text(errors="replace") for p in embedded_corpus_files()[:400])
    tokenizer = train_bpe([text[:300_000]], 1024, root / "tokenizer.json")
    sample = write_repeated(root / "sample.txt", text, SAMPLE_MB)
    # The runs' own worker count (default_workers picks one per core at this size), so start-up costs count too.
    timed = prepare_corpus(str(sample), str(root / "sample-cache"), str(tokenizer), 0.5, 0, num_workers=os.cpu_count())
    meta = read_corpus_meta(timed)
    mb_per_s = meta["bytes_read"] / 2**20 / meta["seconds"]
    corpus = write_repeated(root / "corpus.txt", text, max(MIN_CORPUS_MB, 3 * TIMEOUT_S * mb_per_s))
    return corpus, tokenizer


def overrides(corpus: Path, tokenizer: Path, cache: Path, run_dir: Path) -> list[str]:
    return [
        *TINY_LM,
        f"data.path={corpus}",
        f"data.tokenizer={tokenizer}",
        "data.max_corpus_mb=0",
        f"data.cache_dir={cache}",
        f"distributed.timeout_s={TIMEOUT_S}",
        "distributed.backend=ddp",
        f"hydra.run.dir={run_dir}",
    ]


def preprocessing_seconds(out: str) -> list[float]:
    """The seconds of each preprocessing the output reports ("read 12.0 MB in 9.1 s ...")."""
    return [float(s) for s in re.findall(r"read [\d.,]+ MB in ([\d.]+) s", out)]


def train_curve(run_dir: Path) -> list[str]:
    """Each logged step's loss and gradient norm, as train.log prints them."""
    return re.findall(r"\[train\] (step \d+ \| loss \S+) .*?(gnorm \S+)", (run_dir / "train.log").read_text())


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, **kwargs)


def test_torchrun_with_a_5s_timeout_trains_on_a_corpus_whose_preprocessing_takes_longer(slow_corpus, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    proc = run([*torchrun, "-m", "shardlab.train", *overrides(*slow_corpus, tmp_path / "cache", tmp_path / "run")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (seconds,) = preprocessing_seconds(proc.stdout)  # one rank preprocessed, the other waited for it
    assert seconds > TIMEOUT_S, f"preprocessing took {seconds} s: the sample misjudged this machine's speed"
    assert proc.stdout.count("which is preprocessing") == 1
    assert "[train] step 10 |" in proc.stdout and "world size 2 (torchrun)" in proc.stdout


@pytest.mark.slow
def test_two_runs_started_at_once_on_a_fresh_cache_preprocess_it_once_and_train_alike(slow_corpus, tmp_path):
    """Each run has 2 local ranks (distributed.world_size=2): their parent processes race for the same cache."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "shardlab.train", *overrides(*slow_corpus, tmp_path / "cache", tmp_path / name),
             "distributed.world_size=2"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name in ("a", "b")
    ]  # fmt: skip
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    both = "".join(out for out, _ in outputs)
    (seconds,) = preprocessing_seconds(both)
    assert seconds > TIMEOUT_S
    assert both.count("which is preprocessing") == 1  # the other run waited for the writer, then reused its files
    assert train_curve(tmp_path / "a") == train_curve(tmp_path / "b") and len(train_curve(tmp_path / "a")) == 10
    caches = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(caches) == 1 and not caches[0].endswith(".lock"), caches


@pytest.mark.slow
def test_ranks_that_opened_different_corpora_refuse_in_one_line(tmp_path):
    """Node-local corpora that differ (here: a path per local rank): every rank stops before training, all with
    rank 0's message."""
    for rank, files in ((0, 20), (1, 19)):
        (tmp_path / f"node{rank}").mkdir()
        for i in range(files):
            (tmp_path / f"node{rank}" / f"{i}.txt").write_text(f"file {i} of a small corpus\n" * 400)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    proc = run(
        [*torchrun, "-m", "shardlab.train", *TINY_LM, f"data.path={tmp_path}/node${{oc.env:LOCAL_RANK}}",
         f"data.cache_dir={tmp_path / 'cache'}", "distributed.backend=ddp", f"hydra.run.dir={tmp_path / 'run'}"]
    )  # fmt: skip
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and len(set(errors)) == 1, proc.stderr[-3000:]
    assert re.match(r"error: the ranks opened different data: rank 0 \(.+\) [\d,]+ train / .*, rank 1 \(", errors[0])
    assert "[train]" not in proc.stdout
