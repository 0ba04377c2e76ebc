"""optimizer=lars: two steps against the update rule written out here (sharded parameters: tests/distributed/
test_ssl_parity.py holds fully_sharded, with and without cpu_offload, to one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardlab.optim import OPTIMIZERS
from tests.conftest import compose_config

LR, MOMENTUM, WD, ETA, EPS = 0.5, 0.9, 0.01, 0.02, 1e-8


def lars_of(model: nn.Module, *overrides: str) -> torch.optim.Optimizer:
    cfg = compose_config(
        [
            "optimizer=lars",
            f"optimizer.lr={LR}",
            f"optimizer.momentum={MOMENTUM}",
            f"optimizer.weight_decay={WD}",
            f"optimizer.trust_coefficient={ETA}",
            f"optimizer.eps={EPS}",
            *overrides,
        ]
    ).optimizer
    return OPTIMIZERS.build(cfg.name, model, cfg)


def set_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def adapted(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The adapted, decayed gradient of a matrix: (g + wd w) * eta |w| / (|g| + wd |w| + eps)."""
    trust = ETA * w.norm() / (g.norm() + WD * w.norm() + EPS)
    return (g + WD * w) * trust


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_lars_steps_follow_the_rule_with_biases_excluded(nesterov):
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    optimizer = lars_of(model, f"optimizer.nesterov={str(nesterov).lower()}")
    set_grads(model, 1)
    gw1, gb1 = model.weight.grad.clone(), model.bias.grad.clone()
    optimizer.step()
    set_grads(model, 2)
    gw2, gb2 = model.weight.grad.clone(), model.bias.grad.clone()
    optimizer.step()

    # The rule: buf <- momentum * buf + u (from zero), w <- w - lr * (u + momentum * buf if nesterov else buf).
    def apply(w, u, buf):
        buf = MOMENTUM * buf + u
        return w - LR * (u + MOMENTUM * buf if nesterov else buf), buf

    w1, buf_w = apply(w0, adapted(w0, gw1), torch.zeros_like(w0))
    w2, _ = apply(w1, adapted(w1, gw2), buf_w)
    b1, buf_b = apply(b0, gb1, torch.zeros_like(b0))  # a bias: no weight decay, no trust ratio
    b2, _ = apply(b1, gb2, buf_b)
    torch.testing.assert_close(model.weight.detach(), w2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.bias.detach(), b2, rtol=1e-6, atol=1e-7)


def test_without_exclusion_biases_are_adapted_and_decayed_and_zero_weights_take_the_plain_gradient():
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.zero_()  # |w| = 0: trust ratio 1, the gradient (plus zero decay) as is
        model.bias.copy_(torch.tensor([1.0, -2.0]))
    b0 = model.bias.detach().clone()
    optimizer = lars_of(model, "optimizer.exclude_norm_and_bias=false", "optimizer.momentum=0")
    set_grads(model, 3)
    gw, gb = model.weight.grad.clone(), model.bias.grad.clone()
    optimizer.step()
    torch.testing.assert_close(model.weight.detach(), -LR * gw)
    torch.testing.assert_close(model.bias.detach(), b0 - LR * adapted(b0, gb))


def test_trust_coefficient_must_be_positive():
    from shardlab.cli.checks import validate
    from shardlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"optimizer.trust_coefficient must be > 0, got 0.0"):
        validate(compose_config(["optimizer=lars", "optimizer.trust_coefficient=0"]))
