"""The README is a door, not the house: short, linking every docs/ page; and the docs stay true of the tree: no link
leads nowhere, no path written in backticks names a file that is not there, the README's map names every package,
module and test folder, and docs/configuration.md lists every config group option in shardlab/conf/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardlab.config import CONF_DIR

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        text = re.sub(r"[`*]", "", heading).strip().lower()
        found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


def test_the_readme_is_at_most_250_lines_and_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {m for m in LINK.findall(readme) if m.startswith("docs/")}
    missing = [p.name for p in DOCS if not any(link.split("#")[0] == f"docs/{p.name}" for link in linked)]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    broken = []
    for page in [REPO / "README.md", *DOCS]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


# ---- paths written in backticks --------------------------------------------------------------------------------------
ROOTS = ("shardlab", "shardlab_tasks", "shardlab_commands", "shardlab_bench", "tools", "tests", "docs", "examples")
ROOTS += ("hydra_plugins",)
PACKAGES = tuple(sorted(p.name for p in (REPO / "shardlab").iterdir() if (p / "__init__.py").is_file()))
"""shardlab's packages: `memory/plan.py` in the docs is shardlab/memory/plan.py."""
SOURCE = re.compile(r"^[\w-]+\.(?:py|yaml|sh|toml|md)$")
"""A bare file name the checker places: a source, config, script or page (not an output such as train.log)."""
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")


def tokens(span: str) -> list[str]:
    """The words of a backticked span that could be paths: split at spaces, commas, brackets, quotes and `=`; a
    trailing `:`/`.`/`;`, a `:line` and a `::test` or `#anchor` suffix dropped."""
    out = []
    for word in re.split(r"[\s,()\[\]'\"=|]+", span):
        word = re.sub(r"(::.*|#.*|:\d[\d-]*)$", "", word).rstrip(":.;")
        if word:
            out.append(word)
    return out


def rooted(word: str) -> str | None:
    """The repository path ``word`` names, if it names one: it begins with a top-level folder
    (``shardlab_bench/train.py``) or with a package of shardlab/ (``memory/plan.py``, read as
    shardlab/memory/plan.py)."""
    head = word.split("/", 1)[0]
    if "/" not in word or not re.fullmatch(r"[\w.<>*-]+(/[\w.<>*-]*)*", word):
        return None
    if head in ROOTS or head == "conf":  # conf/: a user_dir's (the tutorial's, under examples/); shardlab/conf/ is ours
        return word
    return f"shardlab/{word}" if head in PACKAGES else None


def exists(path: str) -> bool:
    """``path`` is in the repository (``<name>`` and ``*`` match any name), or in a user_dir under examples/ (the
    tutorial's folder has a conf/ of its own)."""
    pattern = re.sub(r"<[^>/]*>", "*", path).rstrip("/")
    return any(any(base.glob(pattern)) for base in [REPO, *(REPO / "examples").glob("*/")])


def map_entries(block: str) -> list[tuple[str, str]]:
    """(path, description) of each line of a map of the code (a fenced block whose first line is a top-level folder,
    as the README's). A line's name column (up to two spaces) holds one or more names (``a.py, b.py``), in the folder
    of the nearest less indented line above; a line starting at the first line's description column continues the
    description above."""
    lines = [line for line in block.splitlines() if line.strip()]
    first = re.match(r"(\S+/)( +)\S", lines[0])
    description_at = first.end() - 1 if first else 10**6
    stack: list[tuple[int, str]] = []  # (indent, folder) of the open folders
    entries: list[list[str]] = []
    for line in lines:
        text = re.sub(r"^[\s│├└─]*", lambda m: " " * len(m[0]), line)  # a tree's drawing is indentation
        indent = len(text) - len(text.lstrip())
        if indent >= description_at and entries:
            entries[-1][1] += " " + text.strip()
            continue
        names, _, description = text.strip().partition("  ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        entries += [[parent + name, description.strip()] for name in re.split(r",\s*", names)]
        if names.endswith("/"):
            stack.append((indent, parent + names))
    return [(path, description) for path, description in entries]


def map_paths(block: str) -> list[str]:
    """The paths a map of the code places its names at: each entry, and each source file name in an entry's
    description (``registry/ ... (user_dir.py: ...)``), in that entry's folder (a file entry's: the one it is in)."""
    found = []
    for path, description in map_entries(block):
        folder = path if path.endswith("/") else path.rpartition("/")[0] + "/" * ("/" in path)
        found += [path, *(folder + w for w in tokens(description) if SOURCE.match(w))]
    return found


def unnamed_modules(package: Path, name: str, entries: dict[str, str], rooms: bool) -> list[str]:
    """The modules of ``package`` (drawn as ``name``) its description does not name, and with ``rooms`` (a task
    plug-in's: shardlab_tasks/lm/corpus/) its sub-packages without a line of their own or with modules their line does
    not name (shardlab/'s packages name theirs in their description: checkpoint/'s readers/)."""
    words = set(re.findall(r"\w+", entries[name]))
    missing = [f"{name}{m.name}" for m in sorted(package.glob("*.py")) if m.stem not in words | {"__init__"}]
    for sub in sorted(p for p in package.iterdir() if rooms and (p / "__init__.py").is_file()):
        inner = f"{name}{sub.name}/"
        missing += unnamed_modules(sub, inner, entries, rooms) if inner in entries else [inner]
    return missing


def map_omissions(block: str, repo: Path = REPO) -> list[str]:
    """What of the tree a map of the code leaves out: a top-level folder; a module or package of shardlab/ or a
    package of shardlab_tasks/ without its own line; a module of such a package not named (by its stem) in the package's
    description; a module of shardlab_commands/ not named in its description; a folder of tests/ not named (``unit/``)
    in tests/' description. tools/ and shardlab_bench/ are described by kind."""
    entries = dict(map_entries(block))
    missing = [f"{r}/" for r in ROOTS if not any(p.startswith(f"{r}/") for p in entries)]
    for root in ("shardlab", "shardlab_tasks"):
        for child in sorted((repo / root).iterdir()):
            is_package = (child / "__init__.py").is_file()
            if not is_package and (child.suffix != ".py" or child.name == "__init__.py"):
                continue
            name = f"{root}/{child.name}" + "/" * is_package
            if name not in entries:
                missing.append(name)
            elif is_package:
                missing += unnamed_modules(child, name, entries, rooms=root == "shardlab_tasks")
    commands = set(re.findall(r"\w+", entries.get("shardlab_commands/", "")))
    missing += [f"shardlab_commands/{m.name}" for m in sorted((repo / "shardlab_commands").glob("*.py"))
                if m.stem not in commands | {"__init__"}]  # fmt: skip
    tests = set(re.findall(r"(\w+)/", entries.get("tests/", "")))
    missing += [f"tests/{d.name}/" for d in sorted((repo / "tests").iterdir()) if d.is_dir() and d.name not in tests]
    return [m for m in missing if "__pycache__" not in m]


def placed(prose: str) -> list[str]:
    """Paths of the backticked bare file names that a paragraph places in a folder: those after a backticked folder
    (`shardlab/checkpoint/`: `manager.py`, `layout.py`, ...), up to the next backticked path, and one joined to a
    backticked file by a comma, "and" or "or" (`conf/hydra/launcher/slurm.yaml` and `local.yaml`) in that file's
    folder."""
    found = []
    for paragraph in re.split(r"\n\s*\n", prose):
        folder, previous_end, sibling_of = None, 0, None
        for match in SPAN.finditer(paragraph):
            words = tokens(match[1])
            between = paragraph[previous_end : match.start()]
            previous_end = match.end()
            paths = [p for w in words if (p := rooted(w))]
            if paths:
                folder = paths[-1] if paths[-1].endswith("/") else None
                sibling_of = paths[-1].rsplit("/", 1)[0] + "/" if len(words) == 1 and not folder else None
                continue
            if len(words) != 1 or not SOURCE.match(words[0]):
                sibling_of = None
                continue
            if sibling_of and re.fullmatch(r"\s*(,|,?\s*and|,?\s*or)\s*", between):
                found.append(sibling_of + words[0])
            elif folder:
                found.append(folder + words[0])
    return found


def stale_paths(markdown: str) -> list[str]:
    """Every path ``markdown`` writes in backticks that is not in the repository.

    The rule: (1) in inline code and in fenced blocks, a word that begins with a top-level folder (shardlab/,
    shardlab_tasks/, shardlab_bench/, tools/, tests/, docs/, examples/, hydra_plugins/) is a path from the repository
    root, one that begins with conf/ a user_dir's (shardlab's own is shardlab/conf/), and one that begins with a package
    of shardlab/ (``memory/plan.py``) a path in shardlab/; (2) a bare file name (``name.py``, ``.yaml``, ``.sh``,
    ``.toml``, ``.md``) is checked where the text places it: after a backticked folder in its paragraph, or listed
    beside a backticked file (``placed``), and in a map of the code, in the folder it is drawn under (``map_paths``).
    ``<name>`` and ``*`` stand for any name. A bare name the text places nowhere (``train.py`` alone) and paths outside
    the repository (``/tmp/...``, ``runs/...``, another project's) are not checked."""
    prose = FENCE.sub("\n\n", markdown)
    words = [w for span in SPAN.findall(prose) for w in tokens(span)]
    found = [p for w in words if (p := rooted(w))] + placed(prose)
    for block in FENCE.findall(markdown):
        words = tokens(block)
        found += [p for w in words if (p := rooted(w))]
        if re.match(rf"(?:{'|'.join(ROOTS)})/\S*( |$)", block.splitlines()[0] if block.strip() else ""):
            found += map_paths(block)
    return list(dict.fromkeys(p for p in found if not exists(p)))


def test_every_path_in_backticks_in_the_readme_and_the_docs_exists():
    stale = [
        f"{page.relative_to(REPO)}: {path}"
        for page in [REPO / "README.md", *DOCS]
        for path in stale_paths(page.read_text())
    ]
    assert not stale, f"paths the docs name that are not in the repository: {stale}"


def test_the_readmes_map_names_every_package_module_and_test_folder():
    block = next(b for b in FENCE.findall((REPO / "README.md").read_text()) if b.startswith("shardlab/"))
    assert map_omissions(block) == [], "README.md's map of the code leaves these out: add them where they live"


PLANTED = [
    ("`tools/slurm_cluster.sh`", "`tools/slurm_clusters.sh`", "tools/slurm_clusters.sh"),  # a rooted path in prose
    ("pretrained=tests/data/llama3_1_8b ", "pretrained=tests/data/llama3_1_9b ", "tests/data/llama3_1_9b"),  # fenced
    ("`memory/plan.py`", "`memory/planner.py`", "shardlab/memory/planner.py"),  # read in shardlab/
    ("  task.py                 the Task", "  tasks.py                the Task", "shardlab/tasks.py"),  # a map's name
    ("(user_dir.py: its", "(user_dirs.py: its", "shardlab/registry/user_dirs.py"),  # a name in a map's description
    ("`tests/faults/test_fault_matrix.py`", "`tests/faults/test_matrix.py`", "tests/faults/test_matrix.py"),
]


@pytest.mark.parametrize(("old", "new", "stale"), PLANTED)
def test_a_planted_stale_path_in_the_readme_is_caught(old, new, stale):
    readme = (REPO / "README.md").read_text()
    assert old in readme and stale_paths(readme) == []
    assert stale_paths(readme.replace(old, new, 1)) == [stale]


@pytest.mark.parametrize(
    ("markdown", "stale"),
    [
        ("The code: `shardlab/checkpoint/` (`manager.py`, `managers.py`).", ["shardlab/checkpoint/managers.py"]),
        ("Presets: `shardlab/conf/hydra/launcher/slurm.yaml` and `remote.yaml`.",
         ["shardlab/conf/hydra/launcher/remote.yaml"]),
        ("Its `conf/model/mine.yaml`", ["conf/model/mine.yaml"]),  # a user_dir's conf/: the tutorial's has none
        ("`shardlab_tasks/<name>/task.py` and `shardlab_tasks/<name>/tasks.py`", ["shardlab_tasks/<name>/tasks.py"]),
        ("`docs/bench/autotune_*.json` and `docs/bench/autotuned_*.json`", ["docs/bench/autotuned_*.json"]),
        ("`tests/unit/test_docs.py::test_x:12` and `tests/unit/test_doc.py:3`", ["tests/unit/test_doc.py"]),
        ("```text\nexamples/my_research/\n├── spirals.py\n└── conf/\n    └── task/spiral.yaml\n```",
         ["examples/my_research/conf/task/spiral.yaml"]),
        ("`train.py` alone, `/tmp/tools/x.py`, `runs/lm/default/`, `torchtitan/train.py`", []),
    ],
)  # fmt: skip
def test_the_path_rule(markdown, stale):
    assert stale_paths(markdown) == stale


def test_a_module_the_map_leaves_out_is_caught(tmp_path):
    block = next(b for b in FENCE.findall((REPO / "README.md").read_text()) if b.startswith("shardlab/"))
    assert map_omissions(block.replace("policy (when to save), ", "")) == ["shardlab/checkpoint/policy.py"]
    assert map_omissions(block.replace("faults/ (fault matrix), ", "")) == ["tests/faults/"]
    assert map_omissions(block.replace(", moe_hub, export_hf", ", export_hf")) == ["shardlab_tasks/lm/hf/moe_hub.py"]
    lm_hf = re.search(r"\n    hf/ .*", block)[0]
    assert map_omissions(block.replace(lm_hf, "")) == ["shardlab_tasks/lm/hf/"]
    assert map_omissions(
        block.replace("  errors.py               ConfigError", "  error.py                ConfigError")
    ) == ["shardlab/errors.py"]


# ---- docs/configuration.md's config groups ---------------------------------------------------------------------------
def group_rows(markdown: str) -> dict[str, tuple[set[str], set[str]]]:
    """The "Config groups" table: group -> (the options it lists, the schema classes it names), as written in
    backticks (an option is a lower-case name, a schema a dotted path)."""
    section = markdown.split("## Config groups", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and (group := re.fullmatch(r"`([\w/]+)`", cells[0])):
            options = {s for s in SPAN.findall(cells[1]) if re.fullmatch(r"[a-z0-9_]+", s)}
            rows[group[1]] = (options, {s for s in SPAN.findall(cells[2]) if "." in s})
    return rows


def option_schema(group: str, option: Path) -> str | None:
    """The schema class of ``option`` (a conf/ YAML file), as module.Class: the one its ``/schema/...`` default
    selects, else its section's type in the run's schema (TrainConfig's ``task``: TaskConfig); None for a group that
    is no typed section (experiment, hydra/launcher, or a section typed Any)."""
    import typing

    import yaml
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from shardlab.config import TrainConfig

    for default in (yaml.safe_load(option.read_text()) or {}).get("defaults", []):
        if isinstance(default, str) and default.startswith("/schema/"):
            kind = OmegaConf.get_type(ConfigStore.instance().load(default[1:].split("@")[0] + ".yaml").node)
            return f"{kind.__module__}.{kind.__qualname__}"
    kind = typing.get_type_hints(TrainConfig).get(group)
    return f"{kind.__module__}.{kind.__qualname__}" if isinstance(kind, type) else None


def group_table_problems(markdown: str, conf: Path = CONF_DIR) -> list[str]:
    """How the "Config groups" table differs from ``conf``: a group (a folder of option files, hydra/launcher too)
    without a row or a row without a group, an option missing or listed that has no file, a schema its options use
    that the row does not name, or one it names that none uses."""
    groups: dict[str, dict[str, Path]] = {}
    for option in sorted(conf.rglob("*.yaml")):
        if option.parent != conf:
            groups.setdefault(option.parent.relative_to(conf).as_posix(), {})[option.stem] = option
    rows = group_rows(markdown)
    problems = [f"group {g}: no row" for g in groups if g not in rows]
    problems += [f"row {g}: no folder conf/{g}/" for g in rows if g not in groups]
    for group, options in groups.items():
        if group not in rows:
            continue
        listed, schemas = rows[group]
        used = {s for o in options.values() if (s := option_schema(group, o))}
        problems += [f"{group}: {o} not listed" for o in sorted(options.keys() - listed)]
        problems += [f"{group}: {o} listed, no conf/{group}/{o}.yaml" for o in sorted(listed - options.keys())]
        problems += [f"{group}: schema {s} not named" for s in sorted(used - schemas)]
        problems += [f"{group}: schema {s} named, used by no option" for s in sorted(schemas - used)]
    return problems


def test_the_config_groups_table_lists_every_option_and_schema_in_conf():
    assert group_table_problems((REPO / "docs" / "configuration.md").read_text()) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        (", `llama3_405b`", "", "model: llama3_405b not listed"),
        ("`lars` (SwAV's", "`larc` (SwAV's", "optimizer: lars not listed"),
        (
            ", `shardlab_tasks.self_supervised.config.DINOConfig`",
            "",
            "task: schema shardlab_tasks.self_supervised.config.DINOConfig",
        ),
        ("| `hydra/launcher` |", "| `launcher` |", "group hydra/launcher: no row"),
    ],
)
def test_a_config_groups_table_that_falls_behind_conf_is_caught(old, new, problem):
    page = (REPO / "docs" / "configuration.md").read_text()
    assert old in page
    assert problem in group_table_problems(page.replace(old, new, 1))[0]


def test_a_new_option_file_is_caught(tmp_path):
    import shutil

    shutil.copytree(CONF_DIR, tmp_path / "conf")
    (tmp_path / "conf" / "optimizer" / "adafactor.yaml").write_text("defaults:\n  - /schema/optimizer/adamw@_here_\n")
    page = (REPO / "docs" / "configuration.md").read_text()
    assert group_table_problems(page, tmp_path / "conf") == ["optimizer: adafactor not listed"]
