"""Commands in the docs are checked as written (issue #51): every line of a ```bash block of README.md and docs/*.md
is split as the shell splits it, and

- every ``python -m shardlab.train ...`` (``.venv/bin/python``, ``torchrun ... -m shardlab.train`` too) passes the
  CLI's command-line checks and is composed by Hydra with all its overrides, the launcher's included: a misspelt or
  renamed key, group or option, or a value of the wrong type, fails. A sweep (``-m``) is composed at its first point.
- every user command on the PATH (``shardlab-export ...``, shardlab_commands.COMMANDS), every benchmark
  (``python -m shardlab_bench NAME ...``) and every ``python tools/X.py ...``: the command is one pyproject.toml
  installs, a benchmark the runner lists, or tools/X.py exists, and each ``--option`` the line gives is one its
  ``--help`` lists.
- every other command stands on a line marked in the docs with a trailing ``# not checked: KIND`` (or ``(not
  checked: KIND)`` at the end of the line's comment), KIND one of NOT_CHECKED (installs, the reader's shell, a Slurm
  beyond the test cluster, a GPU, the suite and linters, a download, a tracking service, a benchmark): an unmarked one
  fails, and so do a mark on a line whose commands are all checked (but on a page of RUN_AS_WRITTEN), a mark of a
  kind NOT_CHECKED does not list, and a kind no page marks.
- after the quickstart, each README everyday command that trains names a run folder of its own (one that named the
  quickstart's would find it complete and train nothing), and each step folder the README names is the quickstart's.

The rule, for the default suite's budget (15 min on 2 cores): this test runs nothing for real; composing
a command and checking a tool's options catch what a renamed key or flag breaks, in about a second each. The commands
run for real, as written, in order, on stand-ins (a temporary HOME, the docs' placeholder paths mapped to tiny
stand-ins, each training run shortened to optimization.max_steps=1 by the harness: tests/doc_walk.py), by the tests of
RUN_AS_WRITTEN: in CI's end-to-end pass (``-m e2e``) only a few cheap lines (test_docs_pages_run.py:
test_the_cheapest_commands_run; the planted broken commands in the default suite); every page under ``-m slow`` (one
test per page); the lines that submit to Slurm on the test cluster (``-m slurm``). docs/tutorial.md runs in
tests/distributed/test_tutorial.py (``-m e2e``); docs/benchmarks.md's benchmarks (minutes each) are only composed and
option-checked here. On a page of RUN_AS_WRITTEN a command of any
kind needs no mark (its walk runs it), and a marked line is one its walk does not run: listed with its kind.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType

from shardlab.cli.preflight import check_command_line, job_overrides, with_home_expanded, with_user_dir
from shardlab.cli.run_names import run_name
from shardlab.config import CONF_DIR
from shardlab.errors import ShardlabError
from shardlab_bench import benchmarks
from shardlab_commands import COMMANDS

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
SEPARATORS = ("&&", "||", ";", "&", "|")
PYTHONS = ("python", "python3", ".venv/bin/python")

NOT_CHECKED = {
    "install": "makes the quickstart's venv or installs packages (a download)",
    "shell": "acts on the reader's shell (source) or serves until stopped (tensorboard)",
    "slurm": "needs a Slurm the test cluster is not (sbatch, srun, more nodes, another partition) or root and network "
    "namespaces (tools/slurm_cluster.sh)",
    "gpu": "needs a GPU",
    "dev": "the suite, the linter and the dependency-range check: each is its own CI job",
    "download": "downloads what it reads (lm-evaluation-harness's tasks, torchvision's weights)",
    "service": "logs to a tracking service this machine cannot reach (a W&B account, an MLflow server)",
    "bench": "a benchmark or a seeds study: minutes to hours of measurement (docs/benchmarks.md runs them)",
}
"""The kinds of command the docs mark as not checked, and why; the mark names the kind, and each kind here is marked
somewhere (a train command on a marked line, the quickstart's, is still checked)."""
RUN_AS_WRITTEN = {
    "finetuning.md": "tests/distributed/test_finetuning_commands.py",
    **{
        page: "tests/distributed/test_docs_pages_run.py"
        for page in ("README.md", "configuration.md", "memory-plan.md", "models.md", "tracking.md", "checkpoints.md",
                     "corpora.md", "distributed.md", "sweeps-and-slurm.md", "compile.md", "vision.md")
    },
}  # fmt: skip
"""Pages whose every command a test runs as written, in order, on stand-ins (the inline Python on an export too): a
command of any kind needs no mark there, and a marked line is one that test does not run (listed with its kind)."""
MARK = re.compile(r"(?:^|\s)#.*\bnot checked: ([a-z]+)")
"""A line's mark: in its trailing comment, ``not checked: KIND``."""


def logical_lines(markdown: str) -> list[str]:
    """The lines of every bash block, a line continued with a trailing backslash joined to the next."""
    return [line for block in FENCE.findall(markdown) for line in block.replace("\\\n", " ").splitlines()]


def commands(markdown: str) -> list[list[str]]:
    """Each command of each line as argv (line_commands)."""
    return [argv for line in logical_lines(markdown) for argv in line_commands(line)]


def line_commands(line: str) -> list[list[str]]:
    """Each command of one line as argv: comments dropped, split at && ; & |, leading VAR=value assignments dropped."""
    found = []
    line = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line)  # $(scontrol ... | head -1): one word, as for the shell
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    current: list[str] = []
    for token in [*lexer, ";"]:
        if token in SEPARATORS:
            while current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", current[0]):
                current.pop(0)
            if current:
                found.append(current)
            current = []
        else:  # $HOME as the shell expands it (not Hydra's ${...} interpolations)
            current.append(os.path.expandvars(token) if "$" in token and "${" not in token else token)
    return found


def train_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``-m shardlab.train``, if argv starts a training run (python, the venv's, torchrun)."""
    if "shardlab.train" not in argv or argv[0] not in (*PYTHONS, "torchrun", ".venv/bin/torchrun"):
        return None
    at = argv.index("shardlab.train")
    return argv[at + 1 :] if argv[at - 1] == "-m" else None


def first_point(overrides: list[str]) -> list[str]:
    """A sweep's first point: each sweep override (a,b / range(...) / choice(...)) at its first value; an interval
    (an optimizing sweeper's) is left out, its key composed at its default."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    out = []
    for text, override in zip(overrides, parsed, strict=True):
        if not override.is_sweep_override():
            out.append(text)
        elif override.value_type != ValueType.INTERVAL_SWEEP:
            out.append(f"{text.split('=', 1)[0]}={next(override.sweep_string_iterator())}")
    return out


def group_choices(overrides: list[str]) -> list[str]:
    """Every value of a sweep over a config group (model=gpt_tiny,gpt_small), as ``group=option``: the command
    line's checks name an unknown option among them without composing each point."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    out = []
    for text, override in zip(overrides, parsed, strict=True):
        key = text.split("=", 1)[0]
        group = (CONF_DIR / key).is_dir()  # model, task, optimizer, ...: not seed
        if override.is_sweep_override() and group and override.value_type != ValueType.INTERVAL_SWEEP:
            out += [f"{key}={value}" for value in override.sweep_string_iterator()]
    return out


def check_train(args: list[str]) -> str | None:
    """Why this command line of shardlab.train would be refused before it starts (None: it composes)."""
    overrides = [a for i, a in enumerate(args) if "=" in a and not a.startswith("-") and args[i - 1 : i] != ["--cfg"]]
    overrides = with_home_expanded(overrides)  # as the CLI does before Hydra reads them (key=~/x)
    if any(o.split("=", 1)[0] == "user_dir" for o in overrides):
        return None  # a user_dir's plug-ins load once per process: tests/distributed/test_tutorial.py runs these
    try:
        point = first_point(overrides)
        check_command_line(job_overrides([*point, *group_choices(overrides)]))
        compose(config_name="config", overrides=with_user_dir(point), return_hydra_config=True)  # in problems' Hydra
    except (ShardlabError, Exception) as e:  # Hydra's composition errors have no common base but Exception
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}"
    return None


@functools.cache
def tool_help(module_name: str) -> str | None:
    """The --help text of a command's module (shardlab_commands.X), a benchmark (shardlab_bench.X) or tools/<X>.py
    (tools.X), read in this process (None where its main takes no argument list)."""
    module = importlib.import_module(module_name)
    if not inspect.signature(module.main).parameters:
        return None
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(["--help"])
    return out.getvalue()


def check_tool(argv: list[str]) -> str | None:
    """Why this command (shardlab-X, python -m shardlab_bench X or python tools/X.py) would be refused by its parser
    (None: it exists and takes every option)."""
    if is_command(argv):
        if argv[0] not in COMMANDS:
            return f"{argv[0]} is no command pyproject.toml installs (known: {', '.join(sorted(COMMANDS))})"
        name, args, text = argv[0], argv[1:], tool_help(f"shardlab_commands.{COMMANDS[argv[0]]}")
    elif is_benchmark(argv):
        if len(argv) < 4 or argv[3].startswith("-"):
            return None  # the bare runner lists the benchmarks
        if argv[3] not in benchmarks():
            return f"shardlab_bench has no benchmark {argv[3]} (known: {', '.join(benchmarks())})"
        name, args, text = f"shardlab_bench {argv[3]}", argv[4:], tool_help(f"shardlab_bench.{argv[3]}")
    else:
        if not (REPO / argv[1]).is_file():
            return f"{argv[1]} does not exist"
        name, args, text = argv[1], argv[2:], tool_help(f"tools.{Path(argv[1]).stem}")
    if text is None:
        return None
    unknown = [o for o in (a.split("=", 1)[0] for a in args if a.startswith("--")) if o not in text]
    return f"{name} has no option {', '.join(unknown)} (its --help)" if unknown else None


def is_benchmark(argv: list[str]) -> bool:
    """``python -m shardlab_bench ...``: the benchmarks' runner."""
    return argv[0] in PYTHONS and argv[1:3] == ["-m", "shardlab_bench"]


def is_command(argv: list[str]) -> bool:
    """A user command on the PATH (shardlab-export, ...; the venv's too), as the docs write them."""
    return Path(argv[0]).name.startswith("shardlab-")


def problems(markdown: str, run_as_written: bool = False) -> tuple[list[str], list[str]]:
    """(the commands that fail their check and the marks that are wrong, with why; the commands marked not checked).
    ``run_as_written``: a page of RUN_AS_WRITTEN, whose every command counts as checked."""
    failed, skipped = [], []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):  # once: each compose is then cheap
        for line in logical_lines(markdown):
            mark = MARK.search(line)
            kind = mark.group(1) if mark else None
            line_skipped = []
            for argv in line_commands(line):
                shown = " ".join(argv)
                if run_as_written and kind is not None:
                    line_skipped.append(shown)  # its walk does not run this line
                if not checked_kind(argv):
                    if run_as_written:
                        continue  # run by its RUN_AS_WRITTEN test
                    line_skipped.append(shown)
                    if kind is None:
                        failed.append(f"{shown}: neither checked by this test nor marked `# not checked: KIND`")
                elif why := why_refused(argv):
                    failed.append(f"{shown}: {why}")
            if kind is not None and kind not in NOT_CHECKED:
                failed.append(f"{line.strip()}: marked not checked as {kind!r}, a kind NOT_CHECKED does not list")
            elif kind is not None and not line_skipped:
                failed.append(f"{line.strip()}: marked not checked ({kind}), but each of its commands is checked")
            elif kind is not None:
                skipped += [f"{shown}   [{kind}]" for shown in line_skipped]
    return failed, skipped


def checked_kind(argv: list[str]) -> bool:
    """Whether this test checks commands like argv: a training run, a user command, a benchmark or a tools/ script run
    by Python."""
    tool = argv[0] in PYTHONS and len(argv) > 1 and argv[1].startswith("tools/") and argv[1].endswith(".py")
    return train_args(argv) is not None or tool or is_command(argv) or is_benchmark(argv)


def why_refused(argv: list[str]) -> str | None:
    """What fails the check of a training run, a user command, a benchmark or a tools/ script; None if it passes."""
    if (args := train_args(argv)) is not None:
        return check_train(args)
    return check_tool(argv)


@functools.cache
def page_problems(page: Path) -> tuple[list[str], list[str]]:
    """problems() of a docs page, read once per process: the page's own test and the count of the commands not
    checked read the same result (the pages and the configs they compose do not change during the suite). Called
    from the tests only, in the repository's root (in_the_repository)."""
    return problems(page.read_text(), page.name in RUN_AS_WRITTEN)


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    monkeypatch.chdir(REPO)  # the commands are written for the repository's root


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_in_the_docs_composes_or_is_marked_not_checked(page):
    failed, _ = page_problems(page)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("python -m shardlab.train optimizer.lrr=1e-3", "Could not override 'optimizer.lrr'"),
        ("python -m shardlab.train -m model=gpt_tiny,gpt_smal", "gpt_smal"),
        ("python -m shardlab.train distributed.world_size=two", "distributed.world_size"),
        ("python -m shardlab.train -m hydra/launcher=slurm hydra.launcher.nodez=2", "nodez"),
        ("shardlab-evaluate runs/x --no-such-option 3", "shardlab-evaluate has no option --no-such-option"),
        ("shardlab-evalute runs/x", "shardlab-evalute is no command pyproject.toml installs"),
        ("python -m shardlab_bench tables --no-such-option", "shardlab_bench tables has no option --no-such-option"),
        ("python -m shardlab_bench no_such_bench --out x", "shardlab_bench has no benchmark no_such_bench"),
        ("python tools/no_such_tool.py x", "tools/no_such_tool.py does not exist"),
        ("wget https://example.org/data.tar", "wget https://example.org/data.tar: neither checked by this test nor"),
        ("wget https://example.org/data.tar   # not checked: later", "a kind NOT_CHECKED does not list"),
        ("python -m shardlab.train seed=2   # not checked: install", "but each of its commands is checked"),
        ("pip install x && python -m shardlab.train seed=two   # not checked: install", "seed"),
    ],
)
def test_a_planted_broken_command_is_caught(line, why):
    failed, _ = problems(f"Try:\n\n```bash\npython -m shardlab.train --help   # fine\n{line}\n```\n")
    assert len(failed) == 1 and why in failed[0], failed


def test_a_page_run_as_written_needs_no_mark_and_keeps_its_checks():
    run = "```bash\npython -c 'print(1)'\npython -m shardlab.train seed=2\n```\n"
    assert problems(run, run_as_written=True) == ([], [])
    assert "neither checked by this test nor marked" in problems(run)[0][0]
    marked = "```bash\npython -c 'print(1)'   # not checked: download\n```\n"
    assert problems(marked, run_as_written=True) == ([], ["python -c print(1)   [download]"])  # its walk skips it
    wrong = "```bash\npython -c 'print(1)'   # not checked: later\n```\n"
    assert "a kind NOT_CHECKED does not list" in problems(wrong, run_as_written=True)[0][0]
    broken = "```bash\npython -m shardlab.train optimizer.lrr=1e-3\n```\n"
    assert "optimizer.lrr" in problems(broken, run_as_written=True)[0][0]  # composed as on every page
    pages = {page.name for page in PAGES}
    assert all(page in pages and (REPO / test).is_file() for page, test in RUN_AS_WRITTEN.items())


def test_lines_split_as_the_shell_splits_them():
    markdown = (
        "```bash\n"
        "tools/x.sh up && source env.sh   # a comment\n"
        "HF_HUB_OFFLINE=1 python -m shardlab.train \\\n    seed=2 &\n"
        "torchrun --nproc_per_node=2 -m shardlab.train data.path='/data/*.parquet'\n"
        "```\n"
    )
    assert commands(markdown) == [
        ["tools/x.sh", "up"], ["source", "env.sh"], ["python", "-m", "shardlab.train", "seed=2"],
        ["torchrun", "--nproc_per_node=2", "-m", "shardlab.train", "data.path=/data/*.parquet"],
    ]  # fmt: skip
    sweep = ["optimizer.lr=1e-3,3e-3", "seed=range(1,4)", "model=gpt_tiny,gpt_small", "optimizer.eps=interval(0,1)"]
    assert first_point(sweep) == ["optimizer.lr=0.001", "seed=1", "model=gpt_tiny"]
    assert group_choices(sweep) == ["model=gpt_tiny", "model=gpt_small"]


def test_the_commands_not_checked_are_few_and_each_marked_with_a_listed_kind(capsys):
    skipped = [command for page in PAGES for command in page_problems(page)[1]]
    with capsys.disabled():  # the list, for a reader of the suite's output (-s)
        print(f"\n{len(skipped)} doc commands not checked (NOT_CHECKED says why):", *skipped, sep="\n  ")
    # 46 on 36 lines: 17 installs, shells and the suite's own commands, 10 Slurm beyond the test cluster, 9 GPU (the
    # ImageNet recipes, context parallelism), 5 downloads (lm-eval, torchvision), 3 benchmarks, 2 tracking services
    assert 0 < len(skipped) <= 46
    marked = {m.group(1) for page in PAGES for line in logical_lines(page.read_text()) if (m := MARK.search(line))}
    assert set(NOT_CHECKED) <= marked, f"kinds NOT_CHECKED lists and no page marks: {set(NOT_CHECKED) - marked}"


def test_a_mark_is_read_from_the_line_comment_only():
    assert MARK.search("pip install -e .   # not checked: install").group(1) == "install"
    assert MARK.search("source x   # first, each shell (not checked: shell)").group(1) == "shell"
    assert MARK.search("python -m shardlab.train run.note='not checked: install'") is None


def run_folder(args: list[str]) -> str:
    """The folder a training run's arguments name: hydra.run.dir, else runs/<task>/<run name> (conf/config.yaml)."""
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    task = next((o.split("=", 1)[1] for o in overrides if o.startswith("task=")), "lm")
    return given[0] if given else f"runs/{task}/{run_name([o for o in overrides if not o.startswith('hydra')])}"


def test_after_the_quickstart_each_everyday_command_trains_a_run_of_its_own():
    """Issue #51: straight after the quickstart (runs/lm/default, complete at the LM's last step), a README everyday
    command that trains names another folder than the quickstart's, and than any other of them: one that named the
    same would only resume it, and find it complete. The step folders the tools read are the quickstart's last."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Everyday commands") :]
    section = section[: section.index("\n## ", 1)]
    folders = {}
    for argv in commands(section):
        args = train_args(argv)
        if args is not None and not {"-m", "--help", "dry_run=true"} & set(args):
            folders[shlex.join(argv)] = run_folder(args)
    assert len(folders) >= 8, folders
    assert "runs/lm/default" not in folders.values(), folders
    assert len(set(folders.values())) == len(folders), folders
    last = yaml.safe_load((CONF_DIR / "task" / "lm.yaml").read_text())["optimization"]["max_steps"]
    steps = re.findall(r"runs/lm/default/checkpoints/step_(\d+)", readme)
    assert steps and {int(s) for s in steps} == {last}, steps
