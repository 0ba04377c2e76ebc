"""optimizer=cpu_adam gives torch.optim.AdamW's updates, on plain and DTensor (sharded) parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardlab.config import OptimizerConfig
from shardlab.errors import ConfigError
from shardlab.optim.cpu_adam import CPUAdam
from shardlab.registry import OPTIMIZERS

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, num_steps: int = 5, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in range(num_steps):
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=g)
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
        for group in opt.param_groups:  # a schedule changes lr between steps
            group["lr"] = HYPER["lr"] * (1 - 0.1 * step)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_cpu_adam_matches_torch_adamw_with_weight_decay_groups():
    ref, ours = small_model(), small_model()
    run_steps(ref, torch.optim.AdamW(groups(ref), **HYPER))
    opt = CPUAdam(groups(ours), **HYPER)
    run_steps(ours, opt)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a)  # fp32 defaults: rtol 1.3e-6, atol 1e-5
    assert all(float(s["step"]) == 5 for s in opt.state.values())


def test_cpu_adam_matches_every_torch_adamw_kernel():
    results = []
    for kernel in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        model = small_model()
        run_steps(model, torch.optim.AdamW(groups(model), **HYPER, **kernel))
        results.append(list(model.parameters()))
    ours = small_model()
    run_steps(ours, CPUAdam(groups(ours), **HYPER))
    for ref in results:
        for a, b in zip(ref, ours.parameters(), strict=True):
            torch.testing.assert_close(b, a)


def test_cpu_adam_state_dict_is_interchangeable_with_adamw():
    """Checkpoints move between optimizer=adamw and optimizer=cpu_adam: same state keys, same continuation."""
    ref, ours = small_model(), small_model()
    ref_opt = torch.optim.AdamW(groups(ref), **HYPER)
    run_steps(ref, ref_opt, num_steps=3)
    ours.load_state_dict(ref.state_dict())
    our_opt = CPUAdam(groups(ours), **HYPER)
    our_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # state_dict() shares the step tensors
    run_steps(ref, ref_opt, num_steps=3, seed=2)
    run_steps(ours, our_opt, num_steps=3, seed=2)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a)
    assert our_opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()
    assert set(our_opt.state_dict()["state"][0]) == set(ref_opt.state_dict()["state"][0])


def test_cpu_adam_leaves_parameters_without_gradients_alone():
    model = small_model()
    frozen = model[0].weight.detach().clone()
    opt = CPUAdam(groups(model), **HYPER)
    for p in model.parameters():
        p.grad = None if p is model[0].weight else torch.ones_like(p)
    opt.step()
    assert torch.equal(model[0].weight, frozen)
    assert model[0].weight not in opt.state


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group (in this process), for DTensor parameters."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_cpu_adam_matches_torch_adamw_on_dtensor_parameters(one_rank_group):
    mesh = init_device_mesh("cpu", (1,))

    def sharded_model() -> nn.Module:
        model = small_model()
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        return model

    ref, ours = sharded_model(), sharded_model()
    run_steps(ref, torch.optim.AdamW(groups(ref), **HYPER))
    opt = CPUAdam(groups(ours), **HYPER)
    run_steps(ours, opt)
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        assert isinstance(b, DTensor)
        torch.testing.assert_close(b.full_tensor(), a.full_tensor())
    for state in opt.state.values():  # moments stay DTensors, so DCP can reshard them to another world size
        assert isinstance(state["exp_avg"], DTensor) and isinstance(state["exp_avg_sq"], DTensor)


def test_cpu_adam_rejects_parameters_off_the_cpu():
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(ConfigError, match="distributed.cpu_offload=true"):
        CPUAdam(model.parameters(), names={model.weight: "weight"})


def test_cpu_adam_is_registered_with_adamw_groups():
    import shardlab.optim  # noqa: F401  (registers cpu_adam)

    model = small_model()
    opt = OPTIMIZERS.build("cpu_adam", model, OptimizerConfig(name="cpu_adam", lr=3e-3, weight_decay=0.1))
    assert isinstance(opt, CPUAdam)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4]
