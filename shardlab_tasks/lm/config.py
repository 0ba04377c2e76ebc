"""The causal language-model task and its GPT architecture: their config schemas and registrations. Light on purpose:
imported at start-up for every run (the task and model modules load when first built). Architectures: GPT-2
(shardlab_tasks/lm/model.py) and Llama-style (shardlab_tasks/lm/llama.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardlab.config import TaskConfig, choice, registry_name
from shardlab.registry import MODELS, TASKS


# ---- LoRA (issue 40): one section, model.lora, read by both architectures (shardlab_tasks/lm/lora.py) --------------
@dataclass
class LoraConfig:
    rank: int = 0
    """Rank r of each low-rank adapter (A: in -> r, B: r -> out, peft's r); 0 = LoRA off: every weight trains."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on each adapter's input, in training only (peft's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: ["attn.*"])
    """Name patterns (fnmatch, matched against a module's name or its dotted tail) of the nn.Linear layers to adapt:
    attn.* = every attention projection (Llama's q, k, v, o; GPT's qkv, proj); mlp.* the MLP; blocks.0.attn.q one."""
    base_digest: str | None = None
    """Written by the run, not set by hand: a digest of the frozen base's weight files (names, sizes, header bytes),
    saved in each checkpoint's config; a resume and the merged export refuse a base whose digest differs."""


@dataclass
class GPTConfig:
    arch: str = registry_name("gpt", "MODELS")
    """A name in MODELS: a model architecture for the LM task (gpt, or one of a user_dir)."""
    num_layers: int = 4
    """Transformer blocks."""
    dim: int = 256
    """Residual stream width."""
    num_heads: int = 4
    """Attention heads; must divide dim."""
    mlp_ratio: float = 4.0
    """MLP hidden width as a multiple of dim."""
    max_seq_len: int = 256
    """Positions in the learned position embedding; data.seq_len must not exceed it."""
    vocab_size: int | None = None
    """Token vocabulary; null = the tokenizer's size (rounded up to a multiple of 64 for fast matmuls)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches."""
    init_std: float = 0.02
    """Std of the normal init of weights; residual projections are scaled by 1/sqrt(2 * num_layers)."""
    pretrained: str | None = None
    """A Hugging Face model folder (config.json, safetensors, tokenizer.json) to start from; docs/finetuning.md."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters: with lora.rank > 0 only they train, the rest is frozen (docs/finetuning.md, LoRA)."""


@dataclass
class RopeScalingConfig:
    rope_type: str = choice("llama3", ("llama3",))
    """How the rotary frequencies are stretched for long context: llama3 (Llama 3.1's) is the one implemented."""
    factor: float = 8.0
    """Low frequencies are divided by it."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept; between, interpolated."""
    original_max_position_embeddings: int = 8192
    """The context the model was pretrained with before scaling."""


# ---- Mixture of experts (issue 49): model.moe, read by shardlab_tasks/lm/moe.py; null = a dense MLP in every block ---
@dataclass
class MoEConfig:
    num_experts: int = 8
    """Routed experts per MoE layer (Mixtral's num_local_experts, Qwen's num_experts, DeepSeek's n_routed_experts)."""
    top_k: int = 2
    """Experts each token is sent to (num_experts_per_tok)."""
    ffn_dim: int = 256
    """Hidden width of each routed expert's SwiGLU (Qwen/DeepSeek moe_intermediate_size; Mixtral intermediate_size)."""
    score_func: str = choice("softmax", ("softmax", "sigmoid"))
    """Router scores over the logits: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the k chosen weights to sum to 1 (Mixtral always; Qwen and DeepSeek per their config)."""
    routed_scaling: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek-V3's routed_scaling_factor, 2.5)."""
    num_groups: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3's n_group); 1 = none."""
    topk_groups: int = 1
    """Groups a token may choose experts from (topk_group); must be <= num_groups."""
    shared_ffn_dim: int = 0
    """Hidden width of the always-on shared SwiGLU expert(s), all shared experts as one; 0 = none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(linear(token)) (Qwen2-MoE's shared_expert_gate)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in the training loss (router_aux_loss_coef: Mixtral 0.02, Qwen 0.001)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss, mean logsumexp(logits)^2 (ST-MoE uses 1e-3); 0 = off."""
    score_bias: bool = False
    """A per-expert bias added to the scores when choosing experts only (DeepSeek-V3's e_score_correction_bias)."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing: after each step the bias moves by this rate toward equal load (DeepSeek-V3:
    1e-3); 0 = the bias stays as loaded. Needs score_bias."""
    idle_expert_warning_steps: int = 100
    """Print a warning line when an expert has received no token on any rank for this many optimizer steps in a row
    (shardlab_tasks/lm/moe_balance.py); 0 = never."""
    capacity_factor: float | None = None
    """Each expert takes at most factor * tokens * top_k / experts assignments per batch, the rest dropped; null =
    no token is dropped."""
    experts_impl: str = choice("auto", ("auto", "grouped_mm", "loop"))
    """How the experts run: auto (grouped_mm where the device and dtype have it, else a loop over experts),
    grouped_mm or loop; all exact (shardlab_bench/moe.py times them)."""


@dataclass
class LlamaConfig:
    arch: str = registry_name("llama", "MODELS")
    """A name in MODELS: a model architecture for the LM task (set by the registration)."""
    num_layers: int = 4
    """Transformer blocks."""
    dim: int = 256
    """Residual stream width."""
    num_heads: int = 4
    """Query heads; with head_dim null must divide dim (head width = dim / num_heads, even: RoPE rotates pairs)."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide num_heads. num_heads = classic multi-head attention."""
    ffn_dim: int | None = None
    """SwiGLU hidden width; null = 8/3 x dim rounded up to a multiple of 64 (the width a 4 x dim GELU MLP costs)."""
    max_seq_len: int = 256
    """Longest sequence the model is trained for (RoPE has no table to outgrow); data.seq_len must not exceed it."""
    vocab_size: int | None = None
    """Token vocabulary; null = the tokenizer's size (rounded up to a multiple of 64 for fast matmuls)."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies (Llama 2: 1e4, Llama 3: 5e5)."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""
    init_std: float = 0.02
    """Std of the normal init of weights; residual projections are scaled by 1/sqrt(2 * num_layers)."""
    head_dim: int | None = None
    """Width of each attention head; null = dim / num_heads (Qwen3 and Mistral set it apart from dim)."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection (Llama 3.2 1B/3B, small Qwen2.5 and Qwen3)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2/2.5; Llama's attention_bias sets it with out_bias)."""
    out_bias: bool = False
    """Bias on the attention output projection (Llama's and Qwen3's attention_bias)."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before RoPE (Qwen3)."""
    rope_scaling: RopeScalingConfig | None = None
    """Rotary frequency scaling for long context (Llama 3.1+: rope_type llama3); null = none."""
    moe: MoEConfig | None = None
    """A mixture-of-experts feed-forward block in place of every block's MLP (docs/models.md); null = dense."""
    pretrained: str | None = None
    """A Hugging Face model folder (config.json, safetensors, tokenizer.json) to start from; docs/finetuning.md."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters: with lora.rank > 0 only they train, the rest is frozen (docs/finetuning.md, LoRA)."""


# ---- Mixtures (issue 42): data.sources, read by shardlab_tasks/lm/mixture.py ---------------------------------------
@dataclass
class LMSourceConfig:
    path: str | None = None
    """The corpus, as data.path takes it (a file, a directory, a glob); null = the embedded corpus."""
    weight: float = 1.0
    """Its share of the training samples, relative to the other sources' weights (0.8 and 0.2, or 4 and 1)."""
    text_field: str | None = None
    """Its JSONL key or Parquet/Arrow column holding the text; null = data.text_field."""


@dataclass
class LMDataConfig:
    path: str | None = None
    """A text, JSONL (.gz, .zst too), Parquet or Arrow file, a directory or glob of them, or a dataset saved by
    datasets' save_to_disk; null = the embedded corpus (this Python's stdlib)."""
    cache_dir: str = "~/.cache/shardlab"
    """Where preprocessed token files are kept (reused across runs)."""
    tokenizer: str = "byte"
    """byte (256 byte values + end-of-document, no dependencies) or the path of a Hugging Face tokenizer.json."""
    eod_token: str | None = None
    """End-of-document token of a tokenizer.json; null = the first it has of <|endoftext|>, </s>, <|end_of_text|>..."""
    text_field: str = "text"
    """The key of each JSONL record, or the Parquet or Arrow column, that holds a document's text."""
    seq_len: int = 256
    """Tokens per training sample."""
    valid_percent: float = 5.0
    """Percent of documents held out for validation (chosen by a hash of the file path)."""
    max_corpus_mb: float = 0.0
    """Cap on text read at preprocessing, in MB (0 = all)."""
    num_preprocess_workers: int = -1
    """Tokenizing processes at preprocessing; -1 = one per CPU core (none for corpora under 16 MB), 0 = in-process."""
    build_cache_max_mb: float = 512.0
    """A corpus larger than this (MB) with no finished cache is not preprocessed by the training job: it stops with
    the shardlab-preprocess command that builds it as many tasks; 0 = build any size here."""
    sources: dict[str, LMSourceConfig] = field(default_factory=dict)
    """A weighted mixture instead of data.path: name -> {path, weight, text_field}, each corpus its own cache
    (docs/corpora.md#mixtures); data.sources='{web: {path: /a, weight: 0.8}, code: {path: /b, weight: 0.2}}'."""
    # Supervised fine-tuning (shardlab_tasks/lm/sft.py, docs/finetuning.md#supervised-fine-tuning)
    format: str = choice("text", ("text", "chat", "prompt_completion", "preference"))
    """text (documents, pretraining), chat (records of role/content messages), prompt_completion (records of a
    prompt and its answer) or preference (prompt/chosen/rejected pairs, DPO: conf/task/dpo.yaml); all but text train
    on answer tokens only; with data.path=null, the stdlib demo."""
    messages_field: str = "messages"
    """data.format=chat: the record's key (or Parquet column) holding its list of {role, content} messages."""
    prompt_field: str = "prompt"
    """data.format=prompt_completion: the record's key (or Parquet column) holding the prompt."""
    completion_field: str = "completion"
    """data.format=prompt_completion: the record's key (or Parquet column) holding the answer."""
    chat_template: str | None = None
    """A tokenizer_config.json with a chat_template, or a .jinja file; null = the tokenizer_config.json beside
    data.tokenizer if it has one, else none (prompt_completion is then joined: prompt + completion + end-of-text)."""
    train_after_end_of_turn: bool = True
    """Whether the whitespace a chat template writes after an answer's end-of-turn token (ChatML's newline after
    <|im_end|>) is trained on; a template with {% generation %} marks decides it itself (transformers' mask)."""
    skip_bad_records: bool = False
    """Skip fine-tuning records that cannot be trained on (empty or null content, an unknown role, no assistant turn),
    counted and named in the start line; false = refuse the first, naming its file:line."""
    pack: bool = True
    """Pack samples (preference pairs: answers) into rows of data.seq_len, attention within each; false: one a row."""
    chosen_field: str = "chosen"
    """data.format=preference: the record's key (or Parquet column) holding the preferred answer (text or messages)."""
    rejected_field: str = "rejected"
    """data.format=preference: the record's key (or Parquet column) holding the dispreferred answer."""


# ---- Preference tuning (issue 48): task.dpo, read by shardlab_tasks/lm/dpo.py; conf/task/dpo.yaml picks the schema ---
@dataclass
class DPOConfig:
    beta: float = 0.1
    """The strength of the pull toward the reference: rewards are beta * (log pi - log pi_ref) (TRL's beta)."""
    loss_type: str = choice("sigmoid", ("sigmoid", "ipo"))
    """sigmoid (DPO) or ipo (IPO, log-ratios averaged over answer tokens), as TRL's DPOTrainer computes them."""
    label_smoothing: float = 0.0
    """loss_type=sigmoid: the assumed share of flipped preference labels (conservative DPO); 0 = plain DPO."""


@dataclass
class LMTaskConfig(TaskConfig):
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The DPO loss of data.format=preference (docs/finetuning.md#preference-tuning-dpo)."""


ModelSection = Mapping[str, Any]
"""A model section as the LM's helpers read it by key (LoRA, the Hugging Face interop, the MoE hub names): the plain
dict a checkpoint recorded (shardlab.json's model_config) and the export reads back, a DictConfig, or the task's
section as plain dicts (``LanguageModelingTask.model_section``: the run's typed section, a dataclass, has no keys)."""

ModelConfig = Any
"""The model section as the task holds it (Task.cfg.model), read by attribute: in a run the typed section, an instance
of the architecture's config_class (GPTConfig, LlamaConfig, a user_dir's); in the pre-flight's checks and in the tools
that read a run back (shardlab_commands), a DictConfig (carrying that schema, or none: a recorded config)."""


TASKS.register_lazy("lm", "shardlab_tasks.lm.task_choice:build_lm_task", dataclass=LMTaskConfig, data=LMDataConfig)
MODELS.register_lazy("gpt", "shardlab_tasks.lm.models.model:GPT", dataclass=GPTConfig)
MODELS.register_lazy("llama", "shardlab_tasks.lm.models.llama:Llama", dataclass=LlamaConfig)
