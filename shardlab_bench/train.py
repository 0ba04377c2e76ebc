"""Benchmark any shardlab config through shardlab's own code path and write one JSON.

    python -m shardlab_bench train model=gpt_small distributed.backend=fully_sharded distributed.world_size=2 \\
        --steps 20 --warmup 5 --out bench.json

Arguments without a leading ``--`` are Hydra overrides, as for ``python -m shardlab.train``. The ranks run
shardlab.runner.run_rank (shardlab.trainer.assemble and Trainer.fit, spawned like shardlab.runner.launch_local) for
warmup + steps + 1 steps; global module-forward and optimizer-step hooks do the timing, so nothing in the trainer is
replaced. A step lasts from its first forward to the next step's (data, forward, backward, clipping, optimizer,
zero_grad, schedule and metric logging all count); the last step is not timed but has its collectives counted.
The run's checkpoint goes to a temporary directory that is deleted afterwards.

The JSON (rank 0 writes it):
  {unit}_per_s           global throughput: units per optimizer step (task.num_units, x batch_size x update_freq) /
                         median step time (``{unit}_per_s_mean`` uses the mean)
  median_step_ms         median over the timed steps, rank 0 (ranks run in lockstep through the collectives)
  optimizer_step_ms      median time inside optimizer.step(), rank 0
  per_rank[r]            param_bytes / grad_bytes / optimizer_state_bytes of this rank's local shards (DTensor:
                         .to_local()), measured at the last timed step; peak_memory_bytes (see peak_memory_method)
  collectives_per_step   {all_gather, reduce_scatter, all_reduce, ...: {count, bytes}} of rank 0 in the counted step;
                         bytes = the larger of an op's input and output: the full (unsharded) payload, e.g. the
                         gathered params. Counted by a TorchDispatchMode that sees every c10d / functional-collective
                         op (FSDP2's, DDP's reducer's, DTensor's), also those issued from backward.
  expected_collectives   what that should be from the FSDP2 unit plan / DDP (bytes), to check the counts against
  model_flops_per_step   3 x the forward FLOPs of one micro-batch (torch's FlopCounterMode on rank 0's first forward of
                         the counted step) x micro-batches x ranks: model FLOPs, so recomputation does not count
  achieved_tflops, mfu   model FLOPs per median step, and that over peak_tflops (the whole run's: ranks x one device's)
  peak_tflops            --peak-tflops if given; else a known GPU's bf16 dense peak (flops.py); on CPU the fp32
                         GEMM rate of one thread, measured before the ranks start, x the threads the ranks use
  first_step_s           rank 0's first step (untimed warmup), which under distributed.compile=true builds every graph
  compile_s              distributed.compile=true: first_step_s - median step, what compiling cost this run (it includes
                         the first step's own eager overhead: an eager run's first_step_s shows that); null when eager
  framework_parts_ms_per_step  with --profile: each region the trainer labels (shardlab.data, .seed, .metrics,
                         .meter, .agree, .log) in ms per timed step on rank 0, and its share of the median step
                         (framework_parts_share_of_step): what shardlab does per step beside the model's work
  compile_cache_dir      distributed.compile=true: the inductor cache the run read and wrote (a second run in the same
                         cache reloads its kernels: a lower compile_s); compile.py runs the pairs

Peak memory: on CUDA the caching allocator's peak (max_memory_allocated); on CPU the rank's peak resident set size
(VmHWM of /proc/self/status, which includes the ~0.3-0.5 GiB of Python, torch and the memory-mapped corpus;
``rss_at_start_bytes`` is that baseline), read at the last timed step. CPU ranks set glibc's treatment of freed memory
from distributed.cpu_allocator (auto: fast, keeping freed pages, without a memory budget; lean, returning them so that
RSS tracks what is live, with one): ``env.cpu_allocator`` records it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardlab import runner
from shardlab.distributed import env as dist_env
from shardlab.distributed.cpu_allocator import resolve_cpu_allocator
from shardlab.memory.meter import process_peak, resident_bytes
from shardlab_bench.flops import FlopCounterMode, flop_counter, peak_flops_per_s
from shardlab_bench.provenance import collect, finish

BENCH_DEFAULTS = {  # applied unless the command line sets the key: no checkpoints, logs or validation mid-run
    "checkpoint.resume": "none",
    "checkpoint.interval_steps": "0",
    "validation.interval_steps": "0",
    "validation.num_batches": "1",
    "logging.tensorboard": "false",
    "logging.progress_bar": "false",
}

COLLECTIVE_KINDS = {  # first match wins: "all_gather" before "gather", "reduce_scatter" before "reduce"
    "all_gather": ("allgather", "all_gather"),
    "reduce_scatter": ("reduce_scatter",),
    "all_reduce": ("allreduce", "all_reduce"),
    "broadcast": ("broadcast",),
    "all_to_all": ("alltoall", "all_to_all"),
    "reduce": ("reduce",),
    "gather": ("gather",),
    "scatter": ("scatter",),
    "send_recv": ("send", "recv"),
}


def collective_kind(op_name: str) -> str | None:
    """'c10d._allgather_base_.default' -> 'all_gather'; None for ops that are not collectives (waits, wrappers)."""
    namespace, _, name = op_name.partition(".")
    if namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
        return None
    for kind, needles in COLLECTIVE_KINDS.items():
        if any(n in name for n in needles):
            return kind
    return None


def tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives and their bytes. DTensor ops are let through first (NotImplemented, as
    torch.distributed.tensor.debug.CommDebugMode does) so the collectives they desugar into are seen too."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        kind = collective_kind(str(func))  # e.g. c10d._allgather_base_.default
        if kind is not None:
            nbytes = max([tensor_bytes(a) for a in args] + [tensor_bytes(list(kwargs.values())), tensor_bytes(out)])
            entry = self.counts.setdefault(kind, {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += nbytes
        return out


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """The process's peak since it started (shardlab.memory.meter.process_peak: the trainer's meter resets the
    counters every step)."""
    method = "cuda max_memory_allocated" if device.type == "cuda" else "peak RSS (VmHWM, /proc/self/status)"
    return process_peak(device), method


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


class StepProbe:
    """Hooks that leave the trainer untouched: a global module forward pre-hook marks where each training step
    starts (the root module's first training forward of the step), and global optimizer step hooks time the optimizer.
    A step lasts from its first forward to the next step's, so skipped optimizer steps (fp16 overflow) still count.
    At the start of step warmup + steps + 1 the timed steps are over: memory and state bytes are read, and collectives
    are counted from there to that step's optimizer step (or the first evaluation forward, if the step is skipped)."""

    def __init__(self, warmup: int, steps: int, update_freq: int, profile_dir: str | None, rank: int) -> None:
        self.warmup, self.steps, self.update_freq = warmup, steps, update_freq
        self.last_timed = warmup + steps
        self.step = 0
        """The step under way (1-based): the number of steps started."""
        self.micro = 0
        self.root: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.starts: list[float] = []
        self.optimizer_ms: list[float] = []
        self.mem: dict[str, Any] = {"rss_at_start_bytes": resident_bytes()}
        self.counter: CollectiveCounter | None = None
        self.eager: Any = None
        """torch.compiler.set_stance("force_eager") while the counted step runs (set on creation; __exit__ restores)."""
        self.counts: dict[str, dict[str, int]] = {}
        self.flops: FlopCounterMode | None = None
        self.forward_flops = 0
        """Counted in the first forward of the counted step (one micro-batch of this rank)."""
        self.profile_dir = profile_dir if rank == 0 else None
        self.profiler = None
        self.parts_ms: dict[str, float] = {}
        """--profile: the trainer's own regions (``shardlab.*`` record_function labels), ms per timed step."""
        self._t0 = 0.0
        self._cpu0 = (0.0, 0.0)
        self._handles: list = []

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [
            register_optimizer_step_pre_hook(self.pre),
            register_optimizer_step_post_hook(self.post),
            torch.nn.modules.module.register_module_forward_pre_hook(self.forward_pre),
            torch.nn.modules.module.register_module_forward_hook(self.forward_post),
        ]

    def forward_pre(self, module, inputs) -> None:
        if any(t.is_meta for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)):
            return  # the memory plan's shape-only forward (shardlab.memory.plan), before training: not a step
        if self.root is None and next(module.parameters(), None) is not None:
            # The trainer's model: the first module with parameters to run forward (torchvision's v2 transforms,
            # which SwAV's multi-crop data runs before it, are parameter-free modules too).
            self.root = module
        if module is not self.root:
            return
        if not module.training:  # validation
            self._stop_counting()
            return
        self.micro += 1
        if (self.micro - 1) % self.update_freq:
            return
        now = time.perf_counter()
        self.step += 1
        self.starts.append(now)
        if self.step == self.warmup + 1:
            self._cpu0 = (now, time.process_time())
            if self.profile_dir:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.__enter__()
        elif self.step == self.last_timed + 1:
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                self._write_profile()
                self.profiler = None
            self._read_memory(now)
            # distributed.compile: the counted step runs eagerly, so FLOPs and collectives are counted from torch's own
            # ops (inductor's fused kernels are invisible to both counters), and nothing recompiles under them.
            self.eager = torch.compiler.set_stance("force_eager")
            self.counter = CollectiveCounter()
            self.counter.__enter__()
            self.flops = flop_counter()
            self.flops.__enter__()

    def forward_post(self, module, inputs, output) -> None:
        if module is self.root and self.flops is not None:
            self.flops.__exit__(None, None, None)
            self.forward_flops, self.flops = self.flops.get_total_flops(), None

    def pre(self, optimizer, args, kwargs) -> None:
        if self.warmup < self.step <= self.last_timed:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.mem["param_bytes"] = sum(local_bytes(p) for p in params)
            self.mem["grad_bytes"] = sum(local_bytes(p.grad) for p in params)
        self._t0 = time.perf_counter()

    def post(self, optimizer, args, kwargs) -> None:
        now = time.perf_counter()
        self.optimizer = optimizer
        if self.warmup < self.step <= self.last_timed:
            self.optimizer_ms.append(1000 * (now - self._t0))
        elif self.step == self.last_timed + 1:
            self._stop_counting()

    def _read_memory(self, now: float) -> None:
        # ~1.0 per compute thread when this rank had its cores to itself; lower means waiting (collectives, or other
        # processes taking the CPU): compare it across runs before comparing their times.
        self.mem["cpu_seconds_per_second"] = (time.process_time() - self._cpu0[1]) / (now - self._cpu0[0])
        if self.optimizer is not None:
            self.mem["optimizer_state_bytes"] = sum(
                local_bytes(v) for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
            )
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.mem["peak_memory_bytes"], self.mem["peak_memory_method"] = peak_memory_bytes(device)

    def _stop_counting(self) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.counts, self.counter = self.counter.counts, None
        if self.eager is not None:
            self.eager.__exit__(None, None, None)
            self.eager = None

    def close(self) -> None:
        """Remove the hooks, and whatever is still active if the run ended early."""
        for h in self._handles:
            h.remove()
        if self.flops is not None:
            self.flops.__exit__(None, None, None)
        self._stop_counting()
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)

    def _write_profile(self) -> None:
        path = Path(self.profile_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(path / "rank0_trace.json"))
        averages = self.profiler.key_averages()
        self.parts_ms = {
            e.key: e.cpu_time_total / 1000 / self.steps for e in averages if e.key.startswith("shardlab.")
        }  # what the framework adds around the model's own work (shardlab/trainer.py labels it)
        table = averages.table(sort_by="self_cpu_time_total", row_limit=40)
        (path / "rank0_ops.txt").write_text(table)
        print(f"profile of the timed steps (rank 0): {path}/rank0_trace.json, {path}/rank0_ops.txt", flush=True)


def expected_collectives(trainer) -> dict[str, Any]:
    """Per step, from the model's plan: FSDP2 gathers each unit's params (in param dtype) for forward and again for
    backward where the unit reshards after forward, and reduce-scatters its grads (reduce dtype; an all-reduce of the
    same buffer under distributed.reduce_scatter=all_reduce, opt-in on gloo); DDP all-reduces
    every grad once. Micro-batches multiply both (reduce-scatter only when reduce_every_microbatch)."""
    backend, model, cfg = trainer.backend, trainer.model, trainer.cfg
    micro = cfg.optimization.update_freq
    syncs = micro if cfg.distributed.reduce_every_microbatch else 1
    if backend.name == "ddp":
        nbytes = sum(p.numel() * backend.reduce_dtype.itemsize for p in model.parameters() if p.requires_grad)
        return {"all_reduce": {"bytes": nbytes * syncs}}
    if backend.name != "fully_sharded":
        return {}
    from torch.distributed.fsdp import FSDPModule

    gather = reduce = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # private: per-unit params and reshard decision
        if group is None:
            continue
        mp = group.mp_policy
        unit_params = [fp.sharded_param for fp in group.fsdp_params]
        numel = sum(p.numel() for p in unit_params)  # global (unsharded) sizes
        passes = 2 if group.post_forward_mesh_info is not None else 1
        gather += numel * (mp.param_dtype or unit_params[0].dtype).itemsize * passes * micro
        reduce += numel * (mp.reduce_dtype or mp.param_dtype or unit_params[0].dtype).itemsize * syncs
    reduce_kind = "all_reduce" if backend.reduce_scatter_via_all_reduce else "reduce_scatter"
    return {"all_gather": {"bytes": gather}, reduce_kind: {"bytes": reduce}}


def units_per_sample(task) -> int:
    return int(task.num_units(task.collate([task.train_dataset[0]])))


def bench_rank(cfg, env: dist_env.DistEnv, run_dir: str, opts: dict) -> dict | None:
    """One rank: run_rank with the probe; rank 0 returns the assembled result (others None)."""
    probe = StepProbe(opts["warmup"], opts["steps"], cfg.optimization.update_freq, opts.get("profile"), env.rank)
    probe.install()

    def after_fit(trainer) -> dict:
        mine = {"rank": env.rank, **probe.mem}
        ranks = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        return {
            "bench_ranks": ranks,
            "units_per_sample": units_per_sample(trainer.task),
            "num_params": sum(p.numel() for p in trainer.model.parameters()),
            "expected": expected_collectives(trainer),
            "unit": trainer.task.unit,
            "backend_lines": list(trainer.backend.describe()),
        }

    try:
        result = runner.run_rank(cfg, Path(run_dir), env, after_fit=after_fit)
    finally:
        probe.close()
    if not env.is_main:
        return None
    return assemble(cfg, opts, probe, result)


def run_env(cfg) -> dict:
    """What of the process's environment the figures depend on: torch, threads, the allocator, the load at the end."""
    return {
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "cpu_allocator": resolve_cpu_allocator(cfg.distributed),
        "cpu_count": os.cpu_count(),
        "loadavg_1min_at_end": os.getloadavg()[0],
    }


def assemble(cfg, opts: dict, probe: StepProbe, result: dict) -> dict:
    warmup, steps = opts["warmup"], opts["steps"]
    if len(probe.starts) <= warmup + steps:
        raise RuntimeError(f"only {len(probe.starts)} training steps started; expected {warmup + steps + 1}")
    step_ms = [1000 * (probe.starts[k] - probe.starts[k - 1]) for k in range(warmup + 1, warmup + steps + 1)]
    o, d = cfg.optimization, cfg.distributed
    unit = result["unit"]
    per_step = result["units_per_sample"] * o.batch_size * o.update_freq
    median = statistics.median(step_ms)
    mean = statistics.fmean(step_ms)
    # Every data-parallel rank runs the same shapes; a step is update_freq micro-batches of 3x forward FLOPs each.
    model_flops = 3 * probe.forward_flops * o.update_freq * len(result["bench_ranks"])
    achieved = model_flops / (median / 1000)
    peak, peak_method = opts["peak"]
    first_step_s = probe.starts[1] - probe.starts[0]
    out = {
        "tool": "bench",
        "overrides": opts["overrides"],
        "backend": d.backend,
        "world_size": d.world_size,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "optimizer": cfg.optimizer.name,
        "num_params": result["num_params"],
        "batch_size": o.batch_size,
        "update_freq": o.update_freq,
        "unit": unit,
        f"{unit}_per_step": per_step,
        "steps": steps,
        "warmup": warmup,
        f"{unit}_per_s": per_step / (median / 1000),
        f"{unit}_per_s_mean": per_step / (mean / 1000),
        "median_step_ms": median,
        "mean_step_ms": mean,
        "step_ms": [round(t, 3) for t in step_ms],
        "optimizer_step_ms": statistics.median(probe.optimizer_ms) if probe.optimizer_ms else None,
        "model_flops_per_step": model_flops,
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_method": peak_method,
        "mfu": achieved / peak if peak else None,
        "optimizer_steps_taken": len(probe.optimizer_ms),
        "compile": d.compile,
        "first_step_s": first_step_s,
        "compile_s": first_step_s - median / 1000 if d.compile else None,
        "compile_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR") if d.compile else None,
        "per_rank": [
            {**r, "state_bytes": r.get("param_bytes", 0) + r.get("grad_bytes", 0) + r.get("optimizer_state_bytes", 0)}
            for r in result["bench_ranks"]
        ],
        "collectives_per_step": probe.counts,
        "expected_collectives": result["expected"],
        "backend_description": result["backend_lines"],
        "env": run_env(cfg),
        "profiled": bool(opts.get("profile")),
        "framework_parts_ms_per_step": probe.parts_ms or None,
        "framework_parts_share_of_step": {k: v / median for k, v in probe.parts_ms.items()} or None,
        "meta": finish(opts["meta"]),
    }
    return out


def peak_for(world: int, threads_per_rank: int, peak_tflops: float | None) -> tuple[float | None, str]:
    """The whole run's peak FLOP/s: world x one device's, or on CPU the measured rate of the threads the ranks use.
    Measured before the ranks start, so nothing else competes for the cores."""
    if peak_tflops:
        return peak_tflops * 1e12 * world, f"--peak-tflops {peak_tflops} x {world} ranks"
    if torch.cuda.is_available():
        peak, method = peak_flops_per_s(torch.device("cuda", torch.cuda.current_device()), threads=0)
        return (peak * world if peak else None), f"{method} x {world} ranks"
    threads = min(world * threads_per_rank, os.cpu_count() or 1)
    return peak_flops_per_s(torch.device("cpu"), threads)


def _spawned(rank: int, cfg_yaml: str, run_dir: str, world: int, port: int, opts: dict) -> None:
    env = dist_env.detect(spawned_rank=rank, spawned_world=world, spawned_port=port)
    try:
        out = bench_rank(OmegaConf.create(cfg_yaml), env, run_dir, opts)
        if out is not None:
            write(out, opts["out"])
    except Exception:
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
    dist_env.end_finished_rank()


def write(out: dict, path: str) -> None:
    Path(path).write_text(json.dumps(out, indent=1))
    unit = out["unit"]
    cols = {k: out[k] for k in ("backend", "world_size", "optimizer", f"{unit}_per_s", "median_step_ms")}
    cols["optimizer_step_ms"] = out["optimizer_step_ms"]
    if out["mfu"] is not None:
        cols["mfu_percent"] = 100 * out["mfu"]
    if out["compile_s"] is not None:
        cols["compile_s"] = out["compile_s"]
    print("bench: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in cols.items()))
    print(f"bench: wrote {path}", flush=True)


def compose(overrides: list[str], total_steps: int):
    from shardlab.cli.preflight import check_group_choices, compose_config

    check_group_choices(overrides)
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    full = [f"{k}={v}" for k, v in BENCH_DEFAULTS.items() if k not in given] + overrides
    full.append(f"optimization.max_steps={total_steps}")
    cfg = compose_config(full)
    if cfg.lr_scheduler.warmup_steps > total_steps:  # a schedule detail; not worth an error in a benchmark
        cfg.lr_scheduler.warmup_steps = total_steps
    return cfg


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, usage="%(prog)s [overrides] [opts]"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (>= 1)")
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--profile", default=None, help="directory: torch.profiler trace of rank 0's timed steps")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="one device's peak for MFU (default: known GPUs; CPU: measured)"
    )
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the first step has no start time)")
    meta = collect(__file__, argv, settings={"overrides": overrides, "steps": args.steps, "warmup": args.warmup})
    cfg = compose(overrides, args.warmup + args.steps + 1)
    task = runner.build_task(cfg)  # every config error before anything starts, as one ConfigError
    opts = {"warmup": args.warmup, "steps": args.steps, "out": args.out, "profile": args.profile}
    opts["overrides"] = overrides
    opts["meta"] = meta
    run_dir = tempfile.mkdtemp(prefix="shardlab-bench-")
    try:
        env = dist_env.detect()
        world = cfg.distributed.world_size
        if env.launcher == "none" and world > 1:
            import torch.multiprocessing as mp

            task.prepare_data()  # once, here; the ranks find it cached
            dist_env.set_local_rank_defaults(world)  # as shardlab.runner.launch_local
            opts["peak"] = peak_for(world, int(os.environ["OMP_NUM_THREADS"]), args.peak_tflops)
            cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
            mp.start_processes(
                _spawned,
                args=(cfg_yaml, run_dir, world, dist_env.free_port(), opts),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
            return json.loads(Path(args.out).read_text())
        opts["peak"] = peak_for(env.world_size, torch.get_num_threads(), args.peak_tflops)
        out = bench_rank(cfg, env, run_dir, opts)  # one process, or this rank of a torchrun/Slurm job
        if out is not None:
            write(out, args.out)
        return out
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
