"""What an MoE model adds to the LM task's loss and metrics (issue 49): the blocks' auxiliary loss (balancing and
z-loss, shardlab_tasks.lm.models.moe.auxiliary_loss) added to the loss to backpropagate, and the statistics the trainer
sums over micro-batches and ranks: the auxiliary loss, and each layer's assignments per expert, which
``routing_metrics`` turns into the logged ``aux_loss`` and per-layer load (max over mean: 1 = balanced)."""

from __future__ import annotations

import torch

from shardlab_tasks.lm.models.moe import auxiliary_loss, load_summary
from shardlab_tasks.lm.models.moe_balance import StepLoad

AUX_SUM, BATCHES, LOAD = "moe_aux_sum", "moe_batches", "moe_load/"


def add_routing_loss(
    model, loss: torch.Tensor, sums: dict, model_cfg, step_load: StepLoad | None = None
) -> tuple[torch.Tensor, dict]:
    """``loss`` + the auxiliary loss of the forward ``model`` just ran, and ``sums`` with the routing statistics
    (a training forward's loads also into ``step_load``, for the step's end: shardlab_tasks/lm/models/moe_balance.py);
    unchanged for a dense model (or an architecture without MoE blocks)."""
    take = getattr(model, "take_routing_stats", None)
    stats = take() if take is not None else []
    if not stats:
        return loss, sums
    if step_load is not None and model.training:
        step_load.add([layer_stats.tokens_per_expert for layer_stats in stats])
    aux = auxiliary_loss(stats, model_cfg.moe)
    sums = {**sums, AUX_SUM: aux.detach().float(), BATCHES: torch.tensor(1.0)}
    for layer, layer_stats in enumerate(stats):
        load = layer_stats.tokens_per_expert.float()
        for expert in range(load.numel()):
            sums[f"{LOAD}{layer}/{expert}"] = load[expert]
    return loss + aux, sums


def routing_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The logged MoE metrics of summed statistics, removed from ``totals``: aux_loss (mean per micro-batch),
    moe_load/<layer> (that layer's max over mean expert load) and moe_idle_experts (experts of all layers that got
    no token in the window); {} for a dense model."""
    if AUX_SUM not in totals:
        return {}
    metrics = {"aux_loss": totals.pop(AUX_SUM) / max(totals.pop(BATCHES), 1.0)}
    layers: dict[int, dict[int, float]] = {}
    for key in [k for k in totals if k.startswith(LOAD)]:
        layer, expert = key[len(LOAD) :].split("/")
        layers.setdefault(int(layer), {})[int(expert)] = totals.pop(key)
    idle = 0
    for layer, loads in sorted(layers.items()):
        summary = load_summary(torch.tensor([loads[e] for e in sorted(loads)]))
        metrics[f"{LOAD}{layer}"] = summary["max_over_mean"]
        idle += summary["idle_experts"]
    metrics["moe_idle_experts"] = idle
    return metrics
