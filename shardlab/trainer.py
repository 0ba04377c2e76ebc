"""The training loop: accumulate, (auto)cast and scale, clip, step, validate, checkpoint, log.

Nothing here knows the task or the backend: the Task supplies model, data and loss; the Backend wraps the model and
decides how gradients are reduced.
"""

from __future__ import annotations

import importlib
import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from shardlab.checkpoint import weights
from shardlab.checkpoint.manager import Checkpointer
from shardlab.data import GlobalOrder, rank_loader, sample_seed
from shardlab.distributed.base import Backend
from shardlab.distributed.compile import FirstSteps
from shardlab.distributed.materialize import materialize
from shardlab.errors import CheckpointError, first_cause
from shardlab.jobs.preemption import StopSignals
from shardlab.logging import RunLogger
from shardlab.memory.meter import PeakMeter, memory_gib, resident_bytes
from shardlab.memory.plan import GiB, RunPlan
from shardlab.optim import LR_SCHEDULERS, OPTIMIZERS  # importing shardlab.optim registers adamw, sgd, ...
from shardlab.task import Task
from shardlab.train_state import TrainState


class Trainer:
    def __init__(self, cfg: Any, task: Task, backend: Backend, run_dir: Path) -> None:
        self.cfg = cfg
        self.task = task
        self.backend = backend
        self.run_dir = run_dir
        self.state = TrainState()
        self.history: list[dict[str, float]] = []
        """Every logged train/valid record (rank 0 has the global values); tests compare these across backends."""
        self.stop_signals = StopSignals()
        self.stopped_by: str | None = None
        """The stop signal that ended training before optimization.max_steps (after a checkpoint), if one did."""

    # ---- setup ---------------------------------------------------------------------------------------------------
    def setup(self, plan: RunPlan) -> None:
        """Shard and materialize the planned model (built on meta), build the optimizer and schedule, and restore the
        training state (checkpoint.resume, else checkpoint.init_from, else the seeded init)."""
        cfg, backend = self.cfg, self.backend
        self.memory_estimate = plan.estimate
        if backend.env.is_main and cfg.logging.tensorboard:
            importlib.import_module("torch.utils.tensorboard")  # its modules are the logger's, not a step's memory
        # The baseline: this rank with its data and the plan's meta-device modules, before any model memory.
        self.meter = PeakMeter(backend.device)
        self.held: int | None = None
        """Bytes above the baseline after the last step of fit (measured once, when the loop ends)."""
        self.memory: dict[str, float] = {}
        """Measured and predicted GiB per rank (the fullest rank's), set at the end of fit."""
        self.model = backend.parallelize(
            plan.model,
            plan.units,
            lambda m: materialize(m, backend.param_device, self.task.init_tensor, cfg.seed),
            full_precision_modules=self.task.full_precision_modules(plan.model),
        )
        self.optimizer = OPTIMIZERS.build(cfg.optimizer.name, self.model, cfg.optimizer, key="optimizer.name")
        self.scheduler = LR_SCHEDULERS.build(
            cfg.lr_scheduler.name, self.optimizer, cfg.lr_scheduler, cfg.optimization.max_steps, key="lr_scheduler.name"
        )
        self.scaler = backend.make_grad_scaler()
        self.state.components = {"scheduler": self.scheduler, "grad_scaler": self.scaler}
        self.model_config = OmegaConf.to_container(cfg.model, resolve=True)
        self._restore()
        self.last_save = (self.state.step, time.monotonic())
        self.global_batch = cfg.optimization.batch_size
        self.train_order = GlobalOrder(len(self.task.train_dataset), cfg.seed, shuffle=True)

    # ---- loop ----------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to optimization.max_steps, or until a stop signal (then save and set ``stopped_by``)."""
        cfg, is_main = self.cfg, self.backend.env.is_main
        log = RunLogger(cfg.logging, self.run_dir, is_main, cfg.optimization.max_steps, self.state.step)
        self.checkpointer.log = log.info  # save lines above the progress bar, not through it
        self.stop_signals.install()
        try:
            final = self._fit(log)
            self.checkpointer.finish()  # an asynchronous save still in flight gets its name before we return
            self._report_memory(log)
            return final
        except BaseException as error:
            self._save_after_error(error, log)
            raise
        finally:
            self.stop_signals.restore()
            log.close()

    def _fit(self, log: RunLogger) -> dict[str, float]:
        cfg, backend, state = self.cfg, self.backend, self.state
        o = cfg.optimization
        if self.resumed_from is not None:
            log.info(f"resumed from {self.resumed_from} (step {state.step}, {state.samples_seen} samples seen)")
        elif self.initialized_from is not None:
            log.info(f"initialized from {self.initialized_from} (step 0, fresh optimizer)")
            self.validate(log)  # the loaded weights' quality, before training moves them
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
        # Throughput windows time training only: validation and saving inside a window are taken out (and timed
        # on their own lines).
        window_start, window_steps, window_paused = time.perf_counter(), 0, 0.0
        last_valid: dict[str, float] = {}
        compiling = cfg.distributed.compile and state.step < o.max_steps
        first_steps = FirstSteps(cfg.distributed, backend.process_groups()) if compiling else None
        while state.step < o.max_steps:
            step_started = time.perf_counter()
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
            lr = self.scheduler.get_last_lr()[0]  # the rate this step uses (_step advances the schedule)
            grad_norm, skipped = self._step()
            if first_steps is not None and (line := first_steps.ended(time.perf_counter() - step_started)):
                log.info(line)  # the compilation's cost, once
            state.end_step(self.global_batch * o.update_freq, skipped)
            self.meter.sample()
            window_steps += 1
            log.advance()
            # Agreed at every step end (one all-reduce), so all ranks stop or save at the same step whichever rank got
            # the signal, and a save by the clock follows rank 0's.
            stop, overdue = backend.any_rank(self.stop_signals.received is not None, self._save_overdue())
            if stop or state.step == o.max_steps:  # the loop's last step: what it holds is what the run holds
                self.held = self._held_between_steps()
            if state.step % cfg.logging.interval_steps == 0 or state.step == o.max_steps:
                totals = self._sum_over_ranks(sums)
                metrics = self.task.summarize(totals)
                elapsed = time.perf_counter() - window_start - window_paused
                metrics.update(
                    {
                        "lr": lr,
                        "gnorm": float(grad_norm),
                        f"{self.task.unit}_per_s": totals["units"] / max(elapsed, 1e-9),
                        "ms_per_step": 1000 * elapsed / max(window_steps, 1),
                        "mem_gib": memory_gib(backend.device),
                    }
                )
                if self.scaler is not None:
                    metrics["loss_scale"] = float(self.scaler.get_scale())
                metrics["skipped_steps"] = self.state.skipped_steps
                self._record("train", metrics, log)
                sums, window_start, window_steps, window_paused = {}, time.perf_counter(), 0, 0.0
            paused_from = time.perf_counter()
            last = state.step == o.max_steps
            vi = cfg.validation.interval_steps
            if last or (vi and state.step % vi == 0 and not stop):  # stopping: the save comes first
                last_valid = self.validate(log)
            if cfg.checkpoint.save and (self._save_due(overdue) or last or stop):
                path = self.save()
            self.meter.reset()  # the next step's peak starts here: validation and saves do not count
            window_paused += time.perf_counter() - paused_from
            if stop and not last:
                self.stopped_by = self.stop_signals.name or "a stop signal on another rank"
                saved = f"saved {path}" if cfg.checkpoint.save else "nothing saved (checkpoint.save=false)"
                log.info(f"stopped at step {state.step} on {self.stopped_by}; {saved}")
                break
        if not last_valid and not self.stopped_by:  # resumed at the end: still report the final quality
            last_valid = self.validate(log)
        return last_valid

    def _held_between_steps(self) -> int:
        """Bytes this rank holds right after a step (parameters, optimizer state, persistent buffers)."""
        if self.backend.device.type == "cuda":
            return torch.cuda.memory_allocated(self.backend.device) - self.meter.baseline
        return resident_bytes() - self.meter.baseline

    def _report_memory(self, log: RunLogger) -> None:
        """The fullest rank's measured peak and between-step bytes beside the plan's prediction."""
        if self.held is None:
            return  # resumed at the end: no step ran
        peak, held, total = self.backend.max_over_ranks([self.meter.peak_above_baseline, self.held, self.meter.peak])
        est = self.memory_estimate
        self.memory = {
            "peak_gib": peak / GiB,
            "peak_total_gib": total / GiB,  # with the rank's own baseline (what `top` shows on CPU)
            "predicted_peak_gib": est.peak / GiB,
            "between_steps_gib": held / GiB,
            "predicted_between_steps_gib": est.between_steps / GiB,
        }
        where = "allocator peak" if self.backend.device.type == "cuda" else "peak RSS above the rank's start"
        log.info(
            f"memory per rank (fullest rank): training-step peak {peak / GiB:.2f} GiB ({where}), plan "
            f"{est.peak / GiB:.2f}; held between steps {held / GiB:.2f} GiB, plan {est.between_steps / GiB:.2f}"
        )

    def _step(self) -> tuple[torch.Tensor, bool]:
        """Unscale, clip and apply the accumulated gradients; (the global gradient norm, whether the update was
        skipped for non-finite gradients)."""
        clip = self.cfg.optimization.clip_norm
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.backend.clip_grad_norm(self.model, clip)
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
        else:
            skipped = not math.isfinite(float(grad_norm))
            if not skipped:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm, skipped

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
        started = time.perf_counter()
        for batch in loader:
            with backend.forward_context():
                _, stats = self.task.loss(self.model, batch, backend.device)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + v.detach().float()
        metrics = self.task.summarize(self._sum_over_ranks(sums))
        self._record("valid", {**metrics, "seconds": time.perf_counter() - started}, log)
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

    def _restore(self) -> None:
        """Resume per checkpoint.resume (rank 0 chooses; a torn newest one falls back under auto), else start from
        checkpoint.init_from's weights, else from the seeded init."""
        cfg, backend = self.cfg, self.backend
        self.checkpointer = Checkpointer(self.run_dir / cfg.checkpoint.dir, cfg.checkpoint, backend)
        ignore = self.task.resumable_model_changes

        def check(path: Path) -> dict:
            meta = weights.describe(path)  # reads shardlab.json: an unreadable one is a torn checkpoint
            weights.check_compatible(path, meta, cfg.task.name, self.model_config, ignore)
            return meta

        self.resumed_from = self.checkpointer.restore(
            cfg.checkpoint.resume, check, self.model, self.optimizer, self.state
        )
        self.initialized_from = None
        if self.resumed_from is not None:
            if cfg.checkpoint.init_from:  # a requeued run continues its own checkpoints, not the initial weights
                self.checkpointer.log(f"[ckpt] checkpoint.init_from is not used: resuming {self.resumed_from}")
        elif cfg.checkpoint.init_from:
            self.initialized_from = self._init_from(Path(cfg.checkpoint.init_from).expanduser())
        if cfg.checkpoint.save_on_error and backend.env.world_size > 1 and backend.env.is_main:
            print(
                "[ckpt] checkpoint.save_on_error applies at world size 1 only: an error on one rank cannot save "
                "through collectives the others never join",
                flush=True,
            )

    def _init_from(self, path: Path) -> Path:
        """checkpoint.init_from: weights only, refused in one line if another task or model shape; agreed over ranks."""
        error: BaseException | None = None
        try:
            info = weights.describe(path)
            weights.check_compatible(
                path, info, self.cfg.task.name, self.model_config, self.task.resumable_model_changes
            )
        except Exception as e:
            error = e
        if self.backend.any_rank(error is not None)[0]:
            raise (
                error
                if isinstance(error, CheckpointError)
                else CheckpointError(f"checkpoint.init_from: {path} was refused on another rank; see its message")
            )
        try:
            weights.load_into(self.model, path)
        except Exception as e:
            error = e
        if self.backend.any_rank(error is not None)[0]:
            reason = first_cause(error) if error is not None else "failed on another rank"
            raise CheckpointError(
                f"checkpoint.init_from: {path} could not be loaded ({reason}); give a .safetensors file from "
                "tools/consolidate.py or an intact step_N directory"
            ) from error
        return path

    def _save_overdue(self) -> bool:
        """checkpoint.interval_minutes passed since the last save, on rank 0's clock (the others say no)."""
        minutes = self.cfg.checkpoint.interval_minutes
        return minutes > 0 and self.backend.env.is_main and time.monotonic() - self.last_save[1] >= 60 * minutes

    def _save_due(self, overdue: bool) -> bool:
        """interval_steps, keep_every_steps milestones, or ``overdue`` (interval_minutes, agreed by all ranks)."""
        c, step = self.cfg.checkpoint, self.state.step
        return bool(
            (c.interval_steps and step % c.interval_steps == 0)
            or (c.keep_every_steps and step % c.keep_every_steps == 0)
            or overdue
        )

    def _save_after_error(self, error: BaseException, log: RunLogger) -> None:
        """checkpoint.save_on_error: best effort at world size 1, where no other rank can be left in a collective.
        Otherwise only a save already in flight is completed, where that needs no collective."""
        c = self.cfg.checkpoint
        unsaved = self.last_save[0] != self.state.step
        if not (c.save and c.save_on_error and self.backend.env.world_size == 1 and unsaved):
            self.checkpointer.abandon(self.cfg.distributed.timeout_s)
            return
        try:
            path = self.save()
            self.checkpointer.finish()
            log.info(f"[ckpt] saved {path} after {type(error).__name__} at step {self.state.step + 1}; re-raising it")
        except BaseException as e:  # noqa: B036  (best effort: the original error is what the user must see)
            log.info(f"[ckpt] save after {type(error).__name__} failed too ({first_cause(e)})")

    def save(self) -> Path:
        self.last_save = (self.state.step, time.monotonic())
        described = {  # what the checkpoint is of, for checks and tools; the resumable state is self.state
            "task": self.cfg.task.name,
            "model_config": self.model_config,
            "world_size": self.backend.env.world_size,
            "backend": self.backend.name,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }
        return self.checkpointer.save(self.model, self.optimizer, self.state, described)
