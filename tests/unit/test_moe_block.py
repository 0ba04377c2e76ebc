"""The MoE feed-forward block (shardlab_tasks/lm/models/moe.py) against transformers' own blocks, built from small
configs with random weights copied over: outputs, router logits and the load-balancing loss; then what transformers does
not have: both expert implementations agree, gradients reach every weight, capacity drops are counted, and
DeepSeek-V3's bias-based balancing moves a collapsed router toward even load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlab_tasks.lm.models.moe import (
    MoEBlock,
    MoEConfig,
    auxiliary_loss,
    family_config,
    init_moe_tensor,
    load_balancing_loss,
    load_summary,
    moe_config_errors,
)
from shardlab_tasks.lm.models.moe_experts import dispatch, grouped_mm_function, grouped_mm_usable, swiglu_loop

transformers = pytest.importorskip("transformers")

DIM, FFN, SHARED_FFN, EXPERTS, TOP_K, TOKENS = 32, 48, 40, 4, 2, 24
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # fp32; the two sum each token's experts in different orders


def randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def hf_block(family: str, **extra):
    """transformers' sparse MoE block of ``family`` with the eager (per-expert loop) experts, randomly filled."""
    sizes = {"hidden_size": DIM, "num_experts_per_tok": TOP_K, "experts_implementation": "eager"}
    if family == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as mod

        config = transformers.MixtralConfig(**sizes, intermediate_size=FFN, num_local_experts=EXPERTS, **extra)
        block = mod.MixtralSparseMoeBlock(config)
    elif family == "qwen2_moe":
        from transformers.models.qwen2_moe import modeling_qwen2_moe as mod

        config = transformers.Qwen2MoeConfig(
            **sizes, moe_intermediate_size=FFN, shared_expert_intermediate_size=SHARED_FFN, num_experts=EXPERTS, **extra
        )
        block = mod.Qwen2MoeSparseMoeBlock(config)
    elif family == "qwen3_moe":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

        config = transformers.Qwen3MoeConfig(**sizes, moe_intermediate_size=FFN, num_experts=EXPERTS, **extra)
        block = mod.Qwen3MoeSparseMoeBlock(config)
    else:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

        config = transformers.DeepseekV3Config(**sizes, moe_intermediate_size=FFN, **extra)
        block = mod.DeepseekV3MoE(config)
    randomize(block, seed=1)
    return block.eval(), config


def ours_from(theirs, cfg: MoEConfig) -> MoEBlock:
    """Our block holding ``theirs``' weights (the names the wiring will map from the hub files)."""
    block = MoEBlock(cfg, DIM)
    with torch.no_grad():
        block.router.weight.copy_(theirs.gate.weight)
        block.experts.gate_up_proj.copy_(theirs.experts.gate_up_proj)
        block.experts.down_proj.copy_(theirs.experts.down_proj)
        shared = getattr(theirs, "shared_expert", None) or getattr(theirs, "shared_experts", None)
        if shared is not None:
            for ours, hub in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                getattr(block.shared, ours).weight.copy_(getattr(shared, hub).weight)
        if getattr(theirs, "shared_expert_gate", None) is not None:
            block.shared.output_gate.weight.copy_(theirs.shared_expert_gate.weight)
        if block.router.score_bias is not None:
            block.router.score_bias.copy_(theirs.gate.e_score_correction_bias)
    return block


def tokens(seed: int = 0, shape=(2, TOKENS // 2)) -> torch.Tensor:
    return torch.randn(*shape, DIM, generator=torch.Generator().manual_seed(seed))


FAMILIES = [
    ("mixtral", {}, dict(num_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN)),
    ("qwen2_moe", {"norm_topk_prob": False}, dict(num_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN, shared_ffn_dim=40)),
    ("qwen2_moe", {"norm_topk_prob": True}, dict(num_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN, shared_ffn_dim=40)),
    ("qwen3_moe", {"norm_topk_prob": True}, dict(num_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN)),
    ("qwen3_moe", {"norm_topk_prob": False}, dict(num_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN)),
]


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
@pytest.mark.parametrize(("family", "hf_extra", "sizes"), FAMILIES)
def test_block_matches_transformers_sparse_moe_block(family, hf_extra, sizes, impl):
    theirs, config = hf_block(family, **hf_extra)
    ours = ours_from(
        theirs,
        family_config(family, **sizes, norm_topk_prob=getattr(config, "norm_topk_prob", True), experts_impl=impl),
    )
    x = tokens()
    with torch.no_grad():
        expected = theirs(x.clone())
        got, stats = ours(x)
        their_logits = theirs.gate(x.view(-1, DIM))[0]
    torch.testing.assert_close(got, expected, **TOLERANCE)
    torch.testing.assert_close(stats.logits, their_logits, rtol=0, atol=0)
    assert int(stats.tokens_per_expert.sum()) == TOKENS * TOP_K


def test_deepseek_v3_group_limited_sigmoid_routing_matches_transformers():
    """Sigmoid scores, 8 experts in 4 groups of which 2 are eligible, a non-zero correction bias that chooses but does
    not weigh, routed_scaling 2.5, a shared expert without a gate."""
    extra = {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5}
    theirs, config = hf_block("deepseek_v3", **extra)
    with torch.no_grad():
        theirs.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    sizes = dict(num_experts=8, top_k=TOP_K, ffn_dim=FFN, num_groups=4, topk_groups=2, shared_ffn_dim=FFN)
    ours = ours_from(theirs, family_config("deepseek_v3", **sizes))
    x = tokens(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(x.clone()), **TOLERANCE)


def test_load_balancing_loss_equals_transformers_pooled_over_layers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = [ours_from(hf_block("mixtral")[0], family_config("mixtral", num_experts=EXPERTS, ffn_dim=FFN))]
    layers.append(MoEBlock(family_config("mixtral", num_experts=EXPERTS, ffn_dim=FFN), DIM))
    randomize(layers[1], seed=7)
    stats = [layer(tokens(seed=i))[1] for i, layer in enumerate(layers)]
    expected = load_balancing_loss_func(tuple(s.logits for s in stats), EXPERTS, TOP_K)
    torch.testing.assert_close(load_balancing_loss(stats), expected, **TOLERANCE)
    torch.testing.assert_close(load_balancing_loss(stats[:1]), load_balancing_loss_func((stats[0].logits,), EXPERTS))


def test_auxiliary_loss_weighs_balancing_and_z_loss_and_is_zero_with_a_graph_when_both_are_off():
    cfg = family_config("qwen3_moe", num_experts=EXPERTS, ffn_dim=FFN, aux_loss_coef=0.01, z_loss_coef=1e-3)
    block = MoEBlock(cfg, DIM)
    randomize(block, seed=2)
    _, stats = block(tokens())
    z_loss = torch.logsumexp(stats.logits, dim=-1).square().mean()
    torch.testing.assert_close(auxiliary_loss([stats], cfg), 0.01 * load_balancing_loss([stats]) + 1e-3 * z_loss)
    off = auxiliary_loss([stats], MoEConfig())
    assert float(off.detach()) == 0.0 and off.requires_grad


def test_gradients_reach_every_weight_and_both_implementations_give_the_same_ones():
    cfg = family_config("qwen2_moe", num_experts=EXPERTS, ffn_dim=FFN, shared_ffn_dim=SHARED_FFN, aux_loss_coef=0.1)
    grads = {}
    for impl in ("grouped_mm", "loop"):
        block = MoEBlock(MoEConfig(**{**cfg.__dict__, "experts_impl": impl}), DIM)
        randomize(block, seed=4)
        out, stats = block(tokens())
        (out.square().mean() + auxiliary_loss([stats], block.cfg)).backward()
        grads[impl] = {name: p.grad for name, p in block.named_parameters()}
    for name, grad in grads["loop"].items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads["grouped_mm"][name], grad, **TOLERANCE)


def test_torch_grouped_mm_is_public_and_computes_each_groups_product():
    """shardlab uses torch.nn.functional.grouped_mm (public since torch 2.10): if torch moves or changes it, this
    fails here rather than a training run falling back silently."""
    assert grouped_mm_function() is F.grouped_mm
    generator = torch.Generator().manual_seed(0)
    x, gate_up, down = (torch.randn(*s, generator=generator) for s in ((10, 8), (3, 12, 8), (3, 8, 6)))
    counts = torch.tensor([4, 0, 6])
    grouped = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=torch.cumsum(counts, 0).to(torch.int32))
    looped = torch.cat([x[:4] @ gate_up[0].T, x[4:] @ gate_up[2].T])
    torch.testing.assert_close(grouped, looped, **TOLERANCE)
    assert swiglu_loop(x, counts, gate_up, down).shape == (10, 8)
    # auto picks it on this CPU in fp32; float64 (no kernel) takes the loop
    assert grouped_mm_usable(x, gate_up) and not grouped_mm_usable(x.double(), gate_up.double())


def test_capacity_factor_drops_the_later_tokens_of_an_overloaded_expert_and_counts_them():
    indices = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 2)  # experts 0 and 1 get 6 each, 2 and 3 get 2
    weights = torch.full(indices.shape, 0.5)
    capacity = 4  # ceil(1.0 * 8 tokens * 2 / 4 experts)
    route = dispatch(indices, weights, num_experts=4, capacity_factor=1.0)
    assert route.counts.tolist() == [capacity, capacity, 2, 2] and int(route.num_dropped) == 4
    assert route.token[:capacity].tolist() == [0, 1, 2, 3]  # in token order: tokens 4 and 5 lose expert 0
    assert int(dispatch(indices, weights, 4, None).num_dropped) == 0

    cfg = MoEConfig(num_experts=4, top_k=2, ffn_dim=FFN, capacity_factor=1.0)
    block = MoEBlock(cfg, DIM)
    randomize(block, seed=5)
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.weight[0, 0] = block.router.weight[1, 0] = 10.0  # every token with x[0] > 0 picks 0 and 1
    x = tokens(shape=(TOKENS,)).abs()
    _, stats = block(x)
    assert stats.tokens_per_expert.tolist() == [TOKENS, TOKENS, 0, 0] and int(stats.num_dropped) == TOKENS


def collapse_toy(cfg: MoEConfig, steps: int) -> list[float]:
    """A router that sends most tokens to experts 0 and 1 (their logits lean on the tokens' shared mean); max/mean
    load per step while update_score_bias runs (a no-op at rate 0)."""
    block = MoEBlock(cfg, DIM)
    randomize(block, seed=6)
    with torch.no_grad():
        block.router.weight[:2] += 1.0
    generator, history = torch.Generator().manual_seed(8), []
    for _ in range(steps):
        x = torch.randn(64, DIM, generator=generator) * 0.5 + 1.0
        with torch.no_grad():
            _, stats = block(x)
        history.append(load_summary(stats.tokens_per_expert)["max_over_mean"])
        block.update_score_bias(stats.tokens_per_expert)
    return history


def test_bias_balancing_moves_a_collapsed_router_toward_even_load():
    """Direction only (the bound it reaches is shardlab_bench/moe.py's to measure): 8 experts, top 2, so 4.0 is total
    collapse; the plain router stays collapsed, the bias-balanced one ends well below (its sign rule with a fixed
    rate oscillates: the mean of its last 20 steps is checked, at 60% of collapse)."""
    sizes = dict(num_experts=8, top_k=2, ffn_dim=8)
    plain = collapse_toy(family_config("deepseek_v3", **sizes, score_bias=False), steps=60)
    balanced = collapse_toy(family_config("deepseek_v3", **sizes, bias_update_rate=0.02), steps=60)
    assert min(plain) > 3.5 and balanced[0] == plain[0]
    assert sum(balanced[-20:]) / 20 < 0.6 * 4.0


def test_config_errors_name_each_bad_key():
    bad = MoEConfig(num_experts=6, top_k=8, score_func="relu", num_groups=4, bias_update_rate=0.1, capacity_factor=0)
    errors = "\n".join(moe_config_errors(bad))
    for key in ("model.moe.top_k", "score_func='relu'", "num_groups (4)", "bias_update_rate", "capacity_factor"):
        assert key in errors
    assert moe_config_errors(family_config("qwen2_moe", shared_ffn_dim=16)) == []
    assert "shared_expert_gate" in "\n".join(moe_config_errors(family_config("qwen2_moe")))


def test_init_fills_every_block_tensor_and_scales_the_residual_projections():
    block = MoEBlock(family_config("deepseek_v3", num_experts=4, ffn_dim=64, shared_ffn_dim=64), 64)
    generator = torch.Generator().manual_seed(0)
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        assert init_moe_tensor(f"blocks.0.mlp.{name}", tensor.data, generator, std=0.02, residual_std=0.005), name
    assert float(block.router.score_bias.abs().sum()) == 0.0
    assert 0.003 < float(block.experts.down_proj.std()) < 0.007 and 0.015 < float(block.router.weight.std()) < 0.025
    assert not init_moe_tensor("blocks.0.mlp.gate.weight", torch.empty(2), generator, 0.02, 0.005)
