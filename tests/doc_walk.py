"""Documented commands run as written, on stand-ins (issues #48 and #51): the walk that tests/distributed/
test_finetuning_commands.py and test_docs_pages_run.py take through the docs' ```bash blocks, and the stand-ins they
run on. Tests only.

A walk runs each command of a line as the shell splits it (tests/unit/test_docs_commands.py: line_commands), from a
working folder outside the repository whose HOME is a temporary folder, with this interpreter as ``python``,
``torch.distributed.run`` as ``torchrun`` and a ``shardlab-<name>`` command as its module. What the harness changes,
and says in each command's printed line:

- a training run is shortened to STEPS steps by an appended ``optimization.max_steps=STEPS`` (a key that does not name
  the run, so it trains in the folder the command names; the last override wins, a documented max_steps too), its
  validations cut to one batch (``validation.num_batches=1``) and backend=auto's measurement cut short (TINY_RUN);
- a placeholder path of the docs (PLACEHOLDERS: /my/text/dir, /imagenet, ...) is the stand-in the walk made for it;
- a later command naming a shortened run's documented last step (``step_00000300`` for the LM's 300 steps) is given
  the step it reached, and a sweep's documented folder the one the shortened sweep made (its max_steps names it).

Each command must exit 0 without a traceback and make what it says (Walk.check_result); one the docs show failing
(a ``# error: ...`` line below it) must fail with that error.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from shardlab.config import CONF_DIR
from shardlab_commands import COMMANDS
from tests.hf_folders import make_folder
from tests.unit.test_docs_commands import PYTHONS, line_commands, train_args

STEPS = 1
"""How many steps each documented training run trains here (appended as optimization.max_steps)."""
SHORTEN = f"optimization.max_steps={STEPS}"
ONE_VALIDATION_BATCH = "validation.num_batches=1"
"""Appended to each training run with SHORTEN: one batch per validation (validation.* keys name no run either; a
gpt_small run's ten batches of its final validation took minutes of a loaded 2-core machine)."""
STEP = re.compile(r"(?P<run>[^\s=]*?)/checkpoints/step_(?P<step>\d{8})\b")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as Qwen2.5's Instruct folders write it (without the default system turn)."""
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
PLACEHOLDERS = {
    "/my/text/dir": "{root}/stand-ins/text",
    "/data/fineweb/*.parquet": "{root}/stand-ins/fineweb/*.parquet",
    "/data/web": "{root}/stand-ins/text",
    "/imagenet": "{root}/stand-ins/imagenet",
    "CHECKPOINT": "runs/lm/default/checkpoints/step_00000300",
    "runs/swav/in1k/checkpoints/step_00100000": "runs/swav/default/checkpoints/step_00000540",
    "tok/tokenizer.json": "{home}/.cache/shardlab/stdlib-*/tokenizer.json",
    "stdlib-py311-<hash>": "stdlib-*",
}
"""The docs' placeholder paths -> the stand-ins a walk runs them on (a path with * is the one file it matches when
the command runs: the tokenizer an earlier command trained). Paths under $HOME (~/models, ~/data/flowers, ...),
held_out.txt and regnet_y_400mf.pth are made where the docs name them (stand_ins)."""
TINY_RUN = {"distributed.backend=auto": ["distributed.auto_tune_steps=2", "distributed.auto_tune_max_trials=2"]}
"""Overrides the walk appends to a training run whose line holds the key: backend=auto's measurement cut to 2 steps
of 2 candidates (distributed.* keys name no run); with distributed.auto_tune=false nothing is measured."""
IMAGENET_VAL = 4096
"""Validation images of the /imagenet stand-in: one validation.batch_size of the ImageNet recipes
(shardlab/conf/experiment/*_in1k*.yaml), which a run on a folder source checks the split holds."""
TOOLS_OUTPUT = {
    "shardlab-evaluate": r"top-1|ppl|perplexity|loss",
    "shardlab-sweep-summary": r"completed",
    "shardlab-preprocess": r"\S",
    "shardlab-plot": r"^curves\.png: [1-9]\d* runs",
}
"""What a tool that writes no --out prints when it did its work (a regular expression its stdout must match)."""


@dataclass
class Walk:
    """The commands run so far, from one working folder: the documented last step of each run shortened here."""

    cwd: Path
    env: dict[str, str]
    last_step: dict[str, str] = field(default_factory=dict)
    """'<run>/checkpoints/step_<its documented steps>' -> '<run>/checkpoints/step_<STEPS>'; a sweep's documented
    folder -> the folder the shortened sweep made."""
    trained: set[str] = field(default_factory=set)
    """The run folders a command of this walk trained (a later start of one finds it complete)."""
    background: list[tuple[list[str], subprocess.Popen, float]] = field(default_factory=list)
    """Commands a line started with a trailing ``&``: waited for after the next line."""

    def placeholders(self, token: str) -> str:
        """A documented path as the stand-in PLACEHOLDERS names for it."""
        for doc, stand_in in PLACEHOLDERS.items():
            if doc in token:
                token = token.replace(doc, stand_in.format(root=self.cwd.parent, home=self.env.get("HOME", "")))
        if "*" in token and (found := sorted(glob.glob(token.split("=", 1)[-1]))) and "parquet" not in token:
            token = token.replace(token.split("=", 1)[-1], found[0])  # the tokenizer an earlier command trained
        return token

    def injected(self, argv: list[str]) -> list[str]:
        """What the walk appends to a documented command: a training run's SHORTEN and TINY_RUN's overrides."""
        args = train_args(argv)
        if args is None or "dry_run=true" in args or "--help" in args:
            return []
        tiny = [o for key, extra in TINY_RUN.items() if key in args and "distributed.auto_tune=false" not in args
                for o in extra]  # fmt: skip
        return [SHORTEN, ONE_VALIDATION_BATCH, *tiny]

    def argv(self, argv: list[str]) -> list[str]:
        """argv as run here: this interpreter for ``python`` (torchrun as torch.distributed.run, a shardlab-<name>
        command as its module, whose ``cli`` the installed script calls), placeholders as their stand-ins, a training
        run shortened (self.injected), a shortened run's last step given as the step it reached."""
        injected = self.injected(argv)
        argv = [self.placeholders(a) for a in argv]
        for doc, reached in self.last_step.items():
            argv = [a.replace(doc, reached) for a in argv]
        if argv[0] in PYTHONS:
            argv = [sys.executable, *argv[1:]]
        elif Path(argv[0]).name == "torchrun":
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        elif argv[0] in COMMANDS:
            argv = [sys.executable, "-m", f"shardlab_commands.{COMMANDS[argv[0]]}", *argv[1:]]
        return [*argv, *injected]

    def run(self, line: str, error: str | None = None) -> list[tuple[list[str], subprocess.CompletedProcess]]:
        """Each command of a documented line, run as written (self.argv) and checked for what it promises; a line
        ending in ``&`` started in the background and checked with the next line. ``error``: the one-line error the
        docs show the line ending with (``# error: ...`` below it), which it must print, exiting non-zero."""
        for doc, stand_in in PLACEHOLDERS.items():  # one the shell would split (<hash>): replaced in the line
            line = line.replace(doc, stand_in) if "<" in doc else line
        if error is not None:
            (argv,) = line_commands(line)
            popen, started = self.start(argv), time.perf_counter()
            out, err = popen.communicate()
            print(f"{time.perf_counter() - started:5.1f} s  {shlex.join(argv)}   [the error the docs show]", flush=True)
            assert popen.returncode not in (0, None) and "Traceback" not in out + err, f"{line}\n{out}\n{err}"
            assert error in out + err, f"{line}: not the documented error {error!r}\n{out[-2000:]}\n{err[-2000:]}"
            return []
        if re.search(r"&\s*(#.*)?$", line) and not re.search(r"&&\s*(#.*)?$", line):
            (argv,) = line_commands(line)
            self.background.append((argv, self.start(argv), time.perf_counter()))
            return []
        ran = [(argv, self.finish(argv, self.start(argv), time.perf_counter())) for argv in line_commands(line)]
        for argv, proc, started in self.background:
            ran.append((argv, self.finish(argv, proc, started)))
        self.background = []
        return ran

    def start(self, argv: list[str]) -> subprocess.Popen:
        self.before = set(self.cwd.glob("runs/**/checkpoints/step_*")) | set(self.cwd.glob("multirun/**/summary.json"))
        return subprocess.Popen(
            self.argv(argv), cwd=self.cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def finish(self, argv: list[str], popen: subprocess.Popen, started: float) -> subprocess.CompletedProcess:
        stdout, stderr = popen.communicate()
        proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
        injected = " ".join(self.injected(argv))
        shown = shlex.join(argv) + (f"   [+ {injected}]" if injected else "")
        print(f"{time.perf_counter() - started:5.1f} s  {shown}", flush=True)  # the suite's -s
        why = f"{shlex.join(popen.args)}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, why
        assert "Traceback" not in proc.stdout + proc.stderr, why
        after = set(self.cwd.glob("runs/**/checkpoints/step_*")) | set(self.cwd.glob("multirun/**/summary.json"))
        self.check_result(argv, proc, after - self.before)
        return proc

    def check_result(self, argv: list[str], proc: subprocess.CompletedProcess, new: set[Path]) -> None:
        """What the command says it makes, it made."""
        args = train_args(argv)
        if any(a.startswith("--node_rank=") and a != "--node_rank=0" for a in argv):
            return  # another agent of a torchrun across nodes: node_rank 0's agent validates and names the step
        if args is not None:
            self.check_training(args, proc, new)
        elif argv[0] == "shardlab-export":
            out = self.cwd / argv[argv.index("--out") + 1]
            made = "adapter_config.json" if "--adapter-only" in argv else "model.safetensors.index.json"
            assert (out / made).is_file() and (out / "shardlab_export.json").is_file(), f"{out}: no {made}"
        elif argv[0] == "shardlab-generate":
            prompt = argv[argv.index("--prompt") + 1] if "--prompt" in argv else ""
            assert proc.stdout.startswith(prompt) and len(proc.stdout) > len(prompt) + 1, proc.stdout
        elif "--out" in argv:
            out = Path(argv[argv.index("--out") + 1])
            assert (self.cwd / out).exists(), f"{shlex.join(argv)}: no {out}\n{proc.stdout[-2000:]}"
        elif argv[0] in TOOLS_OUTPUT:
            assert re.search(TOOLS_OUTPUT[argv[0]], proc.stdout, re.M), proc.stdout[-2000:]

    def check_training(self, args: list[str], proc: subprocess.CompletedProcess, new: set[Path]) -> None:
        """A plan its plan, --help its usage, a sweep its completed points, a run its step and final validation (or
        the line saying it is complete, for a run this walk trained before)."""
        if "--help" in args:
            assert "Usage: python -m shardlab.train" in proc.stdout, proc.stdout[-2000:]
        elif "dry_run=true" in args:
            assert "nothing allocated" in proc.stdout, proc.stdout[-2000:]
        elif "hydra.launcher.wait=false" in args:  # submitted, not waited for (tests/slurm follows it)
            assert "not waiting (wait=false)" in proc.stdout, proc.stdout[-2000:]
        elif "-m" in args or "--multirun" in args:
            (summary,) = [p for p in new if p.name == "summary.json"]
            rows = json.loads(summary.read_text())
            assert rows and all(r["status"] == "completed" for r in rows), rows
            folder = summary.parent.relative_to(self.cwd).as_posix()
            documented = folder
            for injected in (SHORTEN, ONE_VALIDATION_BATCH, *(o for extra in TINY_RUN.values() for o in extra)):
                documented = documented.replace(f"{injected},", "").replace(f",{injected}", "")
            self.last_step[documented] = folder  # the sweep's folder is named by every override, the injected too
        elif complete := re.search(r"^run complete: (\S+) has reached", proc.stdout, re.M):
            assert complete.group(1) in self.trained, f"{complete.group(1)}: complete before this walk trained it"
        else:
            assert "final validation: loss" in proc.stdout, proc.stdout[-2000:]
            steps = {p for p in new if p.name.startswith("step_")}
            if "checkpoint.save=false" in args:
                return
            (step,) = steps  # the one run the command names, its last step
            assert step.name == f"step_{STEPS:08d}", new
            run = step.parent.parent.relative_to(self.cwd).as_posix()
            self.trained.add(run)
            documented = task_steps(args, self.cwd)
            self.last_step[f"{run}/checkpoints/step_{documented:08d}"] = f"{run}/checkpoints/{step.name}"


def task_steps(args: list[str], cwd: Path = Path()) -> int:
    """How many steps the command trains as documented: its own optimization.max_steps, else its task's
    (shardlab/conf/task/<task>.yaml, or a user_dir's conf/task/<task>.yaml, the user_dir from ``cwd``)."""
    given = [a.split("=", 1)[1] for a in args if a.startswith("optimization.max_steps=")]
    if given:
        return int(given[-1])
    task = next((a.split("=", 1)[1] for a in args if a.startswith("task=")), "lm")
    user_dirs = [cwd / a.split("=", 1)[1] / "conf" for a in args if a.startswith("user_dir=")]
    (conf,) = [c for c in (*user_dirs, CONF_DIR) if (c / "task" / f"{task}.yaml").is_file()][:1]
    return yaml.safe_load((conf / "task" / f"{task}.yaml").read_text())["optimization"]["max_steps"]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def chat_model(folder: Path, family: str, max_len: int) -> None:
    """A tiny model of ``family`` saved by transformers, with ChatML's special tokens and template."""
    from tokenizers import Tokenizer

    shape = {**TINY, "max_position_embeddings": max_len, "vocab_size": 336}  # the byte tokenizer's 320 and 2 more
    make_folder(family, folder, shape=shape)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))


def corpus_text() -> list[str]:
    words = "the model reads each shard of its weights after sharding and trains on the answers only".split()
    return [" ".join(words[(i + j) % len(words)] for j in range(60)) for i in range(400)]


def stand_ins(home: Path) -> None:
    """The folders and files the fine-tuning commands name under ~: models, a corpus, chat records, preference
    pairs."""
    models = home / "models"
    make_folder("qwen2", models / "Qwen2.5-0.5B", shape={**TINY, "max_position_embeddings": 2048})
    chat_model(models / "Qwen2.5-0.5B-Instruct", "qwen2", 2048)
    make_folder("llama3_tied", models / "Llama-3.2-1B", shape={**TINY, "max_position_embeddings": 2048})
    text = corpus_text()
    # 1.6 MB: the LM's 32 validation rows of 2048 tokens at data.valid_percent=5
    write_jsonl(home / "corpus" / "my_domain.jsonl", [{"text": t * 11} for t in text])
    # ~800 tokens a record: 8 validation rows of 2048 (one a rank of 8) at data.valid_percent=5
    chats = [[{"role": "user", "content": t[:40]}, {"role": "assistant", "content": (t * 3)[40:800]}] for t in text * 2]
    write_jsonl(home / "sft" / "train.jsonl", [{"messages": messages} for messages in chats[:600]])
    pairs = [{"prompt": t[:60], "chosen": t[60:120], "rejected": t[120:170]} for t in text[:80]]
    write_jsonl(home / "dpo" / "pairs.jsonl", pairs)


def image_folder(
    folder: Path, splits=("train", "val", "test"), classes: int = 2, per_class: int = 8, linked: dict | None = None
) -> None:
    """An ImageFolder tree (split/class/image.png, the ImageNet layout) of small generated images. ``linked``: split
    -> images per class it holds in all, the ones past ``per_class`` hard links to the generated ones (a count the
    run checks, made in a second, with nothing more to decode than the generated images)."""
    from PIL import Image

    for split in splits:
        for c in range(classes):
            (folder / split / f"class{c}").mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                shade = (40 + 100 * c + 5 * i) % 256
                Image.new("RGB", (40, 40), (shade, 255 - shade, (7 * i) % 256)).save(
                    folder / split / f"class{c}" / f"{i}.png"
                )
            for i in range(per_class, (linked or {}).get(split, 0)):
                (folder / split / f"class{c}" / f"{i}.png").hardlink_to(
                    folder / split / f"class{c}" / f"{i % per_class}.png"
                )


def page_stand_ins(root: Path, home: Path, work: Path) -> None:
    """The stand-ins of PLACEHOLDERS and the paths the other pages name: a text corpus (a folder of .txt files, and
    Parquet shards), image folders, a held-out text file, torchvision's regnet_y_400mf state dict (random weights:
    the download's stand-in)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import torchvision

    text = [t * 4 for t in corpus_text()]
    (root / "stand-ins" / "text").mkdir(parents=True)
    for i, document in enumerate(text):  # a file is a document: 400, so ~5% of them hash into validation
        (root / "stand-ins" / "text" / f"doc{i:03d}.txt").write_text(document)
    (root / "stand-ins" / "fineweb").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": text[i::2]}), root / "stand-ins" / "fineweb" / f"shard{i}.parquet")
    # ImageNet's val split holds 50,000 images: the recipes' dry runs check it holds a validation batch (4096)
    image_folder(root / "stand-ins" / "imagenet", linked={"val": IMAGENET_VAL // 2})
    image_folder(home / "data" / "flowers", per_class=100)  # a validation batch of the vision default (200) fits
    # a training batch (128) and a validation batch (200) of the SSL tasks' defaults (model.pretrained's SwAV run)
    image_folder(home / "data" / "unlabelled", splits=("train", "val"), linked={"train": 64, "val": 100})
    (work / "held_out.txt").write_text("\n\n".join(text[:100]))
    torch.save(torchvision.models.regnet_y_400mf().state_dict(), work / "regnet_y_400mf.pth")
