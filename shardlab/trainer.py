"""A rank's run: put together in one order (``assemble``), then the training loop: accumulate, (auto)cast and scale,
clip, step, validate, checkpoint, log.

Nothing here knows the task or the backend: the Task supplies model, data and loss; the Backend wraps the model and
decides how gradients are reduced.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig
from omegaconf.errors import MissingMandatoryValue
from torch.profiler import record_function

from shardlab.checkpoint.manager import Checkpointer
from shardlab.checkpoint.policy import SavePolicy, inconsistent_state, save_after_error, save_on_error_notice
from shardlab.checkpoint.readers import dcp_reader
from shardlab.checkpoint.resume import restore_training
from shardlab.cli.run_names import run_key_differences
from shardlab.config import TrainConfig, as_container, typed
from shardlab.data import GlobalOrder, rank_loader, sample_seed, weighted_micro_batches
from shardlab.distributed.base import Backend
from shardlab.distributed.compile import FirstSteps
from shardlab.distributed.materialize import materialize
from shardlab.distributed.pipeline import Pipeline, build_pipeline
from shardlab.distributed.tensor_parallel import loss_parallel_on, split_vocabulary_loss
from shardlab.errors import CheckpointError, ConfigError, RunFolderInUse, one_line
from shardlab.jobs import run_lock, run_record
from shardlab.jobs.preemption import StopSignals, torchrun_agent_warning
from shardlab.logging import RunLogger
from shardlab.logging.throughput import ThroughputWindow
from shardlab.memory.meter import PeakMeter, beside_plan, memory_gib
from shardlab.memory.plan import RunPlan, plan_run
from shardlab.optim import LR_SCHEDULERS, OPTIMIZERS  # importing shardlab.optim registers adamw, sgd, ...
from shardlab.optim.divergence import NonfiniteStreak, nonfinite_cause, require_finite_weights, weights_finite
from shardlab.optim.ema import WeightAverage
from shardlab.optim.schedules import clipped_warmup_line
from shardlab.task import Task
from shardlab.train_state import TrainState


def run_config(cfg: TrainConfig | DictConfig) -> TrainConfig:
    """The run's config as the dataclasses (shardlab.config.typed), made once per run by run_rank and per trial of
    backend=auto: what the backend, the trainer and its checkpointer read. A value left missing (``???``), which no
    check reads and the conversion must, is refused in one line naming its key."""
    try:
        return typed(cfg)
    except MissingMandatoryValue as e:
        key = e.full_key or str(e.key)
        raise ConfigError(f"{key} has no value (???): give it one, {key}=<value>") from None


def assemble(
    cfg: TrainConfig | DictConfig,
    task: Task,
    backend: Backend,
    run_dir: Path,
    *,
    prepare_data: Callable[[], str] | None = None,
    signals: StopSignals | None = None,
    trial: bool = False,
) -> Trainer:
    """A rank's run, put together in the one order that every run (shardlab.runner.run_rank) and every trial of
    distributed.backend=auto (shardlab.runner.autotune) follows; the only place a Trainer is made:

    0. the task handed the run's typed config (``Task.use_config``): the run's one config object from here on;
    1. the process group and the data: ``backend.setup(prepare_data)`` (each rank opens its data before the group
       exists, so preprocessing never runs under distributed.timeout_s; a trial's group and data exist already, so
       only its layout's mesh is made);
    2. precision=auto settled on every rank, and (across hosts) the checkpoint folder checked to be shared;
    3. the model on the meta device (model_on_meta), then the plan of that model (plan_run: its units, the bytes per
       rank), printed before anything is allocated;
    4. the trainer (Trainer.setup): parallelize and materialize, the optimizer, schedule, scaler, task state and EMA,
       the checkpointer, then the restore (checkpoint.resume, else checkpoint.init_from, else the seeded init).

    ``trial``: a backend=auto measurement whose model is thrown away: the seeded init, nothing printed, and the run
    directory not touched (its checkpointer exists but is never written to).

    ``cfg``: the run's config typed (``run_config``: run_rank and autotune's trials pass it so); a caller's composed
    DictConfig (a test's, a benchmark's) is typed here, the one place a run's config enters the trainer."""
    from shardlab.checkpoint.shared import require_shared_folder
    from shardlab.distributed.mesh import placement_warning
    from shardlab.distributed.precision import settle as settle_precision
    from shardlab.distributed.units import model_on_meta

    cfg = run_config(cfg)
    task.use_config(cfg)  # one config in the run: the batch the task fits to its split is the one run and recorded
    env = backend.env
    speaks = env.is_main and not trial
    backend.setup(prepare_data=prepare_data)
    if speaks and (summary := task.data_summary()):
        print(summary, flush=True)
    if (line := settle_precision(cfg.distributed, backend)) and speaks:  # precision=auto: one dtype for all ranks
        print(line, flush=True)
    if backend.network.spans_hosts and not trial:
        require_shared_folder(run_dir / cfg.checkpoint.dir, backend.network.hosts, backend.device)
        if speaks and (line := placement_warning(backend.dims, backend.network.hosts)):  # TP across hosts
            print(line, flush=True)
    plan = plan_run(cfg, task, env.world_size, model_on_meta(task))
    if speaks:
        print("\n".join(plan.lines), flush=True)
        if env.launcher == "torchrun" and (warning := torchrun_agent_warning()):
            print(warning, flush=True)
    # Start-up's collectives (DDP's broadcast, the restore's agreements) wait up to distributed.init_timeout_s; a
    # barrier ends it, so no rank issues a step's collective under timeout_s while another is still starting.
    with backend.long_timeout(cfg.distributed.init_timeout_s):
        trainer = Trainer(cfg, task, backend, run_dir, signals)
        trainer.setup(plan, restore=not trial)
        backend.barrier()
    if speaks:
        print("\n".join(backend.describe()), flush=True)
    return trainer


class Trainer:
    def __init__(
        self, cfg: TrainConfig, task: Task, backend: Backend, run_dir: Path, stop_signals: StopSignals | None = None
    ) -> None:
        self.cfg = cfg
        self.task = task
        self.backend = backend
        self.run_dir = run_dir
        self.state = TrainState()
        self.history: list[dict[str, float]] = []
        """Every logged train/valid record (rank 0 has the global values); tests compare these across backends."""
        self.stop_signals = stop_signals or StopSignals(interrupt=cfg.checkpoint.save_on_error)
        """Installed by run_rank from the rank's start (a signal during start-up stops the run after its first step),
        else by fit."""
        self.phase = "between"
        """Where the loop is, for checkpoint.save_on_error: between steps (the state is the last completed step's),
        forward (this step's micro-batches: only gradients, and train-mode buffers such as BatchNorm statistics,
        change) or update (the optimizer, scaler and schedule are being stepped: neither the last step nor this)."""
        self.stopped_by: str | None = None
        """The stop signal that ended training before optimization.max_steps (after a checkpoint), if one did."""
        self.complete_at: Path | None = None
        """The checkpoint a resume found already at optimization.max_steps: the run was complete before this start,
        so nothing was trained and nothing validated again (the runner says so in one line)."""
        self.loss_finite: torch.Tensor | bool = True
        """Whether every micro-batch loss of the last step on this rank was finite (a tensor: read once, when the
        step's flags are agreed, not after each micro-batch)."""
        self.nonfinite = NonfiniteStreak(cfg.optimization.max_nonfinite_steps)
        """Steps in a row whose loss was not finite on some rank (optimization.max_nonfinite_steps ends the run)."""
        self.pipeline: Pipeline | None = None
        """This rank's pipeline stages and their schedule (distributed.pipeline_parallel_degree > 1; set by setup)."""
        self.loss_parallel = loss_parallel_on(cfg)
        """Whether the task's logits come split over the vocabulary (distributed.loss_parallel under tensor
        parallelism): each micro-batch's forward and backward, and validation, run inside torch's loss_parallel."""

    # ---- setup ---------------------------------------------------------------------------------------------------
    def setup(self, plan: RunPlan, restore: bool = True) -> None:
        """Shard and materialize the planned model (built on meta), build the optimizer and schedule, the checkpointer,
        and restore the training state (checkpoint.resume, else checkpoint.init_from, else the seeded init).
        ``restore=False``: the seeded init, and the run directory is not touched (a trial of backend=auto). Called
        once, by ``assemble``."""
        cfg, backend = self.cfg, self.backend
        self.memory_estimate = plan.estimate
        if backend.env.is_main and cfg.logging.tensorboard:
            importlib.import_module("torch.utils.tensorboard")  # its modules are the logger's, not a step's memory
        self._start_meter()  # before any model memory
        # Weights the restore will read from a file are not drawn first (a trial, restore=False, keeps the seeded init).
        loaded = self.task.pretrained_keys() if restore else None
        materialized = functools.partial(
            materialize, device=backend.param_device, init_fn=self.task.init_tensor, seed=cfg.seed, loaded=loaded
        )
        self.pipeline = self._cut_pipeline(plan, materialized)  # distributed.pipeline_parallel_degree > 1, else None
        if self.pipeline is None:
            full_precision = self.task.full_precision_modules(plan.model)
            tp_plan = self.task.tensor_parallel_plan(plan.model) if backend.dims.tp > 1 else None
            experts = self.task.expert_modules(plan.model) if backend.dims.ep > 1 else ()
            self.model = backend.parallelize(
                plan.model,
                plan.units,
                materialized,
                full_precision_modules=full_precision,
                tensor_parallel_plan=tp_plan,
                expert_modules=experts,
            )
        else:
            self.model = self.pipeline.model  # this rank's stages' layers, under the unsplit model's names
        self.optimizer = self._build_optimizer()
        self.scheduler = LR_SCHEDULERS.build(
            cfg.lr_scheduler.name, self.optimizer, cfg.lr_scheduler, cfg.optimization.max_steps, key="lr_scheduler.name"
        )
        self.scaler = backend.make_grad_scaler()
        self.state.components = {"scheduler": self.scheduler, "grad_scaler": self.scaler}
        task_state = self.task.training_state(self.state, backend.device)  # e.g. SwAV's queue; most tasks: None
        self.state.tensors = {"task": task_state} if task_state is not None else {}
        o = cfg.optimization
        self.ema = WeightAverage(self.model, o.ema, o.max_steps) if o.ema.enabled else None
        if self.ema is not None:  # saved through DCP beside the model, resharded like it (shardlab/optim/ema.py)
            self.state.tensors["ema"] = self.ema
        self.model_config = as_container(cfg.model)
        # From here on every trainer has its checkpointer (a trial's is never written to); constructing it touches
        # no file: the folder is listed by the restore and made by the first save.
        self.checkpointer = Checkpointer(
            self.run_dir / cfg.checkpoint.dir,
            cfg.checkpoint,
            backend,
            folder_lost=lambda: run_lock.lost_now(self.run_dir),
            model_keys=self.task.checkpointed_keys(),
        )
        self.resumed_from = self.initialized_from = None
        if restore:
            self._restore()
        if self.ema is not None and self.initialized_from is not None:  # the average starts at the loaded weights
            self.ema.reset()
        self.save_policy = SavePolicy.from_config(cfg.checkpoint, self.state.step)
        self.global_batch = cfg.optimization.batch_size
        self.train_order = self.task.train_order(cfg.seed)

    def _start_meter(self) -> None:
        """The memory meter's baseline: this rank with its data and the plan's meta-device modules."""
        self.meter = PeakMeter(self.backend.device)
        self.held: int | None = None
        """Bytes above the baseline after the last step of fit (measured once, when the loop ends)."""
        self.memory: dict[str, float] = {}
        """Measured and predicted GiB per rank (the fullest rank's), set at the end of fit."""

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """optimizer.name over the model's parameters, refused if its param groups hold a value checkpoints cannot read
        back."""
        cfg = self.cfg
        optimizer = OPTIMIZERS.build(cfg.optimizer.name, self.model, cfg.optimizer, key="optimizer.name")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        if problem := dcp_reader.values_load_back(groups):
            raise ConfigError(
                f"optimizer.name={cfg.optimizer.name}: its param groups hold a value checkpoints cannot read back "
                f"safely ({problem}); keep them to numbers, strings, bools, tuples and tensors"
            )
        return optimizer

    def _cut_pipeline(self, plan: RunPlan, materialized: Callable[[torch.nn.Module], None]) -> Pipeline | None:
        """With distributed.pipeline_parallel_degree > 1: the planned model (on meta) cut into this rank's pipeline
        stages, each parallelized alone by the backend and materialized (shardlab.distributed.pipeline); else None."""
        if self.cfg.distributed.pipeline_parallel_degree == 1:
            return None
        return build_pipeline(self.cfg, self.task, self.backend, plan.model, plan.units, materialized)

    # ---- loop ----------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to optimization.max_steps, or until a stop signal (then save and set ``stopped_by``)."""
        cfg, is_main = self.cfg, self.backend.env.is_main
        log = RunLogger(cfg.logging, self.run_dir, is_main, cfg.optimization.max_steps, self.state.step, cfg)
        self.checkpointer.log = log.info  # save lines above the progress bar, not through it
        self.stop_signals.install()
        try:
            final = self._fit(log)
            self.checkpointer.finish()  # an asynchronous save still in flight gets its name before we return
            if self.held is not None:  # None: resumed at the end, no step ran
                self.memory, line = beside_plan(self.meter, self.held, self.memory_estimate, self.backend)
                log.info(line)
            log.finish(self.state.step, final, self.checkpointer.newest, stopped=bool(self.stopped_by))
            return final
        except BaseException as error:
            # first: rank 0 reports the rank that failed first; none into a folder another job holds now
            if not is_main and not isinstance(error, (SystemExit, RunFolderInUse)):
                run_record.note_rank_error(self.run_dir, self.backend.env.rank, one_line(error))
            self._save_after_error(error, log)
            raise
        finally:
            self.stop_signals.restore()
            log.close()

    def _fit(self, log: RunLogger) -> dict[str, float]:
        cfg, backend, state = self.cfg, self.backend, self.state
        max_steps = cfg.optimization.max_steps
        if self.resumed_from is not None and state.step >= max_steps:  # complete before this start: nothing to do
            self.complete_at = self.resumed_from
            return {}
        self._announce_start(log)
        loader = self.train_loader()
        window, last_valid = ThroughputWindow(), {}
        compiling = cfg.distributed.compile and state.step < max_steps
        first_steps = FirstSteps(cfg.distributed, backend.process_groups()) if compiling else None
        while state.step < max_steps:
            step_started = time.perf_counter()
            lr, grad_norm = self.train_step(loader, window.sums)
            for line in self.step_notes:  # the task's, after the update (Task.after_update)
                log.info(line)
            if first_steps is not None and (line := first_steps.ended(time.perf_counter() - step_started)):
                log.info(line)  # the compilation's cost, once
            with record_function("shardlab.meter"):
                self.meter.sample()
            window.steps += 1
            log.advance()
            # Agreed at every step end (one all-reduce), so all ranks stop or save at the same step whichever rank got
            # the signal, and a save by the clock follows rank 0's.
            with record_function("shardlab.agree"):
                stop, overdue, lock_lost, nonfinite = backend.any_rank(
                    self.stop_signals.received is not None,
                    self.save_policy.overdue(backend.env.is_main),
                    backend.env.is_main and run_lock.lost(self.run_dir) is not None,  # rank 0 knows: another job's
                    not bool(self.loss_finite),
                )
            if lock_lost:  # another job holds the folder now: hands off it, every rank at this step
                raise RunFolderInUse(run_lock.hands_off_line(self.run_dir, state.step, self.checkpointer.newest))
            self.nonfinite.count(nonfinite, state.step, self.checkpointer.kept, log.info, self._nonfinite_cause)
            last = state.step == max_steps  # the loop's last step: what it holds is what the run holds
            if stop or last:  # bytes held right after a step: parameters, optimizer state, persistent buffers
                self.held = self.meter.held()
            if state.step % cfg.logging.interval_steps == 0 or last:
                self._log_train(window, lr, grad_norm, log)
                window = ThroughputWindow()
            paused_from = time.perf_counter()
            vi = cfg.validation.interval_steps
            if last or (vi and state.step % vi == 0 and not stop):  # stopping: the save comes first
                last_valid = self.validate(log)
            if cfg.checkpoint.save and (self.save_policy.due(state.step, overdue) or last or stop):
                path = self._save_in_loop(must_succeed=last or stop, log=log)
            with record_function("shardlab.meter"):
                self.meter.reset()  # the next step's peak starts here: validation and saves do not count
            window.paused += time.perf_counter() - paused_from
            if stop and not last:
                self._stop(path if cfg.checkpoint.save else None, log)
                break
        return last_valid

    def _announce_start(self, log: RunLogger) -> None:
        """Where training starts from; weights from checkpoint.init_from are validated before training moves them."""
        state = self.state
        if line := clipped_warmup_line(self.cfg.lr_scheduler, self.cfg.optimization.max_steps):
            log.info(line)
        if self.resumed_from is not None:
            log.info(f"resumed from {self.resumed_from} (step {state.step}, {state.samples_seen} samples seen)")
        elif self.initialized_from is not None:
            log.info(f"initialized from {self.initialized_from} (step 0, fresh optimizer)")
            self.validate(log)  # the loaded weights' quality, before training moves them

    def _log_train(self, window: ThroughputWindow, lr: float, grad_norm: torch.Tensor, log: RunLogger) -> None:
        """The train line of the window's steps: the task's metrics (one all-reduce), throughput, memory, scaler."""
        with record_function("shardlab.log"):  # the metrics' all-reduce and the line (also: _record)
            totals = self._sum_over_ranks(window.sums)
        metrics = self.task.summarize(totals)
        metrics.update({"lr": lr, "gnorm": float(grad_norm), **window.rates(totals["units"], self.task.unit)})
        metrics["mem_gib"] = memory_gib(self.backend.device)
        if self.scaler is not None:
            metrics["loss_scale"] = float(self.scaler.get_scale())
        metrics["skipped_steps"] = self.state.skipped_steps
        with record_function("shardlab.log"):
            self._record("train", metrics, log)

    def train_step(self, loader, sums: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
        """One optimizer step: the micro-batches' forward and backward, clipping, the update, and the training state
        moved on. Adds each statistic of the task's loss (and the units processed) to ``sums``; returns the learning
        rate the step used and the global gradient norm."""
        cfg, backend, o = self.cfg, self.backend, self.cfg.optimization
        self.model.train()
        # Per-step seeding: dropout draws from (seed, global offset of this rank's first sample of the step), so a
        # resumed run draws the same masks as an uninterrupted one without storing RNG state. Augmentation is
        # seeded per sample by the data loader (shardlab.data), independently of the world size.
        first_sample = self.state.samples_seen + backend.dp_rank * (self.global_batch // backend.dp_world_size)
        with record_function("shardlab.seed"):
            torch.manual_seed(sample_seed(cfg.seed + 1, first_sample))
        self.phase = "forward"  # what save_on_error may save depends on where an error came (_save_after_error)
        micro_batches = weighted_micro_batches(
            loader, o.update_freq, self.task.loss_count, backend.all_reduce_sum, backend.dp_world_size, backend.device
        )
        if self.pipeline is not None:  # the schedule runs the micro-batches' forward and backward over the stages
            self._pipeline_micro_batches([next(micro_batches) for _ in range(o.update_freq)], sums)
        else:
            for micro in range(o.update_freq):
                batch, weight = next(micro_batches)
                with (
                    backend.grad_sync(self.model, micro == o.update_freq - 1),
                    split_vocabulary_loss(self.loss_parallel),
                    self._sequence_split(batch) as batch,
                ):
                    with backend.forward_context():
                        loss, stats = self.task.loss(self.model, batch, backend.device)
                    finite = torch.isfinite(loss.detach()).all()
                    self.loss_finite = finite if micro == 0 else self.loss_finite & finite
                    scaled = loss / o.update_freq if weight is None else loss * weight
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                with record_function("shardlab.metrics"):
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0) + v.detach().float()
                    sums["units"] = sums.get("units", 0) + self.task.num_units(batch)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses (_step advances the schedule)
        self.phase = "update"
        grad_norm, skipped = self._step()
        self.step_notes = self.task.after_update(self.model, backend.all_reduce_sum, applied=not skipped)
        self.state.end_step(self.global_batch * o.update_freq, skipped)
        self.phase = "between"
        return lr, grad_norm

    def _pipeline_micro_batches(self, weighted: list, sums: dict[str, torch.Tensor]) -> None:
        """A step's micro-batches (with their weights: shardlab.data.weighted_micro_batches) through the pipeline
        (shardlab.distributed.pipeline): the losses and sums are the last stage's, zeros on the other ranks, so the
        logged all-reduce counts each micro-batch once."""
        batches, weights = (list(part) for part in zip(*weighted, strict=True))
        # a weight is the micro-batch's loss terms x per_term (the same for the step's micro-batches): the pipeline's
        # loss, which sees targets and not which micro-batch they are, multiplies its own count by per_term
        per_term = None
        if weights[0] is not None:  # from the micro-batch with the most terms (none may hold any on this rank)
            count, weight = max(zip(map(self.task.loss_count, batches), weights, strict=True), key=lambda p: p[0])
            # The weights' count was summed over the pipeline axis too (mesh.ParallelDims.loss_dims, where the loss
            # sums are the last stage's alone), but every stage read the same samples: each term counted pp times.
            per_term = weight / max(count, 1) * self.backend.dims.pp
        with self.backend.forward_context(), split_vocabulary_loss(self.loss_parallel):  # the schedule's backward too
            losses, stats = self.pipeline.train_step(batches, per_term)
        self.loss_finite = (
            torch.stack([torch.isfinite(loss.detach()).all() for loss in losses]).all() if losses else True
        )
        with record_function("shardlab.metrics"):
            for k, v in stats.items():
                sums[k] = sums.get(k, 0) + v
            units = sum(self.task.num_units(batch) for batch in batches) if self.pipeline.is_last else 0
            sums["units"] = sums.get("units", 0) + units

    @contextlib.contextmanager
    def _sequence_split(self, batch):
        """distributed.context_parallel_degree > 1: the micro-batch as the task lays it out for context parallelism,
        its sequences sharded over the "cp" ranks and attention run as torch's ring while the block (forward and
        backward) runs (shardlab.distributed.context_parallel); else ``batch`` itself."""
        if self.backend.dims.cp == 1:
            yield batch
            return
        from shardlab.distributed.context_parallel import sequence_sharded

        shards = self.task.sequence_shards(batch, self.backend.device)
        method = self.cfg.distributed.context_parallel_rotate_method
        with sequence_sharded(self.backend.mesh["cp"], shards.buffers, shards.seq_dims, method):
            yield shards.batch

    def train_loader(self):
        """This rank's training batches from the run's data position on (shardlab.data)."""
        return iter(self._loader(self.task.train_dataset, self.train_order, self.state.samples_seen, self.global_batch))

    def _loader(self, dataset, order: GlobalOrder, start: int, batch_size: int, num_batches: int | None = None):
        """This rank's share of ``batch_size``-sample global batches of ``dataset`` in ``order`` from sample ``start``
        on (shardlab.data.rank_loader)."""
        b, task = self.backend, self.task
        return rank_loader(
            dataset, order, start, batch_size, b.dp_rank, b.dp_world_size, num_batches=num_batches,
            collate_fn=task.collate, num_workers=task.num_workers,
        )  # fmt: skip

    def _step(self) -> tuple[torch.Tensor, bool]:
        """Unscale, clip and apply the accumulated gradients; (the global gradient norm, whether the update was
        skipped for non-finite gradients)."""
        clip = self.cfg.optimization.clip_norm
        for param in self.task.frozen_parameters(self.model, self.state.step):
            param.grad = None  # skipped by clipping and the optimizer alike
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = (self.pipeline or self.backend).clip_grad_norm(self.model, clip)  # a pipeline's: over all stages
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
        if self.ema is not None:  # every step, skipped or not: the same count of updates at any world size
            self.ema.update(self.state.step)
        return grad_norm, skipped

    @torch.no_grad()
    def validate(self, log: RunLogger) -> dict[str, float]:
        cfg, backend = self.cfg, self.backend
        dataset = self.task.valid_dataset
        if not len(dataset):  # data.valid_percent=0 with validation off (Task.data_errors): nothing held out
            return {}
        vb = cfg.validation.batch_size  # the task's config too (assemble): as fit_validation_batch left it
        available = len(dataset) // vb
        num_batches = min(cfg.validation.num_batches or available, available)
        self.model.eval()
        loader = self._loader(dataset, GlobalOrder(len(dataset), cfg.seed, shuffle=False), 0, vb, num_batches)
        sums: dict[str, torch.Tensor] = {}
        started = time.perf_counter()
        averaged = self.ema.swapped_into(self.model) if cfg.validation.ema else contextlib.nullcontext()
        with averaged, split_vocabulary_loss(self.loss_parallel):
            for batch in loader:
                with backend.forward_context():
                    if self.pipeline is not None:  # forward only, through the stages; the last stage's sums
                        stats = self.pipeline.evaluate(batch)
                    else:
                        with self._sequence_split(batch) as batch:
                            _, stats = self.task.loss(self.model, batch, backend.device)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0) + v.detach().float()
        metrics = self.task.summarize(self._sum_over_ranks(sums))
        self._record("valid", {**metrics, "seconds": time.perf_counter() - started}, log)
        return metrics

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _restore(self) -> None:
        """The training state from the folder's run, checkpoint.resume, checkpoint.init_from or the seeded init
        (shardlab.checkpoint.resume); a rollback goes into status.json."""
        cfg, backend = self.cfg, self.backend
        self.resumed_from, self.initialized_from = restore_training(
            cfg, self.checkpointer, self.model, self.optimizer, self.state, backend, model_config=self.model_config,
            resumable_changes=self.task.resumable_model_changes, run_key_differences=run_key_differences,
            load_pretrained=lambda: self.task.load_pretrained(self.model, backend.device),
            refusal=self.task.checkpoint_refusal,
        )  # fmt: skip
        if self.checkpointer.rollback is not None and backend.env.is_main:
            run_record.update(self.run_dir, rollback=self.checkpointer.rollback)
        if (notice := save_on_error_notice(cfg.checkpoint, backend.env.world_size)) and backend.env.is_main:
            print(notice, flush=True)

    def _sum_over_ranks(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """One all-reduce of every statistic (packed in one tensor); the task turns the totals into metrics."""
        keys = sorted(sums)
        packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).cpu() for k in keys])
        total = self.backend.all_reduce_sum(packed.to(self.backend.device)).cpu()
        return {k: float(v) for k, v in zip(keys, total, strict=True)}

    def _record(self, split: str, metrics: dict[str, float], log: RunLogger) -> None:
        self.history.append({"split": split, "step": self.state.step, **metrics})
        log.log(split, self.state.step, metrics)

    def _nonfinite_cause(self) -> str:
        """The diverged run's advice, by what it found (shardlab.optim.divergence.nonfinite_cause)."""
        rates = [group["lr"] for group in self.optimizer.param_groups]
        return nonfinite_cause(rates, lambda: weights_finite(self.model, self.backend.any_rank))

    def _stop(self, path: Path | None, log: RunLogger) -> None:
        """The loop stops before optimization.max_steps on a stop signal, after this step's save (``path``; None
        without checkpoint.save), and sets ``stopped_by``."""
        (signum,) = self.backend.max_over_ranks([float(self.stop_signals.received or 0)])  # which one, agreed
        self.stop_signals.agree(int(signum))
        self.stopped_by = self.stop_signals.name  # its own signal, or "<SIG> (on another rank)"
        saved = f"saved {path}" if self.cfg.checkpoint.save else "nothing saved (checkpoint.save=false)"
        log.info(f"stopped at step {self.state.step} on {self.stopped_by}; {saved}")

    def _save_in_loop(self, must_succeed: bool, log: RunLogger) -> Path | None:
        """A save of the loop. One that fails (a full disk, a quota: raised on every rank alike) keeps the previous
        checkpoint; a periodic one then reports in one line and training goes on to try again at the next save, so
        what was trained is not lost to a passing problem. The last save, and the save of a stop, must succeed."""
        try:
            return self.save()
        except CheckpointError as e:
            if must_succeed:
                raise
            log.info(f"[ckpt] WARNING: {e}; training goes on and tries again at the next save")
            self.save_policy.failed()  # interval_minutes: not again at every step
            if self.backend.env.is_main:
                run_record.update(self.run_dir, save_error=str(e))
            return None

    def _save_after_error(self, error: BaseException, log: RunLogger) -> None:
        """checkpoint.save_on_error (shardlab.checkpoint.policy.save_after_error): the last completed step, if what
        is in memory is still that step's."""
        world, step = self.backend.env.world_size, self.state.step

        def why_not() -> str | None:  # asked only when a save would be made
            return inconsistent_state(error, self.phase, world, step, self.checkpointer.kept(), self.model)

        save_after_error(
            error, self.cfg.checkpoint, self.save_policy, step, why_not, self.checkpointer, self.save,
            self.cfg.distributed.timeout_s, log.info,
        )  # fmt: skip

    @functools.cached_property
    def config_record(self) -> dict:
        """The composed config's keys, order and values, as each checkpoint records them: made at the first save, not
        at each (~20 ms)."""
        return as_container(self.cfg)

    def save(self) -> Path:
        """Save this step: every save comes here (the loop's, a stop's, the last, save_on_error's), and none is
        made of weights that are not finite."""
        require_finite_weights(self.model, self.backend.any_rank, self.state.step, self.checkpointer.kept)
        described = {  # what the checkpoint is of, for checks and tools; the resumable state is self.state
            "task": self.cfg.task.name,
            "model_config": self.model_config,
            "world_size": self.backend.env.world_size,
            "backend": self.backend.name,
            "config": self.config_record,
        }
        path = self.checkpointer.save(self.model, self.optimizer, self.state, described)
        self.save_policy.saved(self.state.step)
        return path
