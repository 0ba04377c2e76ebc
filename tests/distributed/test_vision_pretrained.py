"""model.pretrained on 2 fully_sharded ranks (CPU, gloo): torchvision's regnet_y_400mf weights as the image
classifier's trunk and tiny RegNet weights as SwAV's, each rank copying its FSDP2 shards' slices at the trainer's own
start, compute torchvision's features; training starts and the heads are the seed's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardlab.distributed.materialize import clean_name, materialize
from shardlab.distributed.units import model_on_meta
from shardlab.runner import build_task
from tests.conftest import compose_config
from tests.distributed.harness import run_spawned
from tests.ssl_configs import TINY_SSL
from tests.vision_weights import features, images, regnet_y_400mf_file, tiny_file

SIZES = {"image_classification": 32, "swav": 16}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def inspect(trainer) -> dict:
    """Every rank: the full parameters after the run (one step at lr 1e-30 leaves them as loaded), then the features
    of a fixed batch in eval mode with the file read again into the sharded model (the step moved BatchNorm's running
    statistics, which eval mode uses)."""
    task, model = trainer.task, trainer.model
    params = {clean_name(name): full(p) for name, p in model.named_parameters()}
    sharded = all(isinstance(p, DTensor) for p in model.parameters())  # before a forward (the root's stay gathered)
    task.load_pretrained(model, trainer.backend.device)
    model.eval()
    return {
        "params": params,
        "features": task.features(model, images(4, SIZES[task.cfg.task.name])),
        "initialized_from": str(trainer.initialized_from),
        "sharded": sharded,
    }


def seeded(overrides: list[str]) -> dict[str, torch.Tensor]:
    """What one process's seeded init gives every parameter (the heads a run from a trunk file keeps)."""
    task = build_task(compose_config(overrides), world_size=1)
    model = model_on_meta(task)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=task.cfg.seed)
    return dict(model.named_parameters())


def test_torchvision_weights_load_into_two_sharded_ranks_as_trunks_with_seeded_heads(tmp_path):
    y400, y400_file = regnet_y_400mf_file(tmp_path / "regnet_y_400mf.pth")
    tiny, tiny_file_ = tiny_file(tmp_path / "tiny.pth")
    run = ["optimization.max_steps=1", "optimizer.lr=1e-30", "lr_scheduler.warmup_steps=0", "logging.interval_steps=1"]
    run += ["validation.interval_steps=0", "checkpoint.interval_steps=0", "logging.progress_bar=false"]
    classifier = ["task=image_classification", "model=regnet_y_400mf", "data.image_size=32", "data.num_train=64"]
    classifier += ["data.num_valid=16", "validation.batch_size=16", "optimization.batch_size=8"]
    ssl = ["task=swav", *TINY_SSL, "task.num_prototypes=24"]
    two = ["distributed=fully_sharded", "distributed.world_size=2"]
    cases = [(classifier, y400, y400_file, ""), (ssl, tiny, tiny_file_, "trunk.")]
    cfgs = [compose_config([*model, *run, *two, f"model.pretrained={path}"]) for model, _, path, _ in cases]
    results = run_spawned(cfgs, 2, run_dirs=[tmp_path / "classifier", tmp_path / "swav"], inspect=inspect)
    for (model, source, path, prefix), result in zip(cases, results, strict=True):
        assert result["sharded"] and result["initialized_from"] == str(path)
        train = [r for r in result["history"] if r["split"] == "train"]
        assert [r["step"] for r in train] == [1] and torch.isfinite(torch.tensor(train[0]["loss"]))
        size = SIZES[cfgs[results.index(result)].task.name]
        torch.testing.assert_close(result["features"], features(source, images(4, size)), rtol=1e-4, atol=1e-5)
        expected, init = source.state_dict(), seeded([*model, *run])
        for name, value in result["params"].items():
            if name.startswith(prefix) and not name.removeprefix(prefix).startswith("fc."):
                # loaded at the start (atol: an element near 0 moves by lr 1e-30 times its clipped gradient)
                torch.testing.assert_close(value, expected[name.removeprefix(prefix)], rtol=1e-6, atol=1e-20, msg=name)
            else:
                # the head: the seed's, as without the file (a zero bias moved by lr 1e-30 times its gradient; SwAV's
                # prototypes, which it keeps at unit length, in direction)
                value, seed = (value, init[name].detach())
                if name == "prototypes.weight":
                    value, seed = F.normalize(value, dim=1), F.normalize(seed, dim=1)
                torch.testing.assert_close(value, seed, rtol=1e-6, atol=1e-20, msg=name)
