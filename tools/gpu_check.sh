#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (about 5 minutes on one H100/H200):
#   1. the CUDA test set (nccl parity at world size 1, pinned CPU offload, fp16 scaler, torch SyncBatchNorm);
#   2. bf16 throughput and MFU of the ~125M LM under fully_sharded (tools/bench.py, JSON into $OUT or ./).
# Usage: bash tools/gpu_check.sh    (from the repository root, with the project installed)
set -uo pipefail
out="${OUT:-.}"
py="${PYTHON:-python}"
status=0
"$py" -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" || status=1
"$py" tools/bench.py model=gpt_125m data.seq_len=1024 optimization.batch_size=16 distributed.backend=fully_sharded \
    distributed.precision=bf16 --steps 20 --warmup 5 --out "$out/bench_gpt125m_bf16.json" 2>&1 | tail -20 || status=1
exit $status
