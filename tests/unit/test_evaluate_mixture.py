"""shardlab-evaluate on a run trained on a mixture (data.sources, shardlab_tasks/lm/corpus/mixture.py): each source's
loss and the mixture's, equal to what training's validation logged for the same weights, with the sources taken from the
tool's own command line, never from the checkpoint's config."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab_commands import evaluate
from tests.conftest import TINY_LM, compose_config
from tests.unit.test_evaluate import _ARMED, OPENED, answer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory, corpus_cache):
    """A 4-step run on the embedded corpus (web, 0.8) and 400 JSONL records of Greek letter names (notes, 0.2),
    validated at its last step over every block of both sources (batch 1: the trainer drops no remainder)."""
    notes = tmp_path_factory.mktemp("notes") / "notes.jsonl"
    rng = random.Random(0)
    notes.write_text("".join(json.dumps({"content": " ".join(rng.choices(WORDS, k=80))}) + "\n" for _ in range(400)))
    sources = f"{{web: {{weight: 0.8}}, notes: {{path: {notes}, weight: 0.2, text_field: content}}}}"
    run_dir = tmp_path_factory.mktemp("mixture_run")
    overrides = ["data.max_corpus_mb=0.05", "optimization.max_steps=4", "validation.interval_steps=4"]
    overrides += ["validation.num_batches=0", "validation.batch_size=1", "checkpoint.interval_steps=4"]
    overrides += [f"data.cache_dir={corpus_cache}", f"+data.sources={sources}"]
    result = run_rank(compose_config([*TINY_LM, *overrides]), run_dir, dist_env.detect())
    return run_dir / "checkpoints" / "step_00000004", result["final"], notes, f"data.cache_dir={corpus_cache}"


def test_each_sources_loss_and_the_mixtures_equal_the_trainers_validation(mixture_run, capsys):
    checkpoint, final, notes, cache = mixture_run
    # the paths again, on the tool's command line; weights and text_field left out: the run's (0.8/0.2, content)
    sources = f"+data.sources={{web: {{}}, notes: {{path: {notes}}}}}"
    results = evaluate.main([str(checkpoint), "--batch-size", "16", cache, sources])
    for key in ("loss", "ppl", "web/loss", "web/ppl", "notes/loss", "notes/ppl"):
        torch.testing.assert_close(results[key], final[key], rtol=1e-5, atol=0, msg=key)
    assert results["web/loss"] != results["notes/loss"]  # two corpora unlike each other: a swap would show
    torch.testing.assert_close(results["loss"], 0.8 * results["web/loss"] + 0.2 * results["notes/loss"])
    assert results["web/tokens"] > 0 and results["notes/tokens"] > 0
    assert results["web/tokens"] + results["notes/tokens"] == results["tokens"]
    out = capsys.readouterr().out
    assert "the mixture web x0.8, notes x0.2" in out and f"({results['notes/tokens']} tokens of {notes})" in out


def test_weights_on_the_command_line_weigh_the_mixture_and_the_sources_stay(mixture_run):
    checkpoint, final, notes, cache = mixture_run
    sources = f"data.sources={{web: {{weight: 1}}, notes: {{path: {notes}, weight: 3}}}}"
    results = evaluate.main([str(checkpoint), "--batch-size", "16", cache, sources])
    torch.testing.assert_close(results["notes/loss"], final["notes/loss"], rtol=1e-5, atol=0)
    torch.testing.assert_close(results["loss"], 0.25 * results["web/loss"] + 0.75 * results["notes/loss"])


def test_the_whole_of_each_source_covers_both_of_its_splits(mixture_run):
    checkpoint, _, notes, cache = mixture_run
    sources = f"+data.sources={{web: {{}}, notes: {{path: {notes}}}}}"
    split = {s: evaluate.main([str(checkpoint), "--split", s, "--batch-size", "64", cache, sources]) for s in
             ("train", "valid", "all")}  # fmt: skip
    for name in ("web", "notes"):
        assert split["all"][f"{name}/tokens"] == split["train"][f"{name}/tokens"] + split["valid"][f"{name}/tokens"]
    assert split["train"]["notes/tokens"] > 10 * split["valid"]["notes/tokens"]


def test_without_sources_on_its_command_line_the_run_is_evaluated_on_the_embedded_corpus(mixture_run, capsys):
    checkpoint, _, _, cache = mixture_run
    capsys.readouterr()
    results = evaluate.main([str(checkpoint), "--batch-size", "64", cache])
    out = capsys.readouterr().out
    assert "note: web, notes (the run's data.sources) are not read from its checkpoint" in out
    assert "notes/loss" not in results and results["tokens"] > 0


def test_mixture_mistakes_are_answered_in_one_line(mixture_run, tmp_path, capsys):
    checkpoint, _, notes, cache = mixture_run
    ckpt = str(checkpoint)
    typo = answer([ckpt, cache, f"+data.sources={{notes: {{pth: {notes}}}}}"], capsys)
    assert "data.sources.notes.pth is not a key of a source; known: path, weight, text_field" in typo
    both = answer([ckpt, cache, f"data.path={notes}", f"+data.sources={{notes: {{path: {notes}}}}}"], capsys)
    assert "data.path and data.sources both name the training corpus" in both
    missing = answer([ckpt, cache, f"+data.sources={{notes: {{path: {tmp_path / 'gone.jsonl'}}}}}"], capsys)
    assert "data.sources.notes.path: " in missing


def test_evaluate_never_reads_the_sources_a_checkpoints_config_names(mixture_run, tmp_path):
    """A shared checkpoint whose data.sources names a private file: the tool opens it neither with nor without a
    data.sources of its own command line (which it evaluates instead)."""
    checkpoint, _, notes, _ = mixture_run
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "secret.jsonl").write_text(json.dumps({"content": "the user's secret " * 200}) + "\n")
    crafted = tmp_path / "step_00000004"
    shutil.copytree(checkpoint, crafted)
    meta = json.loads((crafted / "shardlab.json").read_text())
    meta["config"]["data"]["sources"]["notes"]["path"] = str(private / "secret.jsonl")
    meta["config"]["data"]["cache_dir"] = str(private / "cache")
    (crafted / "shardlab.json").write_text(json.dumps(meta))
    own_cache = f"data.cache_dir={tmp_path / 'own-cache'}"
    OPENED.clear()
    _ARMED["on"] = True
    try:
        alone = evaluate.main([str(crafted), own_cache, "--batch-size", "64"])
        given = evaluate.main(
            [str(crafted), own_cache, "--batch-size", "64", f"+data.sources={{notes: {{path: {notes}}}}}"]
        )
    finally:
        _ARMED["on"] = False
    assert not [p for p in OPENED if str(private) in p], "the checkpoint's data.sources path or cache_dir was opened"
    assert sorted(p.name for p in private.iterdir()) == ["secret.jsonl"]
    assert alone["tokens"] > 0 and given["notes/tokens"] == given["tokens"] > 0


def test_a_source_the_run_read_from_its_own_corpus_is_refused_without_a_path(mixture_run, capsys):
    """notes had a path in training: given again without one it would be scored on the embedded corpus under its name
    (notes/loss == web/loss); web had none, so it may be given bare."""
    checkpoint, _, notes, cache = mixture_run
    bare = answer([str(checkpoint), cache, "+data.sources={web: {}, notes: {}}"], capsys)
    assert bare == (
        "error: data.sources.notes.path: the run trained notes on a corpus of its own (its path is never read from "
        "the checkpoint); give data.sources.notes.path=..."
    )
    assert str(notes) not in bare
    null = answer([str(checkpoint), cache, "+data.sources={notes: {path: null, weight: 1}}"], capsys)
    assert null.startswith("error: data.sources.notes.path: the run trained notes on a corpus of its own")


def test_a_checkpoint_whose_saved_source_is_no_mapping_is_refused_naming_its_file(mixture_run, tmp_path, capsys):
    checkpoint, _, _, cache = mixture_run
    crafted = tmp_path / "step_00000004"
    shutil.copytree(checkpoint, crafted)
    meta = json.loads((crafted / "shardlab.json").read_text())
    meta["config"]["data"]["sources"]["web"] = "oops"
    (crafted / "shardlab.json").write_text(json.dumps(meta))
    err = answer([str(crafted), cache, "--batch-size", "64"], capsys)  # no sources of the command line's either
    assert err == (
        f"error: {crafted / 'shardlab.json'}: config.data.sources.web is 'oops', not a source ({{path, weight, "
        "text_field}); the file was changed after training: restore it"
    )
