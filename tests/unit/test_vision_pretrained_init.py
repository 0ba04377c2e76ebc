"""model.pretrained for the vision tasks skips the seeded init of the trunk its file fills (Task.pretrained_keys): the
trainer draws only the head (classifier, projection, prototypes), ends with the weights the full init followed by
the load gives, and still refuses a file that lacks a trunk tensor. The LM's twin is test_pretrained_init.py; the
2-rank fully_sharded start is tests/distributed/test_vision_pretrained.py."""

from __future__ import annotations

import pytest
import torch

from shardlab.errors import CheckpointError
from shardlab.runner import build_task, rank_task
from tests.conftest import compose_config
from tests.pretrained_starts import full_init_then_load, started
from tests.ssl_configs import TINY_REGNET, TINY_SSL
from tests.vision_weights import tiny_file

VISION = ["task=image_classification", *TINY_REGNET, "data.num_train=64", "data.num_valid=32"]
VISION += ["validation.batch_size=16", "optimization.batch_size=8"]
CONFIGS = {"image_classification": (VISION, ""), "swav": (["task=swav", *TINY_SSL], "trunk.")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_file(tmp_path_factory.mktemp("tv") / "tiny.pth")[1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_pretrained_run_draws_only_the_head_and_starts_with_the_weights_of_the_full_init_then_load(
    tiny, tmp_path, name
):
    overrides, prefix = CONFIGS[name]
    cfg = compose_config([*overrides, f"model.pretrained={tiny}"])
    start = started(cfg, tmp_path)
    state, drawn, initialized_from = start.state, start.drawn, start.initialized_from
    assert initialized_from == tiny
    # what was not drawn is exactly what the file fills: its tensors but the classifier it keeps for ImageNet
    held = {prefix + key for key in torch.load(tiny, weights_only=True) if not key.startswith("fc.")}
    assert set(state) - set(drawn) == held and set(drawn) == set(state) - held
    assert drawn and all(not n.startswith(prefix) or n.startswith("fc.") for n in drawn)  # the head alone
    expected = full_init_then_load(cfg)
    assert state.keys() == expected.keys()
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key


def test_a_file_that_lacks_a_trunk_tensor_at_the_start_is_still_refused_not_left_as_allocated(tiny, tmp_path):
    """The file checked by the pre-flight loses a tensor before the rank reads it: load_trunk refuses it before any
    copy, so no skipped (never drawn) weight is trained from."""
    kept = tmp_path / "kept.pth"
    kept.write_bytes(tiny.read_bytes())
    cfg = compose_config([*VISION, f"model.pretrained={kept}"])
    build_task(cfg, world_size=1)  # the pre-flight passes: the file fits
    state = torch.load(kept, weights_only=True)
    del state["stem.1.running_var"]  # a buffer: skipped like the parameters, so it must be read as well
    torch.save(state, kept)
    with pytest.raises(CheckpointError, match="has no stem.1.running_var, which the trunk has"):
        started(cfg, tmp_path / "run")


def test_a_trial_or_a_dry_run_draws_every_weight_since_neither_reads_the_file(tiny, tmp_path):
    cfg = compose_config([*VISION, f"model.pretrained={tiny}"])
    start = started(cfg, tmp_path, trial=True)
    state, drawn, initialized_from = start.state, start.drawn, start.initialized_from
    assert initialized_from is None and sorted(drawn) == sorted(state)
    planning = build_task(compose_config([*VISION, f"model.pretrained={tiny}", "dry_run=true"]), world_size=1)
    assert planning.pretrained_keys() is None and rank_task(cfg).pretrained_keys() is not None
    assert build_task(compose_config(VISION), world_size=1).pretrained_keys() is None  # no file: all drawn


def test_evaluate_builds_a_pretrained_model_without_drawing_the_trunk_and_with_the_same_weights(tiny):
    """shardlab-evaluate without a checkpoint (a probe of the file's trunk) starts as a run does."""
    from shardlab_commands import evaluate

    cfg = compose_config([*VISION, f"model.pretrained={tiny}"])
    drawn: list[str] = []
    init = type(build_task(cfg, world_size=1)).init_tensor

    def record(self, name, tensor, generator):
        drawn.append(name)
        init(self, name, tensor, generator)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(build_task(cfg, world_size=1)), "init_tensor", record)
        _, model = evaluate.build_model(cfg, None, pretrained=True)
    assert drawn and all(n.startswith("fc.") for n in drawn)  # the head alone
    expected = full_init_then_load(cfg)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
