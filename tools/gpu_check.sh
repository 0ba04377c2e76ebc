#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine; results as JSON in $OUT (or ./): gpu_check.json, plus each
# step's log and the benchmarks' own JSON. Two parts, each sized to fit one device session (each step has a limit):
#   bash tools/gpu_check.sh           (~13 minutes at most)
#   1. tests/gpu (pytest -m gpu): NCCL fully_sharded, ddp, pinned cpu_offload + cpu_adam, activation checkpointing,
#      bf16, fp16 with the scaler (also with offload: CPU found-inf on the device-mapped group), at world size 1, each
#      held to a CPU fp32 reference run's per-step losses (fp32 rtol 1e-4, bf16/fp16 rtol 0.02); BN stays plain on
#      one rank; on 2+ GPUs also 2 NCCL ranks (fully_sharded, offload, bf16), torch's SyncBatchNorm on the vision
#      task, and context parallelism 2 against one GPU (GPT fp32, Llama bf16: tests/gpu/test_context_parallel_cuda). The memory plan against the CUDA allocator's peak (ddp, fully_sharded, activation checkpointing,
#      pinned offload, bf16; within 25%). Tests needing more GPUs than exist are skipped with that reason (listed in
#      gpu_check.json).
#   2. torchrun with 2 ranks of fully_sharded, and with 2 pipeline stages (distributed.pipeline_parallel_degree=2,
#      1F1B over 2 micro-batches, NCCL send/recv between the stages) (2+ GPUs); torchrun with 4 ranks of FSDP 2 x
#      tensor parallelism 2 on a Llama (2D: TP with sequence parallelism over NCCL inside each pair, FSDP2 across the
#      pairs; 4+ GPUs); torchrun with 2 ranks of context parallelism on a Llama (distributed.context_parallel_degree=2:
#      torch's ring attention over NCCL, FSDP2 over dp_shard x cp; 2+ GPUs; its parity with one GPU is
#      tests/gpu/test_context_parallel_cuda.py, in step 1). Each recorded as skipped, with the reason, where the GPUs
#      are fewer.
#   3. python -m shardlab_bench train: tokens/s and MFU of gpt_125m and gpt_350m, fully_sharded, bf16, 1 GPU.
#   bash tools/gpu_check.sh compile   (~10.5 minutes at most)
#   4. distributed.compile on CUDA: tests/gpu -k compiled (fully_sharded fp32, ddp, bf16 + activation checkpointing,
#      each held to the CPU fp32 run's losses).
#   5. shardlab_bench train on gpt_125m and gpt_350m (fully_sharded, bf16, 1 GPU), eager then compiled for each model, in a
#      fresh inductor cache: tokens/s and MFU of both, the speed-up, and the cold compile time (gpu_check.json's
#      "compile" block). MFU counts the model's FLOPs, not the kernels inductor fused them into.
#   bash tools/gpu_check.sh memory    (~4 minutes at most)
#   6. pipeline rank 0's training step (Llama 3.1 8B at FSDP 4 x TP 2 x PP 2, one GPU standing for rank 0 of 16 on
#      torch's fake process group) on CUDA tensors beside the same step on fake tensors, which is what
#      distributed.verify_plan holds the plan to on a CPU: LiveBytes' count on each, the CUDA caching allocator's peak
#      of allocated bytes, and the plan of rank 0 (gpu_check.json's "stage_step" block; shardlab_bench/stage_step.py).
# Usage: bash tools/gpu_check.sh [compile|memory]   (from the repository root, with the project installed; PYTHON=...)
set -uo pipefail
out="${OUT:-.}"
py="${PYTHON:-python}"
mkdir -p "$out"
: > "$out/steps.tsv"
ngpu=$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $out/NAME.log, record rc and seconds
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$out/steps.tsv"
    echo "$name: exit $rc ($(( $(date +%s) - start )) s)"
}

TINY_LM=(model.num_layers=2 model.dim=64 model.num_heads=4 model.max_seq_len=32 data.seq_len=32 data.max_corpus_mb=1
    optimization.batch_size=8 optimization.max_steps=10 lr_scheduler.warmup_steps=2 validation.num_batches=2
    validation.batch_size=8 checkpoint.interval_steps=0 logging.interval_steps=1 logging.progress_bar=false
    logging.tensorboard=false)

bench() {  # bench NAME LIMIT_S MODEL [OVERRIDES...]: shardlab_bench train, fully_sharded bf16 on 1 GPU, to $out/NAME.json
    local name=$1 limit=$2 model=$3
    shift 3
    # 20 MB of the corpus: enough for the steps, and its one-off preprocessing stays well inside the limit.
    step "$name" "$limit" "$py" -m shardlab_bench train "model=$model" data.seq_len=1024 data.max_corpus_mb=20 \
        optimization.batch_size=8 distributed.backend=fully_sharded distributed.precision=bf16 "$@" --steps 10 \
        --warmup 3 --out "$out/$name.json"
}

if [ "${1:-}" = memory ]; then
    step stage_step_cuda 240 "$py" -m shardlab_bench stage_step --storage cuda --out "$out/stage_step.json"
elif [ "${1:-}" = compile ]; then
    step gpu_tests 150 "$py" -m pytest -m gpu tests/gpu -k compiled -q -rs -p no:cacheprovider \
        --junitxml="$out/gpu_tests.xml"
    cache=$(mktemp -d)  # a fresh inductor cache: the compile time reported is a cold one
    for model in gpt_125m gpt_350m; do
        bench "bench_${model}_bf16_eager" 90 "$model"
        bench "bench_${model}_bf16_compiled" 150 "$model" distributed.compile=true "distributed.compile_cache_dir=$cache"
    done
else
    step gpu_tests 300 "$py" -m pytest -m gpu tests/gpu -k "not compiled" -q -rs -p no:cacheprovider \
        --junitxml="$out/gpu_tests.xml"
    if [ "$ngpu" -ge 2 ]; then
        step torchrun_2_ranks 90 "$py" -m torch.distributed.run --standalone --nproc_per_node=2 -m shardlab.train \
            distributed.backend=fully_sharded "${TINY_LM[@]}" "hydra.run.dir=$out/torchrun_run"
        step torchrun_pipeline_2_ranks 60 "$py" -m torch.distributed.run --standalone --nproc_per_node=2 \
            -m shardlab.train distributed.backend=fully_sharded distributed.pipeline_parallel_degree=2 \
            model.tie_embeddings=false optimization.update_freq=2 "${TINY_LM[@]}" "hydra.run.dir=$out/torchrun_pp_run"
        step torchrun_context_parallel_2_ranks 60 "$py" -m torch.distributed.run --standalone --nproc_per_node=2 \
            -m shardlab.train distributed.backend=fully_sharded distributed.context_parallel_degree=2 \
            model=llama_tiny model.num_kv_heads=2 model.ffn_dim=null "${TINY_LM[@]}" "hydra.run.dir=$out/torchrun_cp_run"
    else
        for name in torchrun_2_ranks torchrun_pipeline_2_ranks torchrun_context_parallel_2_ranks; do
            printf '%s\tskipped\t0\tneeds 2 GPUs, this machine has %s\n' "$name" "$ngpu" >> "$out/steps.tsv"
        done
    fi
    if [ "$ngpu" -ge 4 ]; then  # 2D: FSDP 2 x TP 2 (TP the mesh's innermost axis: ranks 0-1 and 2-3)
        step torchrun_fsdp2_tp2 90 "$py" -m torch.distributed.run --standalone --nproc_per_node=4 -m shardlab.train \
            distributed.backend=fully_sharded distributed.tensor_parallel_degree=2 model=llama_tiny \
            model.num_kv_heads=2 model.ffn_dim=null "${TINY_LM[@]}" "hydra.run.dir=$out/torchrun_2d_run"
    else
        printf 'torchrun_fsdp2_tp2\tskipped\t0\tneeds 4 GPUs (FSDP 2 x TP 2), this machine has %s\n' "$ngpu" \
            >> "$out/steps.tsv"
    fi
    for model in gpt_125m gpt_350m; do
        bench "bench_${model}_bf16" 100 "$model"
    done
fi

"$py" - "$out" "$ngpu" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, ngpu = Path(sys.argv[1]), int(sys.argv[2])
summary = {"gpus": ngpu, "device": torch.cuda.get_device_name(0) if ngpu else None, "torch": torch.__version__}
summary["steps"] = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds, *reason = line.split("\t")
    step = {"exit_code": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(seconds)}
    summary["steps"][name] = {**step, "reason": reason[0]} if reason else step
tests = {}
if (out / "gpu_tests.xml").exists():
    for case in ET.parse(out / "gpu_tests.xml").iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        detail = next((c.get("message", "") for c in case if c.tag in ("failure", "error", "skipped")), "")
        tests[case.get("name")] = {"outcome": outcome, "detail": detail[:300]}
summary["tests"] = tests
summary["bench"] = {}
for path in sorted(out.glob("bench_*.json")):
    b = json.loads(path.read_text())
    keys = ("tokens_per_s", "median_step_ms", "mfu", "peak_tflops", "first_step_s", "compile_s")
    summary["bench"][path.stem] = {k: b.get(k) for k in keys}
compiled = {}
for name, b in summary["bench"].items():
    if name.endswith("_compiled") and name.replace("_compiled", "_eager") in summary["bench"]:
        eager = summary["bench"][name.replace("_compiled", "_eager")]
        speedup = b["tokens_per_s"] / eager["tokens_per_s"] if b["tokens_per_s"] and eager["tokens_per_s"] else None
        compiled[name.removesuffix("_compiled")] = {
            "eager_tokens_per_s": eager["tokens_per_s"],
            "compiled_tokens_per_s": b["tokens_per_s"],
            "speedup": speedup,
            "eager_mfu": eager["mfu"],
            "compiled_mfu": b["mfu"],
            "compile_s": b["compile_s"],
        }
if compiled:
    summary["compile"] = compiled
if (out / "stage_step.json").exists():
    stage = json.loads((out / "stage_step.json").read_text())
    summary["stage_step"] = {"label": stage["label"], "plan_rank0_bytes": stage["plan_rank0_bytes"], **{
        storage: {k: step.get(k) for k in ("peak", "device_peak", "seconds", "not_run")}
        for storage, step in stage["steps"].items()}}  # fmt: skip
failed = [n for n, s in summary["steps"].items() if s["exit_code"] not in (0, "skipped")] + [
    n for n, t in tests.items() if t["outcome"] in ("failure", "error")
]
summary["ok"] = not failed
summary["failed"] = failed
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["ok"] else 1)
EOF
