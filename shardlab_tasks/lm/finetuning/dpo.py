"""Preference tuning: the DPO loss on chosen/rejected pairs (data.format=preference, conf/task/dpo.yaml), as TRL's
DPOTrainer computes it.

Each answer's log-probability is the sum over its answer tokens (shardlab_tasks/lm/finetuning/preference.py marks them)
of the model's log-probability of the token; the chosen and rejected answers of a micro-batch go through the model in
one forward, each in a row of its own, or with data.pack=true packed into shared rows as segments
(shardlab_tasks/lm/finetuning/preference.py: pack_pairs), each answer's tokens summed back to its pair (pair_logps).
Against the reference model's log-probabilities, the log-ratios r = log pi(y|x) - log pi_ref(y|x) give
- task.dpo.loss_type=sigmoid (DPO): -log sigmoid(beta (r_c - r_r)), with task.dpo.label_smoothing e the
  conservative DPO of noisy labels, (1 - e) of it plus e of -log sigmoid(-beta (r_c - r_r));
- ipo (IPO): ((r_c / n_c - r_r / n_r) - 1 / (2 beta))^2, each log-ratio averaged over its n answer tokens (TRL's
  length normalisation, confirmed with the IPO authors);
averaged over the pairs. Logged: the rewards beta * r of the chosen and rejected answers, their margin, how often the
chosen one's is higher (accuracy), and the answers' log-probabilities (TRL's rewards/* and logps/*).

The reference:
- with LoRA (model.lora.rank > 0): the model itself with its adapters switched off
  (shardlab_tasks.lm.models.lora.adapters_off), a no-grad forward of the same rows each step; no second copy of any
  weight;
- full fine-tuning: the starting model's log-probabilities of every pair, train and validation, computed once before
  the first step (a no-grad pass over the pairs, on every rank in the same order, so it holds under any layout) and
  kept as training state: step folders hold them beside the weights, so a resume reads them back instead of needing
  the starting weights (docs/finetuning.md#preference-tuning-dpo says why not a frozen second model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from shardlab.config import TaskConfig, as_container
from shardlab.task import setting
from shardlab_tasks.lm.loss import token_cross_entropy
from shardlab_tasks.lm.sft_packing import IGNORE

LOSS_TYPES = ("sigmoid", "ipo")
"""task.dpo.loss_type values (TRL's names)."""

REFERENCE_CHUNK = 8
"""Pairs per forward of the reference pass of full fine-tuning."""


@dataclass
class DPOSettings:
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    @classmethod
    def of(cls, task_cfg: TaskConfig | DictConfig | None) -> DPOSettings:
        """task.dpo of the config (conf/task/dpo.yaml picks its schema), or the defaults where it has none or only
        some of its keys (`+task.dpo.loss_type=...` on a task without the schema: each missing key its default)."""
        section = as_container(setting(task_cfg, "dpo"))  # a DictConfig, a dict or DPOConfig (typed)
        return (
            cls(**{k: section[k] for k in ("beta", "loss_type", "label_smoothing") if k in section})
            if section
            else cls()
        )


def dpo_errors(s: DPOSettings) -> list[str]:
    errors = []
    if not (s.beta > 0 and math.isfinite(s.beta)):
        errors.append(f"task.dpo.beta must be > 0 (the reward scale; TRL's default 0.1), got {s.beta}")
    if s.loss_type not in LOSS_TYPES:
        errors.append(f"task.dpo.loss_type={s.loss_type!r} is not a DPO loss; known: {', '.join(LOSS_TYPES)}")
    if not 0 <= s.label_smoothing < 0.5:
        errors.append(f"task.dpo.label_smoothing must be in [0, 0.5) (the share of flipped labels), got "
                      f"{s.label_smoothing}")  # fmt: skip
    elif s.label_smoothing and s.loss_type != "sigmoid":
        errors.append("task.dpo.label_smoothing applies to task.dpo.loss_type=sigmoid only; set it to 0")
    return errors


# ---- log-probabilities -----------------------------------------------------------------------------------------------
def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of its target, fp32; 0 where the target is IGNORE (logits split over the
    vocabulary too: shardlab_tasks/lm/loss.py)."""
    return -token_cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none").view(targets.shape)


def answer_logps(model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's summed log-probability of its answer tokens, fp32; each row's answer-token count) of rows
    (n, 3, length) of one sample each."""
    inputs, targets, _ = rows.unbind(1)
    return token_logps(model(inputs), targets).sum(-1), (targets != IGNORE).sum(-1)


def pair_logps(model: nn.Module, batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the answers' summed log-probabilities, their answer-token counts), each (pairs, 2: chosen, rejected), of a
    batch as collate_pairs gives it (rows (pairs, 2, 3, length): an answer a row) or as pack_pairs does (rows
    (rows, 3, length): answer k of the micro-batch the segment numbered k, attention kept within it, its tokens'
    log-probabilities added up to slot k: what its own row gives, up to the order of the sum)."""
    rows = batch["rows"].to(device, non_blocking=True)
    if rows.dim() == 4:
        logps, counts = answer_logps(model, rows.flatten(0, 1))
        return logps.view(-1, 2), counts.view(-1, 2)
    inputs, targets, segments = rows.unbind(1)
    owner = segments.clamp(min=0).flatten()  # padding (PAD_SEGMENT) has IGNORE targets: it adds 0 to slot 0
    slots = 2 * batch["index"].shape[0]
    per_token = token_logps(model(inputs, segments), targets).flatten()
    logps = torch.zeros(slots, device=device).index_add(0, owner, per_token)
    answer = (targets != IGNORE).flatten().long()
    counts = torch.zeros(slots, dtype=torch.long, device=device).index_add(0, owner, answer)
    return logps.view(-1, 2), counts.view(-1, 2)


def lora_reference(model: nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    """The base model's answer log-probabilities (pairs, 2): the adapters off, no gradient."""
    from shardlab_tasks.lm.models.lora import adapters_off

    with torch.no_grad(), adapters_off(model):
        return pair_logps(model, batch, device)[0]


class ReferenceLogProbs:
    """The starting model's answer log-probabilities of every pair (chosen, rejected), computed before the first
    step and saved with the training state (Task.training_state): a resume loads them with the checkpoint."""

    def __init__(self, num_pairs: int, device: torch.device) -> None:
        self.logps = torch.zeros(num_pairs, 2, dtype=torch.float32, device=device)
        self.ready = torch.zeros((), dtype=torch.float32, device=device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"logps": self.logps, "ready": self.ready}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.logps.copy_(state["logps"])
        self.ready.copy_(state["ready"])

    @torch.no_grad()
    def compute(self, model: nn.Module, datasets: list, collate, device: torch.device) -> None:
        """One no-grad pass of ``model`` (in eval mode: no dropout) over the pairs of ``datasets``, in order, batched
        by the task's ``collate`` (packed or not): each pair's log-probabilities go to its dataset index."""
        was_training = model.training
        model.eval()
        try:
            for dataset in datasets:
                for start in range(0, len(dataset), REFERENCE_CHUNK):
                    batch = collate([dataset[i] for i in range(start, min(start + REFERENCE_CHUNK, len(dataset)))])
                    self.logps[batch["index"].to(device)] = pair_logps(model, batch, device)[0]
        finally:
            model.train(was_training)
        self.ready.fill_(1.0)


# ---- the loss --------------------------------------------------------------------------------------------------------
def dpo_loss(
    policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, s: DPOSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-pair loss, the log-ratios (pairs, 2)) from the policy's and the reference's answer log-probabilities
    (pairs, 2: chosen, rejected) and the answer-token counts (pairs, 2)."""
    ratios = policy - reference
    if s.loss_type == "ipo":
        averaged = ratios / counts.clamp(min=1)
        return (averaged[:, 0] - averaged[:, 1] - 1 / (2 * s.beta)) ** 2, ratios
    delta = s.beta * (ratios[:, 0] - ratios[:, 1])
    loss = -F.logsigmoid(delta) * (1 - s.label_smoothing)
    if s.label_smoothing:
        loss = loss - F.logsigmoid(-delta) * s.label_smoothing
    return loss, ratios


def preference_loss(model: nn.Module, batch: dict, device: torch.device, s: DPOSettings, reference, lora: bool):
    """The mean DPO loss of a batch of pairs, and the sums summarize turns into metrics. ``reference``: the
    precomputed ReferenceLogProbs of full fine-tuning (None with LoRA, or on the memory plan's meta pass)."""
    if lora:
        ref = lora_reference(model, batch, device)
    elif reference is not None:
        ref = reference.logps[batch["index"].to(device)]
    else:
        ref = torch.zeros(batch["index"].shape[0], 2, device=device)
    logps, counts = pair_logps(model, batch, device)
    per_pair, ratios = dpo_loss(logps, ref, counts, s)
    rewards = s.beta * ratios.detach()
    stats = {
        "loss_sum": per_pair.detach().sum(),
        "count": torch.tensor(float(per_pair.shape[0]), device=device),
        "chosen_reward_sum": rewards[:, 0].sum(),
        "rejected_reward_sum": rewards[:, 1].sum(),
        "correct_sum": (rewards[:, 0] > rewards[:, 1]).float().sum(),
        "chosen_logp_sum": logps[:, 0].detach().sum(),
        "rejected_logp_sum": logps[:, 1].detach().sum(),
    }
    return per_pair.mean(), stats


def summarize_preference(sums: dict[str, float]) -> dict[str, float]:
    """TRL's metric names: the mean loss, rewards, margin, accuracy and log-probabilities over the pairs."""
    n = max(sums["count"], 1)
    chosen, rejected = sums["chosen_reward_sum"] / n, sums["rejected_reward_sum"] / n
    return {
        "loss": sums["loss_sum"] / n,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "rewards/accuracies": sums["correct_sum"] / n,
        "logps/chosen": sums["chosen_logp_sum"] / n,
        "logps/rejected": sums["rejected_logp_sum"] / n,
    }
