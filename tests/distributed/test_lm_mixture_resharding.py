"""A mixture of two corpora (data.sources, weights 0.8/0.2) saved on 2 ranks resumes on 1 with the same samples: the
resumed run continues the uninterrupted single-process run's losses, and per-source validation sums over the ranks."""

from __future__ import annotations

import json
import random

import pytest
import torch

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.conftest import TINY_LM
from tests.distributed.harness import run_spawned
from tests.distributed.test_lm_resharding import RTOL, assert_continues, train_losses


@pytest.fixture(scope="module")
def mixture_lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    notes = root / "notes.jsonl"
    rng, words = random.Random(0), "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    notes.write_text("".join(json.dumps({"content": " ".join(rng.choices(words, k=80))}) + "\n" for _ in range(400)))
    sources = f"{{web: {{weight: 0.8}}, notes: {{path: {notes}, weight: 0.2, text_field: content}}}}"

    def make(*overrides: str):
        return compose_config([*TINY_LM, f"data.cache_dir={root / 'cache'}", f"+data.sources={sources}", *overrides])

    return make


@pytest.fixture(scope="module")
def runs(mixture_lm, tmp_path_factory):
    reference = run_rank(mixture_lm(), tmp_path_factory.mktemp("single"), dist_env.detect())  # builds the caches
    fsdp_dir = tmp_path_factory.mktemp("fsdp2")
    (fsdp2,) = run_spawned(
        [mixture_lm("checkpoint.interval_steps=5", "distributed.backend=fully_sharded")],
        world_size=2,
        run_dirs=[fsdp_dir],
    )
    step5 = fsdp_dir / "checkpoints" / "step_00000005"
    single_from_fsdp2 = run_rank(
        mixture_lm(f"checkpoint.resume={step5}"), tmp_path_factory.mktemp("resumed"), dist_env.detect()
    )
    return {"reference": reference, "fsdp2": fsdp2, "single_from_fsdp2": single_from_fsdp2}


def test_a_mixture_on_two_ranks_matches_one_process(runs):
    got, expected = train_losses(runs["fsdp2"]), train_losses(runs["reference"])
    assert sorted(got) == list(range(1, 11))
    torch.testing.assert_close(
        torch.tensor(list(got.values())), torch.tensor(list(expected.values())), rtol=RTOL, atol=0
    )


def test_a_mixture_saved_on_two_ranks_resumes_on_one_with_the_same_samples(runs):
    assert_continues(runs["single_from_fsdp2"], runs["reference"])


def test_per_source_validation_losses_are_logged_on_any_world_size(runs):
    def valid(name):
        return [r for r in runs[name]["history"] if r["split"] == "valid"]

    for a, b in zip(valid("fsdp2"), valid("reference"), strict=True):
        for key in ("loss", "web/loss", "notes/loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
