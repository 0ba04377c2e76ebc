"""The training loop: accumulate, (auto)cast and scale, clip, step, validate, checkpoint, log.

Nothing here knows the task or the backend: the Task supplies model, data and loss; the Backend wraps the model and
decides how gradients are reduced.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from shardlab.checkpoint import Checkpointer
from shardlab.data import GlobalOrder, rank_loader, sample_seed
from shardlab.distributed.backend import Backend
from shardlab.init import materialize
from shardlab.logging import RunLogger, memory_gib
from shardlab.optim import LR_SCHEDULERS, OPTIMIZERS  # importing shardlab.optim registers adamw, sgd, ...
from shardlab.plan import describe_plan
from shardlab.task import Task


@dataclasses.dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken."""
    samples_seen: int = 0
    """Global training samples consumed: the data position, independent of the world size."""


class Trainer:
    def __init__(self, cfg: Any, task: Task, backend: Backend, run_dir: Path) -> None:
        self.cfg = cfg
        self.task = task
        self.backend = backend
        self.run_dir = run_dir
        self.state = TrainState()
        self.history: list[dict[str, float]] = []
        """Every logged train/valid record (rank 0 has the global values); tests compare these across backends."""
        self.stop_requested = False
        self.skipped_steps = 0
        """Optimizer steps skipped for non-finite gradients (fp16 overflow, or a diverged run)."""

    # ---- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, backend = self.cfg, self.backend
        if backend.env.is_main:
            self.task.prepare_data()  # rank 0 preprocesses first; the others then hit its cache
        backend.barrier()
        if not backend.env.is_main:
            self.task.prepare_data()
        with torch.device("meta"):
            model = self.task.build_model()
        units = self.task.fsdp_units(model)
        self.plan = describe_plan(model, units, cfg.distributed, backend.env.world_size)
        backend.full_precision_modules = self.task.full_precision_modules(model)
        self.model = backend.parallelize(
            model, units, lambda m: materialize(m, backend.param_device, self.task.init_tensor, cfg.seed)
        )
        self.optimizer = OPTIMIZERS.build(cfg.optimizer.name, self.model, cfg.optimizer, key="optimizer.name")
        self.scheduler = LR_SCHEDULERS.build(
            cfg.lr_scheduler.name, self.optimizer, cfg.lr_scheduler, cfg.optimization.max_steps, key="lr_scheduler.name"
        )
        self.scaler = backend.make_grad_scaler()
        self.checkpointer = Checkpointer(
            self.run_dir / cfg.checkpoint.dir, cfg.checkpoint.keep_last, backend.env.rank, backend.barrier
        )
        self.model_config = OmegaConf.to_container(cfg.model, resolve=True)
        self.resumed_from = resume_from = self.checkpointer.resolve_resume(cfg.checkpoint.resume)
        if resume_from is not None:
            meta = self.checkpointer.load(
                resume_from,
                self.model,
                self.optimizer,
                self.model_config,
                ignore_keys=self.task.resumable_model_changes,
            )
            self.state = TrainState(step=meta["step"], samples_seen=meta["samples_seen"])
            self.scheduler.load_state_dict(meta["scheduler"])
            if self.scaler is not None and meta.get("grad_scaler"):
                self.scaler.load_state_dict(meta["grad_scaler"])
        self.global_batch = cfg.optimization.batch_size
        self.train_order = GlobalOrder(len(self.task.train_dataset), cfg.seed, shuffle=True)

    # ---- loop ----------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg, backend, state = self.cfg, self.backend, self.state
        o = cfg.optimization
        log = RunLogger(cfg.logging, self.run_dir, backend.env.is_main, o.max_steps, state.step)
        self._install_signal_handlers()
        if self.resumed_from is not None:
            log.info(f"resumed from {self.resumed_from} (step {state.step}, {state.samples_seen} samples seen)")
        loader = iter(
            rank_loader(
                self.task.train_dataset,
                self.train_order,
                state.samples_seen,
                self.global_batch,
                backend.dp_rank,
                backend.dp_world_size,
                collate_fn=self.task.collate,
                num_workers=self.task.num_workers,
            )
        )
        sums: dict[str, torch.Tensor] = {}
        window_start, window_steps = time.perf_counter(), 0
        last_valid: dict[str, float] = {}
        while state.step < o.max_steps and not self.stop_requested:
            self.model.train()
            # Per-step seeding: dropout draws from (seed, global offset of this rank's first sample of the step), so a
            # resumed run draws the same masks as an uninterrupted one without storing RNG state. Augmentation is
            # seeded per sample by the data loader (shardlab.data), independently of the world size.
            first_sample = state.samples_seen + backend.dp_rank * (self.global_batch // backend.dp_world_size)
            torch.manual_seed(sample_seed(cfg.seed + 1, first_sample))
            for micro in range(o.update_freq):
                batch = next(loader)
                with backend.grad_sync(self.model, micro == o.update_freq - 1):
                    with backend.forward_context():
                        loss, stats = self.task.loss(self.model, batch, backend.device)
                    scaled = loss / o.update_freq
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0) + v.detach().float()
                sums["units"] = sums.get("units", 0) + self.task.num_units(batch)
            grad_norm = self._step()
            state.step += 1
            state.samples_seen += self.global_batch * o.update_freq
            window_steps += 1
            log.advance()
            if state.step % cfg.logging.interval_steps == 0 or state.step == o.max_steps:
                totals = self._sum_over_ranks(sums)
                metrics = self.task.summarize(totals)
                elapsed = time.perf_counter() - window_start
                metrics.update(
                    {
                        "lr": self.scheduler.get_last_lr()[0],
                        "gnorm": float(grad_norm),
                        f"{self.task.unit}_per_s": totals["units"] / max(elapsed, 1e-9),
                        "ms_per_step": 1000 * elapsed / max(window_steps, 1),
                        "mem_gib": memory_gib(backend.device),
                    }
                )
                if self.scaler is not None:
                    metrics["loss_scale"] = float(self.scaler.get_scale())
                metrics["skipped_steps"] = self.skipped_steps
                self._record("train", metrics, log)
                sums, window_start, window_steps = {}, time.perf_counter(), 0
            vi = cfg.validation.interval_steps
            if state.step == o.max_steps or (vi and state.step % vi == 0):
                last_valid = self.validate(log)
            ci = cfg.checkpoint.interval_steps
            if state.step == o.max_steps or self.stop_requested or (ci and state.step % ci == 0):
                self.save()
        if not last_valid and not self.stop_requested:  # resumed at the end: still report the final quality
            last_valid = self.validate(log)
        log.close()
        return last_valid

    def _step(self) -> torch.Tensor:
        clip = self.cfg.optimization.clip_norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.backend.clip_grad_norm(self.model, clip)
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.skipped_steps += int(self.scaler.get_scale() < scale_before)
        elif math.isfinite(float(grad_norm)):
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    @torch.no_grad()
    def validate(self, log: RunLogger) -> dict[str, float]:
        cfg, backend = self.cfg, self.backend
        dataset = self.task.valid_dataset
        vb = cfg.validation.batch_size
        available = len(dataset) // vb
        num_batches = min(cfg.validation.num_batches or available, available)
        self.model.eval()
        loader = rank_loader(
            dataset,
            GlobalOrder(len(dataset), cfg.seed, shuffle=False),
            0,
            vb,
            backend.dp_rank,
            backend.dp_world_size,
            num_batches=num_batches,
            collate_fn=self.task.collate,
            num_workers=self.task.num_workers,
        )
        sums: dict[str, torch.Tensor] = {}
        for batch in loader:
            with backend.forward_context():
                _, stats = self.task.loss(self.model, batch, backend.device)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + v.detach().float()
        metrics = self.task.summarize(self._sum_over_ranks(sums))
        self._record("valid", metrics, log)
        return metrics

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _sum_over_ranks(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """One all-reduce of every statistic (packed in one tensor); the task turns the totals into metrics."""
        keys = sorted(sums)
        packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).cpu() for k in keys])
        total = self.backend.all_reduce_sum(packed.to(self.backend.device)).cpu()
        return {k: float(v) for k, v in zip(keys, total, strict=True)}

    def _record(self, split: str, metrics: dict[str, float], log: RunLogger) -> None:
        self.history.append({"split": split, "step": self.state.step, **metrics})
        log.log(split, self.state.step, metrics)

    def save(self) -> Path:
        meta = {
            "samples_seen": self.state.samples_seen,
            "scheduler": self.scheduler.state_dict(),
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "model_config": self.model_config,
            "world_size": self.backend.env.world_size,
            "backend": self.backend.name,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }
        return self.checkpointer.save(self.state.step, self.model, self.optimizer, meta)

    def _install_signal_handlers(self) -> None:
        """SIGTERM / SIGUSR1 (Slurm preemption, `kill`): finish the current step, save, and stop cleanly."""

        def request_stop(signum, frame):
            self.stop_requested = True

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, request_stop)
            except ValueError:  # not the main thread (e.g. inside a test harness): keep the default handler
                pass
