"""data.sources: weighted mixtures of corpora - the order's shares, its independence of the world size, sources that
repeat, caches that weights never touch, per-source validation and the dry run's lines."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
from omegaconf import OmegaConf

from shardlab.cli.preflight import compose_config
from shardlab.data import RankBatchSampler
from shardlab.distributed import env as dist_env
from shardlab.errors import DataError
from shardlab.registry import TASKS
from shardlab.runner import print_plan, run_rank
from shardlab_tasks.lm.corpus.mixture import MixtureOrder, MixtureValid, chunk_counts, mixture_errors, summarize_sources
from tests.conftest import TINY_LM

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def notes(tmp_path_factory):
    """A second corpus unlike the embedded one: 400 JSONL records of Greek letter names, text under 'content'."""
    path = tmp_path_factory.mktemp("notes") / "notes.jsonl"
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"content": " ".join(rng.choices(WORDS, k=80))}) + "\n" for _ in range(400)))
    return path


def mixture_config(cache, notes, *overrides, web=0.8, note=0.2):
    sources = f"{{web: {{weight: {web}}}, notes: {{path: {notes}, weight: {note}, text_field: content}}}}"
    return compose_config([*TINY_LM, f"data.cache_dir={cache}", f"+data.sources={sources}", *overrides])


def opened(cfg):
    task = TASKS.build(cfg.task.name, cfg)
    task.prepare_data()
    return task


def test_shares_stay_within_two_points_of_the_weights_in_every_200_step_window():
    order = MixtureOrder(["web", "code"], [5000, 700], [0.8, 0.2], seed=1)
    batch, steps = 8, 200
    for start_step in range(0, 5000, 250):  # 20 windows; i.i.d. draws would miss 2 points in some (sd 1 point)
        names = order.source_names(start_step * batch, steps * batch)
        share = Counter(names)["web"] / len(names)
        assert abs(share - 0.8) <= 0.02, (start_step, share)
    # and a window as short as 64 samples holds 51.2 of web, give or take two
    names = np.array(order.source_names(0, 64_000)) == "web"
    windows = np.convolve(names, np.ones(64), "valid")
    assert windows.min() >= 51.2 - 2 and windows.max() <= 51.2 + 2


def test_chunk_counts_sum_to_the_period_and_keep_a_tiny_weight():
    assert chunk_counts([0.8, 0.2], 4096) == [3277, 819]
    assert sum(chunk_counts([1, 1, 1], 4096)) == 4096
    assert chunk_counts([1e-9, 1.0], 4096) == [1, 4095]


def test_a_mixture_order_is_the_same_on_any_world_size_and_after_a_resume():
    def global_batches(world, start, steps):
        order = MixtureOrder(["a", "b", "c"], [97, 31, 11], [0.5, 0.3, 0.2], seed=4)
        ranks = [list(RankBatchSampler(order, start, 8, r, world, num_batches=steps)) for r in range(world)]
        return [sum((ranks[r][s] for r in range(world)), []) for s in range(steps)]

    full = global_batches(1, 0, 40)
    assert global_batches(2, 0, 40) == full
    assert global_batches(4, 8 * 13, 27) == full[13:]  # saved at step 13, resumed on 4 ranks
    other_seed = [MixtureOrder(["a", "b", "c"], [97, 31, 11], [0.5, 0.3, 0.2], seed=5).indices(0, 8)]
    assert other_seed != full[:1]


def test_a_source_that_runs_out_repeats_reshuffled_each_epoch():
    order = MixtureOrder(["big", "small"], [1000, 10], [0.5, 0.5], seed=0)
    order.draw(0, 200)
    small = [i - 1000 for i in order.indices(0, 200) if i >= 1000]
    epochs = [small[e * 10 : (e + 1) * 10] for e in range(len(small) // 10)]
    assert len(epochs) >= 9
    assert all(sorted(e) == list(range(10)) for e in epochs), "each epoch reads every block of the source once"
    assert len({tuple(e) for e in epochs}) > 1, "each epoch in another order"


def test_validation_takes_the_sources_in_turn_while_each_lasts():
    valid = MixtureValid([list("abc"), list("vwxyz"), list("q")])
    assert [valid[i] for i in range(len(valid))] == [
        ("a", 0), ("v", 1), ("q", 2), ("b", 0), ("w", 1), ("c", 0), ("x", 1), ("y", 1), ("z", 1)
    ]  # fmt: skip


def test_the_mixture_loss_is_the_weighted_mean_of_the_sources():
    sums = {"loss_sum/web": 40.0, "count/web": 10.0, "loss_sum/code": 10.0, "count/code": 5.0}
    metrics = summarize_sources(sums, ["web", "code"], [0.75, 0.25])
    assert metrics["web/loss"] == 4.0 and metrics["code/loss"] == 2.0
    assert metrics["loss"] == pytest.approx(0.75 * 4.0 + 0.25 * 2.0)


def test_changing_a_weight_preprocesses_nothing_and_adding_a_source_only_it(tmp_path, notes):
    cache = tmp_path / "cache"
    first = opened(mixture_config(cache, notes))
    built = sorted(p.name for p in cache.iterdir())
    assert len(built) == 2
    reweighted = opened(mixture_config(cache, notes, web=0.3, note=0.7))
    assert sorted(p.name for p in cache.iterdir()) == built
    assert reweighted.mixture.corpora == first.mixture.corpora
    assert reweighted.mixture.weights == pytest.approx([0.3, 0.7])
    third = notes.parent / "more.jsonl"
    third.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x\n" * 20}) + "\n" for i in range(60)))
    more = f"more: {{path: {third}}}"
    sources = f"{{web: {{weight: 0.8}}, notes: {{path: {notes}, weight: 0.2, text_field: content}}, {more}}}"
    opened(compose_config([*TINY_LM, f"data.cache_dir={cache}", f"+data.sources={sources}"]))
    assert len(list(cache.iterdir())) == 3 and set(built) < {p.name for p in cache.iterdir()}


def test_a_mixture_trains_and_validates_each_source_apart(tmp_path, notes):
    result = run_rank(mixture_config(tmp_path / "cache", notes), tmp_path / "run", dist_env.detect())
    valid = [r for r in result["history"] if r["split"] == "valid"]
    assert len(valid) == 2
    for row in valid:
        assert row["notes/loss"] != row["web/loss"]
        assert row["loss"] == pytest.approx(0.8 * row["web/loss"] + 0.2 * row["notes/loss"])
    train_log = (tmp_path / "run" / "train.log").read_text()
    assert "web/loss" in train_log and "notes/loss" in train_log


def test_dry_run_prints_each_sources_tokens_weight_and_epochs_and_warns_on_repeats(tmp_path, notes, capsys):
    cache = tmp_path / "cache"
    cfg = mixture_config(cache, notes, "dry_run=true", "optimization.max_steps=5000")
    task = TASKS.build(cfg.task.name, cfg)
    print_plan(cfg, task)
    out = capsys.readouterr().out
    assert "web: weight 0.800, not preprocessed yet" in out  # nothing is preprocessed by a dry run
    assert "warning" not in out
    metas = opened(cfg).mixture.metas  # what shardlab-preprocess or a first run would build
    print_plan(cfg, task)
    out = capsys.readouterr().out
    samples = 5000 * 8
    assert f"data.sources: 2 corpora, {samples:,} samples of 32 tokens" in out
    notes_tokens = metas[1]["train_tokens"]
    assert f"notes: weight 0.200, {notes_tokens:,} train tokens, {samples * 32 * 0.2 / notes_tokens:.2f} epochs" in out
    assert "warning: data.sources.notes repeats" in out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+data.sources={web: {weight: -1}}", "data.sources.web.weight must be a number > 0"),
        ("+data.sources={web: {path: /nonexistent/corpus}}", "data.sources.web.path: "),
        ("data.path=/tmp", "data.path and data.sources both name the training corpus"),
    ],
)
def test_mixture_mistakes_are_one_line_naming_the_key(tmp_path, override, message):
    overrides = [*TINY_LM, override]
    if not override.startswith("+data.sources"):
        overrides.append("+data.sources={web: {weight: 1}}")
    cfg = compose_config(overrides)
    errors = TASKS.build(cfg.task.name, cfg).config_errors()
    assert any(message in e for e in errors), errors


def test_every_source_of_a_mixture_as_large_as_a_chunk_is_read_and_a_larger_one_is_refused():
    """5,000 sources once ran with 904 of them at 0 samples per chunk (never read, no word); 4,096 each get one."""
    counts = chunk_counts([1.0] * 4096)
    assert min(counts) == 1 and sum(counts) == 4096
    order = MixtureOrder([f"s{i}" for i in range(4096)], [3] * 4096, [1.0] * 4096, seed=0)
    assert len(set(order.source_names(0, 4096))) == 4096
    with pytest.raises(DataError, match="names 5000 corpora; a mixture reads at most 4096"):
        chunk_counts([1.0] * 5000)
    d = OmegaConf.create({"path": None, "format": "text", "sources": {f"s{i}": {"weight": 1} for i in range(5000)}})
    errors = mixture_errors(d)
    assert len(errors) == 1 and "data.sources names 5000 corpora" in errors[0] and "\n" not in errors[0]


@pytest.mark.parametrize("weights", [[1e308, 1e308], [float("nan"), 1.0], [float("inf"), 1.0], [0, 1.0]])
def test_mixture_weights_that_are_not_finite_positive_with_a_finite_sum_are_refused_before_preprocessing(
    tmp_path, weights
):
    """Two weights of 1e308 once passed, normalised to [0, 0], and failed with a ZeroDivisionError after
    preprocessing: refused by the config check, which runs before any corpus is read (the cache stays empty)."""
    web, note = weights
    sources = f"+data.sources={{a: {{weight: {web}}}, b: {{weight: {note}}}}}"
    cfg = compose_config([*TINY_LM, f"data.cache_dir={tmp_path / 'cache'}", sources])
    errors = TASKS.build(cfg.task.name, cfg).config_errors()
    assert any("weight" in e for e in errors), errors
    assert all("\n" not in e for e in errors)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(DataError, match="finite numbers > 0 with a finite sum"):  # the order refuses them too
        chunk_counts([float(w) for w in weights])
