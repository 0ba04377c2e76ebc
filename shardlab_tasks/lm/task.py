"""Causal language modelling: next-token cross-entropy on fixed-length blocks of a preprocessed corpus, or, with
data.format=chat or prompt_completion, supervised fine-tuning on the answer tokens of packed records
(shardlab_tasks/lm/finetuning/sft.py)."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardlab.config import as_container
from shardlab.distributed.compile import compiled
from shardlab.errors import CheckpointError, ConfigError, DataError
from shardlab.registry import MODELS
from shardlab.task import ExpertLayers, PipelineCut, Task, setting
from shardlab_tasks.lm.config import ModelSection
from shardlab_tasks.lm.corpus import mixture
from shardlab_tasks.lm.corpus.cache import corpus_sources, read_corpus_meta
from shardlab_tasks.lm.corpus.data import open_splits, prepare_corpus
from shardlab_tasks.lm.corpus.tokenizer import load_tokenizer
from shardlab_tasks.lm.finetuning.sft import FORMATS, answer_loss, answer_token_loss, open_sft_splits
from shardlab_tasks.lm.finetuning.sft_template import find_chat_template
from shardlab_tasks.lm.hf.hf_models import IGNORED_CHECKPOINT_KEYS, apply_pretrained, expert_pieces, weight_names
from shardlab_tasks.lm.loss import token_cross_entropy
from shardlab_tasks.lm.models.architecture import LMArchitecture
from shardlab_tasks.lm.models.context_parallel import SequenceBatch
from shardlab_tasks.lm.models.moe_balance import StepLoad
from shardlab_tasks.lm.models.moe_metrics import add_routing_loss, routing_metrics
from shardlab_tasks.lm.sft_packing import IGNORE, real_positions, rounded_up


def padded_vocab(vocab_size: int) -> int:
    """Round the embedding up to a multiple of 64: faster matmuls, and shardable over many ranks."""
    return (vocab_size + 63) // 64 * 64


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits (batch, seq, vocab) against the next tokens, computed in fp32."""
    return token_cross_entropy(logits, targets)


def record_lora_base(cfg, pretrained: Path | None) -> None:
    """With LoRA on, model.lora.base_digest := the digest of the frozen base (model.pretrained's folder, else
    checkpoint.init_from) as it is at this start, saved with every checkpoint's config: a resume and the merged
    export compare it with the base they read (shardlab_tasks.lm.models.lora.base_refusal), and a config that already
    records one (a checkpoint's, rebuilt by generate or evaluate) is refused here when the base differs. None where the
    base cannot be read: the load refuses it in its own words."""
    from shardlab_tasks.lm.models.lora import base_refusal, lora_on

    if not lora_on(as_container(cfg.model)):
        return
    from shardlab.checkpoint.hf_folder import weights_digest  # after: it imports DCP, which a plain run reads later

    base = pretrained or setting(cfg.checkpoint, "init_from")
    try:
        digest = weights_digest(Path(base)) if base and Path(base).expanduser().exists() else None
    except CheckpointError:
        digest = None
    from omegaconf import OmegaConf, open_dict

    if reason := base_refusal(as_container(cfg.model), digest, str(base), "the run"):
        raise CheckpointError(f"{reason}; put the base it began from back at that path")
    if not OmegaConf.is_config(cfg):  # typed: the schema has the key
        cfg.model.lora.base_digest = digest
        return
    with open_dict(cfg):  # a config read back from an older checkpoint has no such key yet
        cfg.model.lora.base_digest = digest


class LanguageModelingTask(Task):
    unit = "tokens"
    resumable_model_changes = ("dropout", "lora")
    """model.lora may differ from the weights a run begins from (checkpoint.init_from a run without LoRA); a resume of
    the same run still compares the whole config (shardlab.cli.run_names)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        # model.pretrained decides the model section and the tokenizer, so it is read first; a config.json field the
        # architectures cannot express stops the run here, before any weight is read.
        self.pretrained = apply_pretrained(cfg) if setting(cfg.model, "pretrained") else None
        record_lora_base(cfg, self.pretrained)
        # Loaded here, before any data or model work, so a bad tokenizer file stops the run in its first second.
        # setting: configs stored in checkpoints written before data.eod_token existed lack the key.
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, setting(cfg.data, "eod_token"))
        self.vocab_size = setting(cfg.model, "vocab_size") or padded_vocab(self.tokenizer.vocab_size)
        # Fine-tuning records (data.format); setting: configs stored by older checkpoints lack the keys.
        self.sft = setting(cfg.data, "format", "text") != "text"
        self.chat_template = find_chat_template(cfg.data.chat_template, cfg.data.tokenizer) if self.sft else None
        self.mixture: mixture.Mixture | None = None
        """data.sources' corpora once prepare_data opened them (shardlab_tasks/lm/corpus/mixture.py); None: one
        corpus."""
        moe = setting(cfg.model, "moe")
        self.step_load = StepLoad(moe) if moe is not None else None
        """An MoE model's per-step expert load, for what follows each optimizer step (after_update)."""

    @property
    def model_section(self) -> ModelSection:
        """The model section as plain dicts, for the helpers that read it by key (LoRA, the Hugging Face names), which
        also read a checkpoint's recorded dict: the run's typed section (a dataclass) has no keys."""
        return as_container(self.cfg.model)

    @property
    def architecture(self) -> type[LMArchitecture]:
        """The model.arch class: builds the model and says how to check, initialise and shard it."""
        arch = MODELS.get(self.cfg.model.arch, key="model.arch")
        if not (isinstance(arch, type) and issubclass(arch, LMArchitecture)):
            raise ConfigError(
                f"model.arch: '{self.cfg.model.arch}' is not a language-model architecture (a subclass of "
                "shardlab_tasks.lm.models.architecture.LMArchitecture, docs/tutorial.md); "
                "pick a model=gpt_* or model=llama_* flavor"
            )
        return arch

    def config_errors(self) -> list[str]:
        m, d = self.cfg.model, self.cfg.data
        try:
            arch = self.architecture
        except ConfigError as e:
            return [str(e)]
        keys = set(as_container(m))
        ignored = sorted(keys - arch.config_keys())
        missing = sorted(arch.config_keys() - keys)
        if ignored or missing:  # e.g. model=gpt_tiny model.arch=llama: the section is another architecture's
            return [
                f"model.arch={m.arch} reads the keys of {arch.config_class.__name__}, but the model section "
                + (f"has keys it ignores ({', '.join(ignored)})" if ignored else "")
                + (" and " if ignored and missing else "")
                + (f"lacks {', '.join(missing)}" if missing else "")
                + f"; choose a model={m.arch}_* flavor instead of overriding model.arch"
            ]
        errors = arch.config_errors(m)
        max_seq_len = m.max_seq_len
        if d.seq_len < 1 or d.seq_len > max_seq_len:
            errors.append(
                f"data.seq_len ({d.seq_len}) must be in [1, model.max_seq_len={max_seq_len}]; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        if self.vocab_size < self.tokenizer.vocab_size:
            errors.append(
                f"model.vocab_size ({self.vocab_size}) is smaller than the vocabulary of data.tokenizer "
                f"({self.tokenizer.name}: {self.tokenizer.vocab_size} tokens); use model.vocab_size=null to follow it"
            )
        if not 0 <= d.valid_percent < 100:
            errors.append(f"data.valid_percent must be in [0, 100), got {d.valid_percent}")
        if d.max_corpus_mb < 0:
            errors.append(f"data.max_corpus_mb must be >= 0 (0 = all), got {d.max_corpus_mb}")
        if d.num_preprocess_workers < -1:
            errors.append(
                f"data.num_preprocess_workers must be >= -1 (-1 = one per core), got {d.num_preprocess_workers}"
            )
        errors += self.pretrained_errors() + self.lora_errors() + self.sft_errors() + mixture.mixture_errors(d)
        errors += self.pipeline_errors()
        # A path with no corpus is refused before the run folder is written (listed, not read); beside data.sources
        # the path is refused already, so its tree is not walked (data.path=/tmp took 23 s to say so).
        if d.path is not None and not setting(d, "sources"):
            try:
                corpus_sources(d.path)
            except DataError as e:
                errors.append(str(e))
        return errors

    def pretrained_errors(self) -> list[str]:
        """model.pretrained: a folder to train from needs weights and a tokenizer (a config.json alone plans)."""
        if self.pretrained is None:
            return []
        from shardlab.checkpoint.hf_folder import weight_files

        errors = []
        if self.cfg.checkpoint.init_from:
            errors.append("model.pretrained and checkpoint.init_from both give the starting weights; keep one")
        if not setting(self.cfg, "dry_run"):
            if not weight_files(self.pretrained):
                errors.append(
                    f"model.pretrained: {self.pretrained} holds no .safetensors weights; a config.json alone plans "
                    "(dry_run=true)"
                )
            if self.cfg.data.tokenizer == "byte":
                errors.append(
                    f"model.pretrained: {self.pretrained} has no tokenizer.json; add it, or set data.tokenizer"
                )
        return errors

    def pipeline_errors(self) -> list[str]:
        """distributed.pipeline_parallel_degree > 1: what the LM's pipeline cut cannot carry (yet)."""
        if setting(self.cfg.distributed, "pipeline_parallel_degree", 1) == 1:
            return []
        m, d = self.cfg.model, self.cfg.data
        tied, data_format, moe = setting(m, "tie_embeddings", False), setting(d, "format"), setting(m, "moe")
        return [message for refused, message in (
            (tied, "model.tie_embeddings: the embedding (first pipeline stage) and the head "
             "(last stage) would share one weight across ranks; set model.tie_embeddings=false to pipeline"),
            (self.sft and setting(d, "pack", True), f"data.format={data_format} with data.pack=true: packed rows' "
             "segments (each sample's attention and positions) do not travel between pipeline stages yet; set "
             "data.pack=false (a sample per row) or distributed.pipeline_parallel_degree=1"),
            (moe is not None, "model.moe: the pipeline stages do not carry the MoE blocks' auxiliary loss and "
             "routing statistics yet; use distributed.pipeline_parallel_degree=1 (and split experts with "
             "distributed.expert_parallel_degree)"),
            (bool(setting(d, "sources")), "data.sources: a mixture's per-source validation does not run through the "
             "pipeline yet; train on one corpus or use distributed.pipeline_parallel_degree=1"),
        ) if refused]  # fmt: skip

    def lora_errors(self) -> list[str]:
        """model.lora: a valid rank, alpha and dropout, and target patterns that each select a linear layer."""
        lora = setting(self.cfg.model, "lora")
        if not lora:
            return []
        from shardlab_tasks.lm.models.lora import lora_errors

        if lora.rank <= 0:  # off, or refused by its rank alone: no model to build (on meta it imports torch._dynamo)
            return lora_errors(self.cfg.model, [])
        with torch.device("meta"):  # shapes only: cheap at any size
            model = self.architecture(self.cfg.model, self.vocab_size)
        return lora_errors(self.cfg.model, [n for n, m in model.named_modules() if isinstance(m, nn.Linear)])

    def checkpointed_keys(self):
        """With LoRA on, only the adapters: the frozen base comes back from model.pretrained or checkpoint.init_from
        (or the seeded init) at every start."""
        from shardlab_tasks.lm.models.lora import is_adapter, lora_on

        return is_adapter if lora_on(self.model_section) else None

    def checkpoint_refusal(self, path: Path, saved_model_config: dict, use: str) -> str | None:
        """model.lora: a LoRA step folder holds its adapters alone (shardlab_tasks/lm/models/lora.py's
        checkpoint_refusal)."""
        from shardlab_tasks.lm.models.lora import checkpoint_refusal

        current = self.model_section
        return checkpoint_refusal(path, saved_model_config, current, use)

    def sft_errors(self) -> list[str]:
        """data.format and what fine-tuning records need: a chat template for chat, a model that takes segments for
        packed rows."""
        d = self.cfg.data
        if setting(d, "format", "text") not in FORMATS:
            return [f"data.format={d.format!r} is not a data format; known: {', '.join(FORMATS)}"]
        if not self.sft:
            return []
        errors = []
        if d.format == "chat" and self.chat_template is None:
            errors.append(
                "data.format=chat needs a chat template: set data.chat_template (a tokenizer_config.json or .jinja "
                "file; a model folder's chat_template.jinja is found beside data.tokenizer), or use "
                "data.format=prompt_completion"
            )
        return errors + self.pack_errors()

    def pack_errors(self) -> list[str]:
        """data.pack=true needs a model that takes segments (a packed row's sample ids)."""
        if self.cfg.data.pack and "segments" not in inspect.signature(self.architecture.forward).parameters:
            return [
                f"data.pack: model.arch={self.cfg.model.arch} takes no segments (a packed row's sample ids), so "
                "samples would attend to each other; set data.pack=false"
            ]
        return []

    def pretrained_keys(self):
        """With model.pretrained: every parameter the folder fills (all but LoRA adapters, which keep their seeded
        init); load_pretrained refuses a folder that lacks one, so none is left as allocated."""
        if self.pretrained is None or setting(self.cfg, "dry_run"):
            return None
        section = self.model_section
        names = weight_names(section)  # the base's parameters: a LoRA adapter has no name here
        names |= expert_pieces(section)
        return lambda name: name in names

    def load_pretrained(self, model: nn.Module, device: torch.device) -> Path | None:
        """model.pretrained's weights into the wrapped, materialized model, each rank reading only its slices."""
        if self.pretrained is None:
            return None
        from shardlab.checkpoint.hf_folder import load_hf_folder
        from shardlab_tasks.lm.models.lora import is_adapter

        section = self.model_section
        names = weight_names(section)
        # A LoRA model's adapters are not in the folder: they keep their init (B = 0, so the model starts as the base).
        # An MoE model's grouped experts are read expert by expert, each rank only the experts it holds.
        ignored, pieces = IGNORED_CHECKPOINT_KEYS, expert_pieces(section)
        load_hf_folder(model, self.pretrained, names, device, ignored, lambda name: not is_adapter(name), pieces)
        return self.pretrained

    def prepare_data(self) -> None:
        if self.sft:
            d = self.cfg.data
            self.sft_splits = open_sft_splits(d, self.tokenizer, self.chat_template, d.pack)
            self.train_dataset, self.valid_dataset = self.sft_splits.train, self.sft_splits.valid
            return
        if setting(self.cfg.data, "sources"):  # a weighted mixture: each corpus its own cache, mixed by the data order
            self.mixture = mixture.open_mixture(self.cfg.data, self.tokenizer)
            self.train_dataset, self.valid_dataset = self.mixture.train, self.mixture.valid
            return
        self.corpus_dir = corpus = self.corpus()
        self.meta = read_corpus_meta(corpus)
        self.train_dataset, self.valid_dataset = open_splits(corpus, self.cfg.data.seq_len)

    def corpus(self) -> Path:
        """The preprocessed corpus of data.* (built on first use, then read from data.cache_dir)."""
        d = self.cfg.data
        return prepare_corpus(
            d.path,
            d.cache_dir,
            self.tokenizer,
            d.valid_percent,
            d.max_corpus_mb,
            # Named jsonl_field before Parquet and Arrow came; absent from configs of older checkpoints (generate.py
            # reloads those).
            setting(d, "text_field", setting(d, "jsonl_field", "text")),
            setting(d, "num_preprocess_workers", -1),
            build_max_mb=setting(d, "build_cache_max_mb", 0.0),  # absent from older checkpoints' configs: no limit
        )

    @property
    def sample_name(self) -> str:
        if self.sft:
            return f"rows of data.seq_len={self.cfg.data.seq_len} tokens (packed samples)"
        return f"blocks of data.seq_len={self.cfg.data.seq_len} tokens"

    def more_samples_hint(self, split: str) -> str:
        if self.sft:
            return f"{'raise data.valid_percent, or ' if split == 'validation' else ''}add records to data.path"
        more = "raise data.valid_percent, " if split == "validation" else ""
        return f"{more}lower data.seq_len, or add text to data.path"

    def data_identity(self) -> str:
        if self.sft:
            s = self.sft_splits
            return (
                f"{len(s.train)} train / {len(s.valid)} valid rows of {len(s.train.samples)} / "
                f"{len(s.valid.samples)} samples, {s.train.answer_tokens:,} answer tokens to train on "
                f"({s.cut.count} cut to data.seq_len, {s.dropped.count} without an answer token left out, "
                f"{s.skipped.count} bad records skipped)"
            )
        if self.mixture is not None:
            return self.mixture.identity()
        # The tokens' own hash where the cache has one, so node-local copies of one corpus (other paths or mtimes,
        # hence another cache name) agree; caches written before it existed compare by their name.
        content = self.meta.get("content_digest") or f"cache {self.corpus_dir.name}"
        return f"{self.meta['train_tokens']:,} train / {self.meta['valid_tokens']:,} valid tokens ({content})"

    def data_summary(self) -> str | None:
        """Fine-tuning records are read at every start (no cache to print it once): what became of them."""
        if not self.sft:
            return None
        d = self.cfg.data
        return self.sft_splits.summary(d.path or "the embedded demo (this Python's standard library)", d.seq_len)

    def build_model(self) -> nn.Module:
        model = self.architecture(self.cfg.model, self.vocab_size)
        from shardlab_tasks.lm.models.lora import apply_lora, lora_on

        if lora_on(self.model_section):  # adapters swapped in on meta, before sharding; the rest frozen
            apply_lora(model, self.cfg.model.lora)
        return model

    def init_tensor(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        from shardlab_tasks.lm.models.lora import init_adapter, is_adapter

        if is_adapter(name):
            init_adapter(name, tensor, generator)
        else:
            self.architecture.init_tensor(self.cfg.model, name, tensor, generator)

    model_parallel_axes = ("tp", "pp", "cp")

    def tensor_parallel_plan(self, model: nn.Module) -> dict | None:
        """The architecture's plan (shardlab_tasks/lm/models/tensor_parallel.py), its logits left split over the
        vocabulary under distributed.loss_parallel (every loss here takes them: shardlab_tasks/lm/loss.py), its
        LoRA-adapted layers split with their adapters."""
        from shardlab.distributed.tensor_parallel import loss_parallel_on
        from shardlab_tasks.lm.models.lora import lora_on
        from shardlab_tasks.lm.models.tensor_parallel import vocabulary_split_logits, with_adapters

        plan = model.tensor_parallel_plan()
        if plan is not None and loss_parallel_on(self.cfg):
            plan = vocabulary_split_logits(plan)
        return with_adapters(plan, model) if plan is not None and lora_on(self.model_section) else plan

    def tensor_parallel_errors(self, degree: int) -> list[str]:
        """An architecture without a plan, the sizes the degree must divide, and the rows' length: sequence
        parallelism gives each tensor-parallel rank an equal slice of every row's positions (an uneven split breaks
        its collectives; rows cut shorter are rounded up to the degree: sequence_multiple)."""
        arch, m = self.architecture, self.cfg.model
        if arch.tensor_parallel_plan is LMArchitecture.tensor_parallel_plan:
            return [
                f"distributed.tensor_parallel_degree ({degree}): model.arch={m.arch} has no tensor-parallel plan "
                "(LMArchitecture.tensor_parallel_plan; shardlab_tasks/lm/models/tensor_parallel.py has GPT's and "
                "Llama's); "
                "set it to 1"
            ]
        rows = [] if self.cfg.data.seq_len % degree == 0 else [
            f"data.seq_len ({self.cfg.data.seq_len}) must be a multiple of distributed.tensor_parallel_degree "
            f"({degree}): sequence parallelism splits every row's positions evenly over the tensor-parallel ranks"
        ]  # fmt: skip
        return arch.tensor_parallel_errors(m, self.vocab_size, degree) + rows

    def sequence_shards(self, batch: torch.Tensor, device: torch.device):
        """Context parallelism: a block as (inputs, targets, positions) split along the sequence
        (shardlab_tasks/lm/models/context_parallel.py)."""
        from shardlab_tasks.lm.models.context_parallel import sequence_shards

        return sequence_shards(batch, device)

    def context_parallel_errors(self, degree: int) -> list[str]:
        """A length the load balancer cannot cut, fine-tuning rows, a mixture, dropout; a subclass with a loss of its
        own (the preference task's) too."""
        from shardlab_tasks.lm.models.context_parallel import context_parallel_errors

        own_loss = type(self).loss is not LanguageModelingTask.loss
        takes_positions = "positions" in inspect.signature(self.architecture.forward).parameters
        return context_parallel_errors(self.cfg, degree, preference=own_loss, takes_positions=takes_positions)

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every MoE block's routed experts (shardlab_tasks/lm/moe_experts.GroupedExperts): split by
        distributed.expert_parallel_degree."""
        from shardlab_tasks.lm.models.moe_experts import GroupedExperts

        return [module for module in model.modules() if isinstance(module, GroupedExperts)]

    def expert_parallel_errors(self, degree: int) -> list[str]:
        """A dense model, and an expert count the degree does not divide."""
        moe = setting(self.cfg.model, "moe")
        if moe is None:
            return [
                f"distributed.expert_parallel_degree ({degree}) needs a mixture-of-experts model (model.moe, e.g. "
                "model=moe_tiny); this one is dense: set it to 1"
            ]
        if moe.num_experts % degree:
            return [
                f"distributed.expert_parallel_degree ({degree}) must divide model.moe.num_experts ({moe.num_experts}):"
                " each rank of the group holds as many experts"
            ]
        return []

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        return model.fsdp_units()

    def expert_layers(self, model: nn.Module) -> ExpertLayers | None:
        """model.moe: every block's routed experts (shardlab_tasks/lm/moe_experts.GroupedExperts), each token's
        data.seq_len rows through each of them."""
        moe = setting(self.cfg.model, "moe")
        if moe is None:
            return None
        grouped = ("experts.gate_up_proj", "experts.down_proj")
        names = tuple(name for name, _ in model.named_parameters() if name.endswith(grouped))
        layers = len(names) // len(grouped)
        return ExpertLayers(layers, moe.num_experts, moe.top_k, self.cfg.model.dim, self.cfg.data.seq_len, names)

    def collate(self, samples: list) -> torch.Tensor:
        """Unpacked fine-tuning rows (data.pack=false: a sample each, padded at its end) cut to the micro-batch's
        longest sample, not data.seq_len: no step computes padding past it. The cut rounds up to a multiple of
        distributed.tensor_parallel_degree: sequence parallelism splits rows evenly or its collectives disagree."""
        batch = super().collate(samples)
        # (not through a pipeline: its stages exchange activations of the shape their first micro-batch had)
        if self.sft and not self.cfg.data.pack and setting(self.cfg.distributed, "pipeline_parallel_degree", 1) == 1:
            batch = batch[..., : rounded_up(int(real_positions(batch).max()), self.sequence_multiple)].contiguous()
        return batch

    @property
    def sequence_multiple(self) -> int:
        """What a cut row's length is rounded up to: the tensor-parallel degree, whose ranks each hold an equal slice
        of every row's positions between layers (sequence parallelism; an uneven split breaks its collectives)."""
        return setting(self.cfg.distributed, "tensor_parallel_degree", 1)

    def example_batch(self, batch_size: int) -> torch.Tensor:
        if self.sft:  # rows of (inputs, targets, segments): shardlab_tasks/lm/sft_packing.py
            return torch.zeros(batch_size, 3, self.cfg.data.seq_len, dtype=torch.long, device="meta")
        return torch.zeros(batch_size, self.cfg.data.seq_len + 1, dtype=torch.long, device="meta")

    def loss(self, model: nn.Module, batch: torch.Tensor, device: torch.device):
        """The token loss, plus an MoE model's auxiliary loss and routing statistics
        (shardlab_tasks/lm/models/moe_metrics.py)."""
        return add_routing_loss(model, *self.token_loss(model, batch, device), self.cfg.model, self.step_load)

    def after_update(self, model: nn.Module, all_reduce_sum, applied: bool) -> list[str]:
        """An MoE model's bias balancing and idle-expert warning (shardlab_tasks/lm/models/moe_balance.py)."""
        return self.step_load.after_update(model, all_reduce_sum, applied) if self.step_load is not None else []

    def token_loss(self, model: nn.Module, batch: torch.Tensor, device: torch.device):
        if self.sft:
            return answer_token_loss(model, batch, device, self.cfg.data.pack)
        if isinstance(batch, list):  # a mixture's validation batch: [tokens, each row's source]
            return mixture.mixture_valid_loss(model, batch, device, self.mixture.names)
        if isinstance(batch, SequenceBatch):  # context parallelism: this rank's slice of each sequence
            return self.pipeline_loss(model(batch.inputs, positions=batch.positions), batch.targets)
        inputs, targets = self.pipeline_batch(batch, device)
        return self.pipeline_loss(model(inputs), targets)

    def pipeline_cut(self) -> PipelineCut:
        """Blocks split over the stages; the embedding on the first, final norm and head (and the loss) on the last."""
        return PipelineCut(layers="blocks", num_layers=self.cfg.model.num_layers, first=("embed",), last=("head",))

    def pipeline_batch(self, batch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(input tokens, next tokens) of a block of data.seq_len + 1 tokens; fine-tuning (unpacked rows, a sample
        each: pipeline_errors): (input tokens, answer targets, IGNORE elsewhere)."""
        batch = batch.to(device, non_blocking=True)
        if self.sft:
            inputs, targets, _ = batch.unbind(1)  # the sample's padding follows it: the causal kernel, no segments
            return inputs, targets
        return batch[:, :-1], batch[:, 1:]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor):
        """Mean next-token cross-entropy, and its sum and count for summarize; fine-tuning: over the answer tokens."""
        if self.sft:
            return answer_loss(logits, targets)
        # distributed.compile: one fused kernel casts and reduces the logits, without an fp32 copy of them in memory
        # (the memory plan's shape-only pass on meta stays eager; configs stored by older checkpoints lack the key)
        # (not for logits split over the vocabulary, distributed.loss_parallel: each rank's fp32 copy is already 1/tp
        # of them, and the compiled loss over loss_parallel's DTensor op handlers is not exercised here)
        fuse = setting(self.cfg.distributed, "compile", False) and logits.device.type != "meta"
        fuse = fuse and not isinstance(logits, DTensor)
        loss = (compiled(next_token_loss) if fuse else next_token_loss)(logits, targets)
        n = targets.numel()
        return loss, {"loss_sum": loss.detach() * n, "count": torch.tensor(float(n))}

    def loss_count(self, batch: torch.Tensor) -> float | None:
        """Fine-tuning: the answer tokens of the rows, which differ from batch to batch, so a step's gradient is the
        mean over all answer tokens of its global batch (Task.loss_count). Pretraining: None, every block holds
        data.seq_len targets and every rank's micro-batch as many blocks, so the means weigh alike already."""
        if not self.sft:
            return None
        return float((batch[:, 1] != IGNORE).sum())

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        routing = routing_metrics(sums)  # an MoE model's: aux_loss and each layer's expert load
        if self.mixture is not None and any(k.startswith("count/") for k in sums):  # validation of a mixture
            return mixture.summarize_sources(sums, self.mixture.names, self.mixture.weights) | routing
        loss = sums["loss_sum"] / max(sums["count"], 1)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))} | routing

    def train_order(self, seed: int):
        if (
            self.mixture is not None
        ):  # each global sample offset -> a source and a block of it (shardlab_tasks/lm/corpus/mixture.py)
            return self.mixture.order(seed)
        return super().train_order(seed)

    def plan_lines(self) -> list[str]:
        return mixture.plan_lines(self.cfg, self.tokenizer) if setting(self.cfg.data, "sources") else []

    def num_units(self, batch: torch.Tensor) -> int:
        """Tokens that carry loss or attention: a fine-tuning row's padding is not counted."""
        if self.sft:
            return int(real_positions(batch).sum())
        if isinstance(batch, SequenceBatch):  # context parallelism: the tokens of this rank's slices
            return batch.targets.numel()
        return batch.shape[0] * (batch.shape[1] - 1)

    def evaluation(self):
        """shardlab-evaluate's perplexity and lm-evaluation-harness (shardlab_tasks/lm/evaluation.py)."""
        from shardlab_tasks.lm.evaluation import LMEvaluation

        return LMEvaluation(self)
