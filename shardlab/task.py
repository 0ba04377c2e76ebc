"""The Task interface: everything model- and data-specific the trainer needs, and nothing the trainer owns.

A task plug-in (shardlab_tasks/<name>/) subclasses Task and registers a factory in TASKS from its light config module.

Task.cfg, the config a task reads, is one of two kinds, and task code reads both alike (by attribute; a key an older
run's record may lack through ``setting``; a section as plain dicts through shardlab.config.as_container):

- in a run, the run's config typed (shardlab.config.TrainConfig: the dataclasses of the schemas, made once per run by
  shardlab.trainer.run_config), handed to the task by the trainer's assemble (``Task.use_config``): the task's config
  is then the trainer's, the backend's and the checkpointer's, the one object the run trains with and records, and
  what the task writes into it (fit_validation_batch's validation.batch_size) is what the run uses;
- before that (the pre-flight's checks, the memory plan, backend=auto's choice) and in the tools that read a finished
  run back (shardlab_commands: evaluate, generate, export, consolidate), the composed or recorded DictConfig it was
  built from. A recorded config is untyped on purpose: it may hold a key removed since, and lack one added since.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Dataset

from shardlab.config import TrainConfig
from shardlab.data import GlobalOrder

RunConfig = TrainConfig | DictConfig
"""The config a task reads (Task.cfg), by attribute: the run's TrainConfig, or the composed or recorded DictConfig (the
module's docstring)."""


def setting(section: Any, key: str, default: Any = None) -> Any:
    """``section.key``, or ``default`` where ``section`` lacks the key: task code's one tolerant read. The run's typed
    config has every key its schema declares, but a tool's task is built from a config an older run recorded, without
    the keys added since (data.eod_token, data.format, ...), and a section without a schema (a user_dir's) holds only
    the keys given. ``section``: a dataclass or a DictConfig (whose missing key raises an AttributeError)."""
    return getattr(section, key, default)


@dataclass(frozen=True)
class PipelineCut:
    """Where a model may be cut into pipeline stages (Task.pipeline_cut; used by shardlab.distributed.pipeline): its
    ``num_layers`` repeated layers, held in the nn.ModuleList named ``layers``, are split into consecutive groups, one
    per stage; the modules named in ``first`` (the embedding) go with the first stage and those in ``last`` (final
    norm and head) with the last. On a stage without them they are replaced by nn.Identity, so the model's own forward
    must pass its input through when ``first`` is an identity (a later stage receives hidden states) and return the
    hidden states when ``last`` is. Every kept module keeps its name, so a stage's state-dict keys are the unsplit
    model's."""

    layers: str
    num_layers: int
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertLayers:
    """A model's mixture-of-experts layers as the memory plan sees them (Task.expert_layers; planned by
    shardlab.memory.experts): which parameters are routed experts, and what each token sends to them."""

    num_layers: int
    """MoE layers in the model."""
    num_experts: int
    """Routed experts per layer."""
    top_k: int
    """Experts each token is sent to."""
    dim: int
    """Width of a token row dispatched to an expert (the residual stream)."""
    tokens_per_sample: int
    """Token rows each sample sends through every MoE layer (the sequence length)."""
    expert_params: tuple[str, ...]
    """Names (model.named_parameters) of the routed experts' weights, each of shape (num_experts, rows, width): what
    expert parallelism splits by its first dimension."""


@dataclass(frozen=True)
class SequenceShards:
    """A batch laid out for context parallelism (Task.sequence_shards): ``buffers`` are its tensors that have a
    sequence dimension (``seq_dims``, one each: inputs, targets, positions), which torch's context_parallel shards in
    place over the "cp" ranks (shardlab.distributed.context_parallel); ``batch`` is what Task.loss then takes, holding
    those same tensors, so the loss sees each rank's slice. Every buffer has its own storage (not a view of another)."""

    batch: Any
    buffers: tuple[torch.Tensor, ...]
    seq_dims: tuple[int, ...]


@dataclass(frozen=True)
class EvaluationRequest:
    """What shardlab-evaluate hands a task's Evaluation.evaluate: the command has parsed its arguments, built the
    task and knows the weights; the evaluation reads the data, runs the model and returns its figures."""

    cfg: DictConfig
    """The config evaluated on: the checkpoint's (or the composed one), with the command line's data.* overrides."""
    modes: tuple[str, ...]
    """The evaluations asked for, each one of Evaluation.modes (the command's option, by its argparse name)."""
    settings: Any
    """The command's parsed options (argparse.Namespace: split, batch_size, device, seed, and the probes' and the
    harness's own). What the evaluation settles for itself (the split it judged on) it sets here, where --out
    records it."""
    info: dict | None
    """The checkpoint's description (its step), or None: weights without a checkpoint (seeded, model.pretrained)."""
    model: Callable[[], nn.Module]
    """The model with its weights, in eval mode on the CPU; loaded on the first call, which prints what is evaluated
    (an evaluation of an export never calls it)."""
    data_task: Callable[[], Task]
    """The task of ``cfg`` (checked), built on the first call: its data, where the command line chose other data
    than the model was trained on."""
    export: Callable[[Path], None] | None
    """Writes the checkpoint's Hugging Face export (shardlab-export) into a folder; None without a checkpoint."""


class Evaluation(ABC):
    """How shardlab-evaluate evaluates a task's models (Task.evaluation): which evaluations there are, and each run
    on the data the command line names. shardlab_commands/evaluate.py parses, builds the task, loads the weights and
    prints and writes the figures; everything that knows the task's data and metrics is here."""

    modes: tuple[str, ...] = ()
    """The evaluations offered, by the command's option (linear, knn, perplexity, lm_eval); one asked for outside
    them is refused, naming these. A mode the command has no option for runs only as one of default_modes."""
    default_modes: tuple[str, ...] = ()
    """Those run when none is asked for."""
    report_leaves_out: tuple[str, ...] = ()
    """Keys of evaluate's answer that --out's JSON leaves out (the harness's per-sample records)."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def data_config(self, cfg: DictConfig, trained: dict | None, described: Path | None) -> None:
        """Complete ``cfg`` (the data.* of the command line merged over a checkpoint's config, whose data paths
        shardlab-evaluate has reset: a checkpoint's config never names what is read) before its task is built.
        ``trained``: the checkpoint's data section as saved (its paths too: never to be read), None without a
        checkpoint; ``described``: the file that holds it, for errors."""
        return None  # the default: a task whose evaluation takes the data section as the command line gives it

    def settle(self, modes: tuple[str, ...], settings: Any) -> None:
        """Resolve the settings left at their None defaults for ``modes`` (the split) and refuse a combination the
        evaluation cannot run, in one line; asked before any weight is read."""
        return None  # the default: nothing left to resolve, every offered mode runs with any settings

    @abstractmethod
    def evaluate(self, request: EvaluationRequest) -> dict[str, Any]:
        """Run ``request.modes``, print a line of figures for each, and return them (JSON-able)."""


class Task(ABC):
    unit = "samples"
    """What throughput counts (tokens for the LM, images for vision)."""
    num_workers = 0
    """DataLoader worker processes per rank; 0 reads in the training process (enough for memory-mapped tokens)."""
    model_parallel_axes: tuple[str, ...] = ()
    """The mesh axes beyond data parallelism this task's models can split over ("tp", "pp", "cp"); the pre-flight
    refuses a degree above 1 on any other (vision models stay data-parallel)."""
    resumable_model_changes: tuple[str, ...] = ("dropout",)
    """Model config keys that may differ between a checkpoint and the run resuming it (no effect on shapes)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg: RunConfig = cfg
        """The config this task reads (the module's docstring): the DictConfig it was built from (the pre-flight's,
        a tool's), until a run hands it its typed config (``use_config``)."""
        self.train_dataset: Dataset | None = None
        self.valid_dataset: Dataset | None = None

    def use_config(self, cfg: RunConfig) -> None:
        """From now on read and write ``cfg``: the run's typed config, which the trainer, the backend and the
        checkpointer hold, handed by shardlab.trainer.assemble before the data is opened (once per run, and per trial
        of backend=auto: each trial its own). Before that, shardlab.runner hands a task the pre-flight built (from its
        own composition of the command line) the rank's composed DictConfig, into which backend=auto's layout is
        written and from which the run's config is typed. Each has the values of the one before it, what the task
        wrote while it was built included (the LM's model.pretrained: the folder's model section), so a task that
        keeps values derived from its config (a tokenizer, the vocabulary size) keeps them."""
        self.cfg = cfg

    def config_errors(self) -> list[str]:
        """Task-specific config problems (model/data sections); each names its dotted key. Asked once per start, by
        shardlab.cli.checks before anything is written; the ranks do not ask again."""
        return []

    def world_errors(self, world_size: int) -> list[str]:
        """Problems of the config with ``world_size`` ranks (a group size that must divide it), asked with
        config_errors by shardlab.cli.checks: the world is known before any rank starts."""
        return []

    @abstractmethod
    def prepare_data(self) -> None:
        """Preprocess (cached) and open train_dataset / valid_dataset. Every rank calls it before the process group
        exists, all at once: work shared between processes (a corpus cache) must be safe to start concurrently."""

    def data_errors(self) -> list[str]:
        """Problems the opened data shows against the config, found before the first step on every rank: each split
        must fill one global batch (a validation split smaller than validation.batch_size would end the run at its
        first validation, and again after every resume; fit_validation_batch lowers it first where it can). An empty
        validation split is no problem with validation off (validation.interval_steps=0): there is none."""
        o, v = self.cfg.optimization, self.cfg.validation
        errors = []
        for split, dataset, key, batch in (
            ("training", self.train_dataset, "optimization.batch_size", o.batch_size),
            ("validation", self.valid_dataset, "validation.batch_size", v.batch_size),
        ):
            if split == "validation" and dataset is not None and len(dataset) == 0:
                if v.interval_steps:
                    errors.append("the validation split is empty (data.valid_percent=0 holds none out): set "
                                  "validation.interval_steps=0 to train on every record without validation, or "
                                  f"{self.more_samples_hint(split)}")  # fmt: skip
                continue
            if dataset is not None and len(dataset) < batch:
                errors.append(
                    f"{key} ({batch}) is more than the {len(dataset)} {self.sample_name} of the {split} split; lower "
                    f"{key} or {self.more_samples_hint(split)}"
                )
        return errors

    def fit_validation_batch(self, readers: int) -> str | None:
        """validation.batch_size lowered to the most that a validation split smaller than it fills (a multiple of
        ``readers``, the ranks that read different samples), and the line that says so; None where it fits, or where
        not even ``readers`` samples are there (data_errors then says so)."""
        v = self.cfg.validation
        held = len(self.valid_dataset) if self.valid_dataset is not None else 0
        fitted = held // readers * readers
        if held >= v.batch_size or fitted == 0:
            return None
        line = (f"validation.batch_size={v.batch_size} lowered to {fitted}: the validation split holds {held} "
                f"{self.sample_name}")  # fmt: skip
        v.batch_size = fitted
        return line

    sample_name = "samples"
    """What one sample is, in error messages (the LM: blocks of data.seq_len tokens)."""

    def more_samples_hint(self, split: str) -> str:
        """How to give ``split`` (training or validation) more samples, for error messages."""
        return f"give the {split} split more data"

    def data_identity(self) -> str:
        """What this rank opened, in a line that every rank must produce alike (shardlab.distributed.join compares
        them before training): by default the sizes of the splits."""
        return f"{len(self.train_dataset)} train / {len(self.valid_dataset)} valid samples"

    def data_summary(self) -> str | None:
        """What the opened data holds, printed once by rank 0 before the model is built, for data opened in memory at
        every start (the LM's fine-tuning records: read, held out, cut, dropped); None where the data says it when it
        is built (the LM's corpus cache prints its counts once, as it preprocesses)."""
        return None

    def train_order(self, seed: int) -> GlobalOrder:
        """The order training reads train_dataset in, by global sample offset (shardlab.data): a seeded permutation
        each epoch; a task that mixes datasets by weight orders them itself (the LM's data.sources)."""
        return GlobalOrder(len(self.train_dataset), seed, shuffle=True)

    def plan_lines(self) -> list[str]:
        """Lines of the task's own in dry_run's plan (the LM's mixture: each source's tokens, weight and epochs)."""
        return []

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The model with shapes only (called under the meta device)."""

    @abstractmethod
    def init_tensor(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full value of the parameter or buffer ``name`` in place (see shardlab.distributed.materialize)."""

    def load_pretrained(self, model: nn.Module, device: torch.device) -> Any | None:
        """Load the weights the task's config starts from (the LM's model.pretrained) into the wrapped, materialized
        model, on every rank; returns where they came from, or None: the seeded init stands. Asked by the restore
        when the run resumes nothing and has no checkpoint.init_from."""
        return None

    def pretrained_keys(self) -> Callable[[str], bool] | None:
        """The parameter and buffer names that every start of a run fills from a file before anything reads them: a
        fresh start through load_pretrained, a resume from its checkpoint (and, for keys checkpointed_keys leaves out,
        load_pretrained again). The trainer does not draw their seeded init (shardlab.distributed.materialize). None:
        every tensor is initialised. A name the file may lack (an adapter, a new head, a buffer it does not hold)
        must not be in it."""
        return None

    def checkpointed_keys(self) -> Callable[[str], bool] | None:
        """Which model state-dict keys step folders hold, or None: all. A task that freezes weights it reads at every
        start (the LM's LoRA: its base, from model.pretrained or checkpoint.init_from) keeps them out of checkpoints;
        the restore reads them again from their source."""
        return None

    def checkpoint_refusal(self, path: Any, saved_model_config: dict, use: str) -> str | None:
        """Why the checkpoint ``path``, saved with the model section ``saved_model_config``, cannot serve this run as
        ``use`` ("resume": its training state; "init_from": its weights) beyond what shardlab compares (task, model
        keys outside resumable_model_changes): one line naming the key and the fix, or None. Asked by the restore
        before any tensor is read (the LM's LoRA step folders hold adapters only)."""
        return None

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """Submodules to shard as separate FSDP units, in forward order; the root is wrapped last by the backend.
        Empty means: let the backend's generic policy decide."""
        return []

    def pipeline_cut(self) -> PipelineCut | None:
        """How the model is cut into pipeline stages (distributed.pipeline_parallel_degree > 1), or None: the task's
        model cannot be pipelined (the pre-flight refuses the degree). A task that returns a cut also implements
        pipeline_batch and pipeline_loss."""
        return None

    def pipeline_batch(self, batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first stage's input, the last stage's targets) of a local batch, on ``device``."""
        raise NotImplementedError(f"task {self.cfg.task.name} has no pipeline cut")

    def pipeline_loss(self, output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """On the last pipeline stage: (mean loss of one micro-batch, its sums for ``summarize``), as ``loss`` gives
        for the whole model."""
        raise NotImplementedError(f"task {self.cfg.task.name} has no pipeline cut")

    def expert_layers(self, model: nn.Module) -> ExpertLayers | None:
        """``model``'s mixture-of-experts layers for the memory plan (total against active parameters, experts per
        expert-parallel rank, dispatch buffers, all-to-all traffic); None (the default): a dense model."""
        return None

    def tensor_parallel_plan(self, model: nn.Module) -> dict | None:
        """How ``model`` (built on meta) splits over distributed.tensor_parallel_degree ranks, as data: module paths
        (``*`` for any one name) to torch ParallelStyles (ColwiseParallel, RowwiseParallel, SequenceParallel,
        PrepareModuleInput), which the fully_sharded backend applies before activation checkpointing, compile and
        FSDP (shardlab.distributed.tensor_parallel). None (the default): the task cannot use tensor parallelism, and
        the pre-flight refuses a degree above 1."""
        return None

    def tensor_parallel_errors(self, degree: int) -> list[str]:
        """Why the model cannot split over ``degree`` tensor-parallel ranks (a head count, a width or the vocabulary
        it does not divide), each line naming the key; asked by the pre-flight when the degree is above 1 and the
        task has a plan."""
        return []

    def sequence_shards(self, batch: Any, device: torch.device) -> SequenceShards:
        """``batch`` on ``device`` as the tensors context parallelism splits along the sequence and the batch the loss
        takes (SequenceShards); asked per micro-batch when distributed.context_parallel_degree > 1, of tasks with "cp"
        in model_parallel_axes only. The model must take the positions it is given (each rank holds a load-balanced,
        non-contiguous slice of each sequence) and attend causally through scaled_dot_product_attention's is_causal."""
        raise NotImplementedError(f"task {self.cfg.task.name} cannot split its sequences (no 'cp' axis)")

    def context_parallel_errors(self, degree: int) -> list[str]:
        """Why this run's model or data cannot split each sequence over ``degree`` ranks (a length that the load
        balancer cannot cut evenly, an attention mask the ring has no rule for), each line naming the key; asked by
        the pre-flight when the degree is above 1 and "cp" is in model_parallel_axes."""
        return []

    def after_update(
        self, model: nn.Module, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], applied: bool
    ) -> list[str]:
        """Called on every rank after each optimizer step (``applied``: its update was not skipped), with the
        backend's sum over the data-parallel ranks, for what a task changes outside autograd between steps (an MoE
        router's balancing bias); the lines it returns rank 0 prints. Must decide the same on every rank."""
        return []

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` (built on meta) holding routed experts along dim 0 of each of their own
        parameters, which distributed.expert_parallel_degree splits over its group; each must exchange its tokens over
        the group the backend sets as its ``expert_group`` (shardlab/distributed/expert_parallel.py). [] (the
        default): the task has no experts, and the pre-flight refuses a degree above 1."""
        return []

    def expert_parallel_errors(self, degree: int) -> list[str]:
        """Why the model cannot split its experts over ``degree`` ranks, each line naming the key; asked by the
        pre-flight when the degree is above 1."""
        return [
            f"distributed.expert_parallel_degree ({degree}): task {self.cfg.task.name}'s models have no experts to "
            "split; set it to 1"
        ]

    def full_precision_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules that must compute in fp32 whatever distributed.param_dtype says (e.g. BatchNorm). fully_sharded
        gives each its own FSDP unit with an fp32 mixed-precision policy; autocast backends leave them to autocast."""
        return []

    def example_batch(self, batch_size: int) -> Any | None:
        """A batch of ``batch_size`` samples with the shapes and dtypes training sees, on the meta device, for the
        memory plan's activation count (shardlab.memory.plan); None leaves activations out of the plan."""
        return None

    def collate(self, samples: list) -> Any:
        return torch.utils.data.default_collate(samples)

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(mean loss to backpropagate, sums to aggregate over ranks and batches for ``summarize``)."""

    def loss_count(self, batch: Any) -> float | None:
        """How many terms the mean loss of ``batch`` (read, not yet on the device) averages, where that differs from
        batch to batch (the LM's fine-tuning: the answer tokens of its rows). The trainer then weighs each micro-batch
        by its share of the step's count over all micro-batches and ranks (one all-reduce per step), so the step's
        gradient is the mean over every term of the global batch, whatever the world size and update_freq. None (the
        default): every micro-batch holds as many terms, and their means weigh alike."""
        return None

    @abstractmethod
    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from summed statistics (e.g. loss and perplexity); ``sums['count']`` is the number of units."""

    def num_units(self, batch: Any) -> int:
        """Throughput units in a local batch."""
        return len(batch)

    def training_state(self, train_state: Any, device: torch.device) -> Any | None:
        """State the task keeps from one training step to the next besides the weights (SwAV's feature queue), or
        None: an object with state_dict()/load_state_dict() whose tensors the checkpoint manager saves through DCP
        beside the model, so tensors that are DTensors sharded over the ranks reshard to another world size. Called
        once by Trainer.setup, before a resume loads it; ``train_state`` (shardlab.train_state.TrainState) tells the
        step."""
        return None

    def frozen_parameters(self, model: nn.Module, step: int) -> list[nn.Parameter]:
        """Parameters the optimizer step ``step`` (0-based) must leave alone: their gradients are dropped before
        clipping, so the optimizer skips them (no update, weight decay or momentum), e.g. SwAV's prototypes early on."""
        return []

    def features(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """The trunk's pooled features of ``images`` (N, D), in eval mode without gradients: what a frozen-trunk
        evaluation (linear probe, kNN) trains on. Tasks whose models have no image trunk do not implement it."""
        raise NotImplementedError(f"task {self.cfg.task.name} has no image trunk to evaluate")

    def evaluation(self) -> Evaluation | None:
        """How shardlab-evaluate evaluates this task's models (an Evaluation: the LM's perplexity and harness, the
        vision trunks' linear probe and kNN), or None (the default): the command says the task offers none."""
        return None
