#!/usr/bin/env bash
# Issue 50, must-show 1: shardlab as a user gets it from `pip install`, run where no clone is.
#
# Builds a wheel from the clone's tracked files, installs it into a fresh venv outside the clone, and from an empty
# folder runs: the default training (2 steps), task=swav (1 step), model.pretrained= a Hugging Face folder made by
# transformers, a user_dir's own task, a sweep, and each user command's --help and one real use of it; then asserts
# that only shardlab's own top-level names were installed (no tasks, conf or tools). Each step prints its name; the
# first that fails stops the script with its output and a non-zero exit (CI runs it after the suite: .ci/run).
#
#   bash tools/check_wheel.sh            # PYTHON=python3.11 to build and install with another interpreter
#   KEEP=1 bash tools/check_wheel.sh     # keep the work folder (printed) for a look afterwards
#
# A few minutes, most of it pip installing torch into the fresh venv (from pip's cache when it has it).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardlab-wheel.XXXXXX")
case "$WORK/" in "$REPO"/*) echo "check_wheel: $WORK lies inside the clone; set TMPDIR to a folder outside it" >&2; exit 2 ;; esac
if [ "${KEEP:-0}" = 1 ]; then echo "work folder: $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
step() { printf '\n== %s\n' "$*"; }
pip_quietly() { "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }  # pip's exit status (pipefail)
V="$WORK/venv/bin"

step "a fresh venv outside the clone"
"$PYTHON" -m venv "$WORK/venv"

step "wheel: built by the venv's pip from a copy of the clone's tracked files (setuptools writes build/ into its tree)"
mkdir "$WORK/src" "$WORK/dist"
(cd "$REPO" && git ls-files -z | xargs -0 cp --parents -t "$WORK/src")
pip_quietly "$V/pip" wheel --no-deps -q -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/shardlab-*.whl)
echo "$WHEEL"

step "the wheel installed, with its hf (transformers: a Hugging Face folder) and plot (matplotlib) extras"
pip_quietly "$V/pip" install -q "$WHEEL[hf,plot]"

# Nothing of the clone from here on: an empty folder, no PYTHONPATH, no user site.
mkdir "$WORK/empty" && cd "$WORK/empty"
unset PYTHONPATH
export PYTHONNOUSERSITE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" HF_HUB_OFFLINE=1
SITE=$("$V/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

step "installed: shardlab's own top-level names only (no tasks, conf, tools), each imported from the venv"
"$V/python" - "$SITE" "$REPO" <<'EOF'
import importlib, pathlib, sys
site, repo = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
record = next(site.glob("shardlab-*.dist-info")) / "RECORD"
tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
tops = {t for t in tops if not t.endswith(".dist-info") and t != ".."}  # ../../bin/shardlab-*: the commands
assert tops == {"shardlab", "shardlab_tasks", "shardlab_commands", "hydra_plugins"}, sorted(tops)
for generic in ("tasks", "conf", "tools"):
    assert not (site / generic).exists() and not (site / f"{generic}.py").exists(), f"{generic} in {site}"
    try:
        importlib.import_module(generic)
    except ModuleNotFoundError:
        continue
    raise AssertionError(f"a top-level module named {generic} imports")
for name in ("shardlab", "shardlab_tasks", "shardlab_commands"):
    where = pathlib.Path(importlib.import_module(name).__file__).resolve()
    assert where.is_relative_to(site.resolve()) and not where.is_relative_to(repo), where
print("top-level:", ", ".join(sorted(tops)))
EOF

RUN_ARGS=(data.cache_dir="$WORK/cache" validation.num_batches=2)
step "python -m shardlab.train: the default training, 2 steps"
"$V/python" -m shardlab.train optimization.max_steps=2 checkpoint.interval_steps=2 "${RUN_ARGS[@]}"
RUN=$(dirname "$(dirname "$(ls -d runs/lm/*/checkpoints/step_00000002)")")
STEP="$RUN/checkpoints/step_00000002"

step "python -m shardlab.train task=swav: 1 step"
"$V/python" -m shardlab.train task=swav optimization.max_steps=1 validation.num_batches=1

step "model.pretrained=: a Hugging Face Llama folder made by transformers, 1 step"
mkdir "$WORK/helpers" && cp "$REPO/tests/hf_folders.py" "$WORK/helpers/"
PYTHONPATH="$WORK/helpers" "$V/python" -c "from pathlib import Path; from hf_folders import make_folder; make_folder('llama3', Path('$WORK/hf_llama3'))"
"$V/python" -m shardlab.train model.pretrained="$WORK/hf_llama3" data.seq_len=32 optimization.max_steps=1 "${RUN_ARGS[@]}"

step "user_dir=: a folder's own task and conf/ on the installed shardlab (the tutorial's spirals), 1 step"
cp -r "$REPO/examples/my_research" "$WORK/my_research"
"$V/python" -m shardlab.train user_dir="$WORK/my_research" task=spirals optimization.max_steps=1

step "python -m shardlab.train -m: a sweep of 2 points, 1 step each"
"$V/python" -m shardlab.train -m seed=1,2 optimization.max_steps=1 "${RUN_ARGS[@]}"
SWEEP=$(ls -d multirun/lm/*/ | head -1)

step "each command's --help, from the PATH of the venv"
for command in shardlab-export shardlab-generate shardlab-evaluate shardlab-preprocess shardlab-consolidate \
    shardlab-plot shardlab-sweep-summary; do
    "$V/$command" --help | head -1 | grep -q "^usage: $command " || { echo "$command --help failed" >&2; exit 1; }
    echo "$command --help: ok"
done

step "shardlab-consolidate, shardlab-generate"
"$V/shardlab-consolidate" "$STEP" --out model.safetensors
"$V/shardlab-generate" model.safetensors --max-new-tokens 16 | cat -v  # sampled bytes, shown printable

step "shardlab-export: the checkpoint as a Hugging Face folder transformers loads"
"$V/shardlab-export" "$STEP" --out hf-export
"$V/python" -c "import transformers; m = transformers.AutoModelForCausalLM.from_pretrained('hf-export'); print(type(m).__name__, sum(p.numel() for p in m.parameters()), 'parameters')"

step "shardlab-preprocess: a folder of text (4 files of Python's own source, ~40 KB) into a corpus cache"
mkdir corpus
"$V/python" -c "
import pathlib, shutil
for name in ('this', 'string', 'textwrap', 'shlex'):
    shutil.copy(pathlib.Path(__import__(name).__file__), f'corpus/{name}.txt')" >/dev/null
"$V/shardlab-preprocess" corpus --cache-dir "$WORK/cache2"

step "shardlab-evaluate: the checkpoint's perplexity on that corpus (its cache, from the step before)"
"$V/shardlab-evaluate" "$STEP" --perplexity --split all data.path=corpus data.cache_dir="$WORK/cache2"

step "shardlab-plot, shardlab-sweep-summary"
"$V/shardlab-plot" "$RUN" --out curves.png && test -s curves.png
"$V/shardlab-sweep-summary" "$SWEEP" --plot sweep.png && test -s sweep.png

printf '\ncheck_wheel: every step passed (%s)\n' "$(basename "$WHEEL")"
