"""The Llama architecture: its flavors and their checks, its init, and what the memory plan counts for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import count_params, meta_model, model_on_meta
from shardlab.errors import ConfigError
from shardlab.memory.plan import profile_config
from shardlab.memory.profile import profile_model
from shardlab.runner import build_task
from tests.conftest import compose_config

SMALL_LLAMA = ["model=llama_tiny", "model.num_layers=2", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=2"]


def built(*overrides: str, seed: int = 7):
    task = build_task(compose_config([*SMALL_LLAMA, *overrides]), world_size=1)
    model = meta_model(task.build_model)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=seed)
    return task, model


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.num_kv_heads=3"], "model.num_kv_heads (3) must divide model.num_heads (4)"),
        (["model.num_kv_heads=0"], "model.num_kv_heads must be >= 1, got 0"),
        (["model.dim=72", "model.num_heads=8"], "model.dim / model.num_heads = 9 must be even: RoPE rotates"),
        (["model.num_heads=5"], "model.num_heads (5) must divide model.dim (64)"),
        (["model.ffn_dim=0"], "model.ffn_dim must be >= 1 (or null for 8/3 x dim), got 0"),
        (["model.rope_theta=0"], "model.rope_theta (0.0) and model.norm_eps (1e-05) must be > 0"),
        (["model.init_std=0"], "model.init_std must be > 0, got 0.0"),
        # (the known names that follow include a user_dir's architectures registered by other tests)
        (["model.arch=lama"], "model.arch: 'lama' is not a known model architecture"),
    ],
)
def test_bad_llama_configs_are_refused_before_launch(overrides, expected):
    with pytest.raises(ConfigError) as error:
        build_task(compose_config([*SMALL_LLAMA, *overrides]), world_size=1)
    assert expected in str(error.value)


def test_a_model_section_of_another_architecture_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        build_task(compose_config(["model=gpt_tiny", "model.arch=llama"]), world_size=1)
    assert str(error.value) == (
        "model.arch=llama reads the keys of LlamaConfig, but the model section has keys it ignores (dropout, "
        "mlp_ratio) and lacks ffn_dim, head_dim, moe, norm_eps, num_kv_heads, out_bias, qk_norm, qkv_bias, "
        "rope_scaling, rope_theta; choose a model=llama_* flavor instead of overriding model.arch"
    )


def test_keys_of_the_gpt_are_not_keys_of_the_llama():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="Could not override 'model.mlp_ratio'"):
        compose_config(["model=llama_tiny", "model.mlp_ratio=2"])


def test_llama_tiny_trains_on_gpt_tinys_parameter_budget_and_llama_1b_is_about_a_billion():
    def params(model: str) -> int:
        return count_params(meta_model(build_task(compose_config([f"model={model}"]), world_size=1).build_model))

    gpt, llama = params("gpt_tiny"), params("llama_tiny")
    assert 0.9 * gpt <= llama <= gpt, (gpt, llama)
    assert 1.0e9 <= params("llama_1b") <= 1.2e9


def test_init_is_seeded_per_parameter_with_unit_norms_and_scaled_residual_projections():
    _, a = built()
    _, b = built()
    _, other = built(seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.q.weight, other.blocks[0].attn.q.weight)
    assert not any(name.endswith("bias") for name, _ in a.named_parameters())
    assert a.head.out.weight is not a.embed.weight  # untied
    assert torch.equal(a.blocks[1].mlp_norm.weight, torch.ones(64)) and torch.equal(a.head.norm.weight, torch.ones(64))
    assert a.blocks[0].attn.k.weight.shape == (2 * 16, 64)  # two key/value heads of width 64 / 4
    std, residual = a.blocks[0].mlp.up.weight.std().item(), a.blocks[0].mlp.down.weight.std().item()
    assert abs(std - 0.02) < 0.002 and abs(residual - 0.02 / 2) < 0.002  # scaled by 1/sqrt(2 * layers)


def test_rope_makes_attention_see_relative_positions_only():
    """RoPE's promise: the same tokens shifted later in the sequence attend the same way. With causal attention the
    logits of a suffix depend on the prefix, so compare a sequence with itself under a shift of its positions."""
    from shardlab_tasks.lm.models.llama import rotary_tables, rotate

    cos, sin = rotary_tables(40, 16, 10000.0, torch.device("cpu"), torch.float32)
    q, k = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    scores = rotate(q, cos[:8], sin[:8]) @ rotate(k, cos[:8], sin[:8]).transpose(-1, -2)
    shifted = rotate(q, cos[32:], sin[32:]) @ rotate(k, cos[32:], sin[32:]).transpose(-1, -2)
    torch.testing.assert_close(shifted, scores, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores, q @ k.transpose(-1, -2), atol=1e-2)  # and it does rotate


def saved_bytes(model: nn.Module, units: list[nn.Module], run) -> tuple[int, list[int]]:
    """Bytes autograd really saves in ``run()`` (each storage once, parameters excluded), in total and first saved
    inside each unit: what the plan's meta forward predicts."""
    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}
    current = [-1]

    def pack(t):
        base = t._base if t._base is not None else t
        if id(base) not in params and id(t) not in params and id(base) not in seen:
            seen[id(base)] = current[0]
            bases.append(base)  # kept alive, so ids are not reused
        return t

    bases: list[torch.Tensor] = []
    hooks = []
    for i, unit in enumerate(units):
        hooks.append(unit.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(unit.register_forward_hook(lambda m, a, o: current.__setitem__(0, -1)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    for h in hooks:
        h.remove()
    per_unit = [sum(b.numel() * b.element_size() for b in bases if seen[id(b)] == i) for i in range(len(units))]
    return sum(b.numel() * b.element_size() for b in bases), per_unit


def test_the_plans_meta_forward_counts_what_a_real_llama_forward_saves():
    """RoPE's tables (computed once, shared by every block) and grouped-query attention's expanded keys and values,
    as a real CPU step keeps them: the meta forward with the fused-attention stand-in predicts the bytes exactly."""
    task, model = built("data.seq_len=32", "model.max_seq_len=32")
    units = task.fsdp_units(model)
    batch = torch.randint(0, 256, (3, 33))
    real, real_units = saved_bytes(model, units, lambda: task.loss(model, batch, torch.device("cpu")))
    meta = meta_model(task.build_model)
    planned = profile_model(meta, task.fsdp_units(meta), task, 3, torch.float32)
    assert planned.activations == real and planned.unit_activations == real_units
    assert real_units[1] > 0  # the first block


def test_the_fused_attention_stand_in_counts_grouped_keys_unexpanded_like_the_kernel():
    """A model passing k/v with fewer heads than q (SDPA's enable_gqa): the stand-in saves what the CPU flash kernel
    saves, k and v unexpanded and an output of q's shape."""

    class GroupedAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            q = self.q(x).view(2, 10, 4, 8).transpose(1, 2)
            k, v = self.kv(x).view(2, 10, 2, 16).transpose(1, 2).chunk(2, dim=-1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()

    class Task:
        def example_batch(self, n):
            return torch.zeros(n, 10, 32, device="meta")

        def loss(self, model, batch, device):
            return model(batch), {}

    real_model = GroupedAttention()
    real, _ = saved_bytes(real_model, [], lambda: real_model(torch.randn(2, 10, 32)))
    meta = meta_model(GroupedAttention)
    assert profile_model(meta, [], Task(), 2, torch.float32).activations == real


def test_llama_1b_plans_on_eight_ranks_with_every_block_and_both_ends_sharded():
    cfg = compose_config(["model=llama_1b", "distributed=fully_sharded", "distributed.world_size=8"])
    task = build_task(cfg, world_size=8)
    profile, _ = profile_config(cfg, task, 8, model_on_meta(task))
    assert profile.activation_error is None and profile.activations > 0
    assert len(profile.unit_params) == 22 + 2 and profile.root_params == 0
