"""RegNets (Radosavovic et al., 2020) from torchvision: its ImageNet flavors by name, and a small one for 32 px images.

Both are torchvision.models.regnet.RegNet, so their parameter names are torchvision's; the initialisation that
torchvision's constructor performs in place is re-expressed per tensor (``init_plan``) for
shardlab.distributed.materialize, which fills each full tensor from a seeded generator after the model was built on
meta and sharded.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torchvision.models.regnet as tv_regnet
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.ops.misc import Conv2dNormActivation

from shardlab.errors import ConfigError
from shardlab.registry import unknown_name_message
from shardlab_tasks.image_classification.config import RegNetConfig

FLAVORS = sorted(name for name in tv_regnet.__all__ if name.startswith("regnet_"))
"""torchvision's RegNet builders: regnet_x_* and regnet_y_* (400mf ... 128gf)."""

# torchvision's flavors use this norm layer (momentum 0.1 in PyTorch's convention); so does regnet_cifar.
NORM_LAYER = partial(nn.BatchNorm2d, eps=1e-5, momentum=0.1)


class CifarStem(Conv2dNormActivation):
    """3x3 conv, BN, ReLU at stride 1: a 32 px image keeps its resolution into the first stage (ImageNet's stem
    halves it)."""

    def __init__(self, width_in: int, width_out: int, norm_layer, activation_layer) -> None:
        super().__init__(
            width_in, width_out, kernel_size=3, stride=1, norm_layer=norm_layer, activation_layer=activation_layer
        )


@contextlib.contextmanager
def block_params_on_cpu() -> Iterator[None]:
    """torchvision derives a RegNet's stage widths and depths with tensor ops (BlockParams.from_init_params, called
    inside each flavor's builder). Under the trainer's meta device those tensors would have no values to read back,
    so for the duration of a build they are computed on the CPU; the model's own tensors stay on meta."""
    original = tv_regnet.BlockParams.__dict__["from_init_params"]

    def on_cpu(*args, **kwargs):
        with torch.device("cpu"):
            return original.__get__(None, tv_regnet.BlockParams)(*args, **kwargs)

    tv_regnet.BlockParams.from_init_params = on_cpu
    try:
        yield
    finally:
        tv_regnet.BlockParams.from_init_params = original


def cifar_block_params(cfg: RegNetConfig) -> tv_regnet.BlockParams:
    with torch.device("cpu"):  # tensor ops whose values are read back: never on meta (see block_params_on_cpu)
        return tv_regnet.BlockParams.from_init_params(
            depth=cfg.depth,
            w_0=cfg.w_0,
            w_a=cfg.w_a,
            w_m=cfg.w_m,
            group_width=cfg.group_width,
            bottleneck_multiplier=cfg.bottleneck_multiplier,
            se_ratio=cfg.se_ratio,
        )


def design_errors(cfg: RegNetConfig) -> list[str]:
    """regnet_cifar's design-space fields, checked as torchvision's BlockParams would (but naming the keys)."""
    errors = []
    if cfg.depth < 1:
        errors.append(f"model.depth must be >= 1, got {cfg.depth}")
    if cfg.w_0 <= 0 or cfg.w_0 % 8:
        errors.append(f"model.w_0 must be a positive multiple of 8, got {cfg.w_0}")
    if cfg.w_a < 0:
        errors.append(f"model.w_a must be >= 0, got {cfg.w_a}")
    if cfg.w_m <= 1:
        errors.append(f"model.w_m must be > 1, got {cfg.w_m}")
    if cfg.group_width < 1:
        errors.append(f"model.group_width must be >= 1, got {cfg.group_width}")
    if cfg.stem_width < 1:
        errors.append(f"model.stem_width must be >= 1, got {cfg.stem_width}")
    return errors


def regnet(cfg: RegNetConfig, num_classes: int) -> tv_regnet.RegNet:
    if cfg.flavor not in FLAVORS:
        raise ConfigError(unknown_name_message(str(cfg.flavor), "RegNet flavor", FLAVORS, "model.flavor"))
    with block_params_on_cpu():
        model = getattr(tv_regnet, cfg.flavor)(weights=None, num_classes=num_classes, norm_layer=NORM_LAYER)
    return add_dropout(model, cfg.dropout)


def regnet_cifar(cfg: RegNetConfig, num_classes: int) -> tv_regnet.RegNet:
    model = tv_regnet.RegNet(
        cifar_block_params(cfg),
        num_classes=num_classes,
        stem_width=cfg.stem_width,
        stem_type=CifarStem,
        norm_layer=NORM_LAYER,
    )
    return add_dropout(model, cfg.dropout)


def add_dropout(model: tv_regnet.RegNet, p: float) -> tv_regnet.RegNet:
    """Dropout on the classifier's input, as a parameter-free module in front of ``fc`` (an ``nn.Sequential`` would
    rename fc's parameters and break checkpoints; the forward pre-hook keeps them)."""
    if p > 0:
        model.dropout = nn.Dropout(p)
        model.fc.register_forward_pre_hook(lambda fc, args: (model.dropout(args[0]),))
    return model


def trunk_features(model: tv_regnet.RegNet, images: Tensor) -> Tensor:
    """The globally average-pooled output of the last stage (N, D): RegNet's forward up to, not including, fc."""
    return model.avgpool(model.trunk_output(model.stem(images))).flatten(1)


def fsdp_units(model: tv_regnet.RegNet) -> list[nn.Module]:
    """Stem, every block of every stage, classifier: torchtitan-style per-block units, in forward order."""
    return [model.stem, *(block for stage in model.trunk_output for block in stage), model.fc]


# ---- BatchNorm in fp32 under FSDP2 mixed precision -------------------------------------------------------------------
class KeepInputDtype:
    """Mixin for a norm layer that runs as its own fp32 FSDP2 unit: its output leaves in the dtype its input came in.

    With param_dtype=bf16, fully_sharded gives every BatchNorm its own unit with an fp32 MixedPrecisionPolicy. That
    unit's pre-forward hook casts the (bf16) input to fp32, so statistics and normalization are computed in fp32 with
    fp32 weights and running buffers - but nothing casts the fp32 output back. ReLU would pass fp32 on, and the next
    convolution (bf16 weights, in its block's bf16 unit) fails: "Input type (torch.FloatTensor) and weight type
    (CPUBFloat16Type) should be the same"; residual sums would silently promote to fp32. The input dtype must be read
    before FSDP's hook changes it, and FSDP prepends its hooks, so this overrides __call__ (which runs the hooks)
    rather than forward: bf16 in -> BN in fp32 -> bf16 out; backward casts the same way in reverse, so BN's backward
    is fp32 too. In fp32 runs the cast is a no-op.
    """

    def __call__(self, input: Tensor) -> Tensor:
        return super().__call__(input).to(input.dtype)


_KEEP_DTYPE_CLASSES: dict[type, type] = {}


def keep_norm_input_dtype(model: nn.Module) -> None:
    """Give every BatchNorm in ``model`` (plain or synced, torch's or shardlab's) the KeepInputDtype behaviour, by
    swapping its class for a subclass with the mixin (as fully_shard itself does); names and state are unchanged."""
    for module in model.modules():
        if isinstance(module, _BatchNorm) and not isinstance(module, KeepInputDtype):
            cls = type(module)
            if cls not in _KEEP_DTYPE_CLASSES:
                _KEEP_DTYPE_CLASSES[cls] = type(cls.__name__, (KeepInputDtype, cls), {"__module__": cls.__module__})
            module.__class__ = _KEEP_DTYPE_CLASSES[cls]


# ---- initialisation --------------------------------------------------------------------------------------------------
TensorInit = Callable[[Tensor, torch.Generator], None]


# Module-level functions bound with partial, not lambdas: the task holds the plan, and DataLoader workers started by
# spawn (as they are inside spawned ranks) pickle the task along with its collate method.
def _normal_init(std: float, t: Tensor, g: torch.Generator) -> None:
    t.normal_(0.0, std, generator=g)


def _uniform_init(bound: float, t: Tensor, g: torch.Generator) -> None:
    t.uniform_(-bound, bound, generator=g)


def _fill_init(value: float, t: Tensor, g: torch.Generator) -> None:
    t.fill_(value)


def _normal(std: float) -> TensorInit:
    return partial(_normal_init, std)


def _uniform(bound: float) -> TensorInit:
    return partial(_uniform_init, bound)


def _fill(value: float) -> TensorInit:
    return partial(_fill_init, value)


def init_plan(model: nn.Module) -> dict[str, TensorInit]:
    """How to fill each parameter and buffer, by name, mirroring torchvision's RegNet constructor:
    conv weights N(0, sqrt(2 / fan_out)) with fan_out = k*k*out_channels (groups ignored, as there), BN weight 1,
    bias 0, running mean 0, running var 1, counter 0, Linear weight N(0, 0.01) and bias 0. The only biased convs, the
    squeeze-excitation's, keep PyTorch's default that torchvision leaves them: U(+-1/sqrt(fan_in))."""
    plan: dict[str, TensorInit] = {}
    for prefix, module in model.named_modules():
        p = f"{prefix}." if prefix else ""
        if isinstance(module, nn.Conv2d):
            fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels
            plan[p + "weight"] = _normal(math.sqrt(2.0 / fan_out))
            if module.bias is not None:
                fan_in = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
                plan[p + "bias"] = _uniform(1 / math.sqrt(fan_in))
        elif isinstance(module, _BatchNorm):
            plan.update({p + "weight": _fill(1.0), p + "bias": _fill(0.0)})
            plan.update({p + "running_mean": _fill(0.0), p + "running_var": _fill(1.0)})
            plan[p + "num_batches_tracked"] = _fill(0)
        elif isinstance(module, nn.Linear):
            plan.update({p + "weight": _normal(0.01), p + "bias": _fill(0.0)})
    return plan
