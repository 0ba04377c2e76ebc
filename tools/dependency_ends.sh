#!/usr/bin/env bash
# The tests at either end of pyproject.toml's declared dependency ranges, each in a fresh virtual environment built
# from this checkout (editable, with the test extra, as CI installs it):
#   bash tools/dependency_ends.sh lowest  [PYTEST ARGS...]   the framework's dependencies at their floors
#   bash tools/dependency_ends.sh highest [PYTEST ARGS...]   the newest releases the ranges allow (no pre-releases)
# PYTEST ARGS default to the default suite; e.g. `tests/unit tests/distributed/test_sweeps.py -m "e2e or not e2e"`.
# VENV=DIR picks the environment (default: $TMPDIR/shardlab-lowest or -highest, rebuilt each time; KEEP=1 reuses it).
#
# lowest pins, from pyproject.toml itself (so the floors tested are the floors declared): torch, torchvision,
# hydra-core, omegaconf, submitit, hydra-submitit-launcher, tensorboard, numpy, tqdm, tokenizers and safetensors at
# their `>=` floors, and the optuna extra's hydra-optuna-sweeper and optuna at theirs (the sweeper release that matches
# hydra-core 1.3.2). The test extra's own packages (transformers, datasets, lm-eval, ...) are left to the resolver.
# Before the tests it starts one run and checks its output for warnings (no deprecation lines at start), and prints
# the versions it tested.
set -euo pipefail
cd "$(dirname "$0")/.."
end=${1:-}
case "$end" in
lowest | highest) shift ;;
*)
    echo "usage: bash tools/dependency_ends.sh lowest|highest [PYTEST ARGS...]" >&2
    exit 2
    ;;
esac
venv=${VENV:-${TMPDIR:-/tmp}/shardlab-$end}
python=${PYTHON:-python3}

if [[ "${KEEP:-0}" != 1 || ! -x "$venv/bin/python" ]]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    constraints=()
    if [[ "$end" == lowest ]]; then
        # The floors, read from pyproject.toml (tomllib: Python 3.11+, which the tool needs for this step).
        "$venv/bin/python" - >"$venv/lowest.txt" <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["optuna"]:
    name, floor = re.match(r"([A-Za-z0-9_.\-]+)(?:\[.*\])?\s*>=\s*([^,;\s]+)", requirement).groups()
    print(f"{name}=={floor}")
EOF
        constraints=(-c "$venv/lowest.txt")
        echo "lowest: $(tr '\n' ' ' <"$venv/lowest.txt")"
    fi
    "$venv/bin/pip" install -q "${constraints[@]}" -e '.[test,optuna]'
fi

"$venv/bin/python" - <<'EOF'
from importlib.metadata import version

names = "torch torchvision hydra-core omegaconf submitit hydra-submitit-launcher hydra-optuna-sweeper optuna tensorboard"
names += " numpy tqdm tokenizers safetensors transformers lm-eval"
print("versions: " + ", ".join(f"{n} {version(n)}" for n in names.split()))
EOF

# A run starts without a warning line (Hydra's or OmegaConf's deprecations would show here).
start=$(mktemp -d)
(cd "$start" && OMP_NUM_THREADS=1 "$venv/bin/python" -m shardlab.train model.num_layers=1 model.dim=32 \
    model.num_heads=2 data.seq_len=32 model.max_seq_len=32 data.max_corpus_mb=1 optimization.max_steps=2 \
    lr_scheduler.warmup_steps=1 \
    validation.interval_steps=0 logging.progress_bar=false "data.cache_dir=$start/cache" >out.txt 2>err.txt) || {
    cat "$start/err.txt" >&2
    exit 1
}
if grep -iE "warn|deprecat" "$start/out.txt" "$start/err.txt"; then
    echo "a plain run printed the warnings above" >&2
    exit 1
fi
echo "a plain run started and finished without warnings"
rm -rf "$start"

"$venv/bin/python" -m pytest "$@"
