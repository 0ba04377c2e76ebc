"""shardlab-evaluate --lm-eval: EleutherAI's lm-evaluation-harness on a trained checkpoint's Hugging Face export,
on the tasks shipped in tests/data/lm_eval (local files, nothing downloaded), gives shardlab's own numbers."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError, DataError
from shardlab.runner import run_rank
from shardlab_commands import evaluate, generate
from shardlab_tasks.lm.harness import check_task_names
from tests.conftest import ROOT

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the test extra: pip install -e '.[test]'")

TASKS = ROOT / "tests" / "data" / "lm_eval"
SEQ_LEN = 32  # tests.conftest.TINY_LM's data.seq_len: the harness's window
# Short enough that prompt and answer fit one window (byte-level tokens), so both sides score the same tokens.
CHOICES = [
    ("2+2=", ["4", "5", "22"], 0),
    ("def f(x):\n    return", [" x", " 7", "!!"], 0),
    ("import ", ["os", "zz", "(("], 0),
    ("Hello, ", ["world", "qqqqq", "the"], 2),
    ("for i in ", ["range(10):", "xyzzy", "]]"], 1),
    ("print(", ["'hi')", ")))", "x"], 2),
]
TEXT = (
    "The harness reads this text once, in windows of the model's context, and adds up the log-likelihood of every "
    "token given the ones before it in its window: déjà vu, naïve café, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17."
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_lm):
    """A byte-level GPT trained 6 steps on the embedded corpus."""
    out = tmp_path_factory.mktemp("lm_eval_run")
    run_rank(tiny_lm("optimization.max_steps=6", "checkpoint.interval_steps=6"), out, dist_env.detect())
    return out / "checkpoints" / "step_00000006"


def text_of_whole_windows(encode) -> str:
    """TEXT cut to a multiple of SEQ_LEN tokens: the harness then scores full windows only, as shardlab does."""
    text = TEXT
    while len(encode(text)) % SEQ_LEN:
        text = text[:-1]
    assert len(encode(text)) >= 3 * SEQ_LEN
    return text


@torch.no_grad()
def choice_loglikelihoods(model, encode, question: str, choices: list[str]) -> list[float]:
    """log p(" " + choice | question) under shardlab's own model, tokenized as the harness pairs them: a prompt's
    trailing whitespace is scored as part of the answer."""
    context = encode(question.rstrip())
    out = []
    for choice in choices:
        whole = encode(question + " " + choice)
        assert whole[: len(context)] == context and len(whole) <= SEQ_LEN + 1
        logp = model(torch.tensor([whole[:-1]])).log_softmax(-1)[0]
        out.append(sum(float(logp[i - 1, whole[i]]) for i in range(len(context), len(whole))))
    return out


def test_harness_rolling_loglikelihood_equals_shardlab_perplexity_and_choices_score_alike(
    checkpoint, tmp_path, monkeypatch
):
    # Nothing may come from the hub: the model, tokenizer and data are the export's and these files.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the task YAMLs name their data files relative to the working directory
    ours, task, _ = generate.load_model(checkpoint)
    encode = task.tokenizer.encode
    text = text_of_whole_windows(encode)
    (tmp_path / "shardlab_rolling.jsonl").write_text(json.dumps({"text": text}) + "\n")
    records = [{"question": q, "choices": c, "answer": a} for q, c, a in CHOICES]
    (tmp_path / "shardlab_choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # shardlab's corpus: an empty document (its end-of-document token), then the text: the text's first token is
    # predicted from an end-of-document token, as the harness predicts it from the export's BOS (the same token).
    # data.valid_percent=0 keeps both records in one stream.
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": text}) + "\n")

    results = evaluate.main(
        [str(checkpoint), f"data.path={corpus}", "data.valid_percent=0", f"data.cache_dir={tmp_path / 'cache'}"]
        + ["--split", "all", "--perplexity", "--lm-eval", "shardlab_rolling,shardlab_choice"]
        + ["--lm-eval-include", str(TASKS), "--bootstrap-iters", "0", "--export-dir", str(tmp_path / "hf")]
    )

    # Rolling log-likelihood: the harness's bits per byte over the text's bytes, against shardlab's summed loss.
    assert results["tokens"] == len(encode(text))
    ours_nll = results["loss"] * results["tokens"]
    rolling = results["lm_eval"]["shardlab_rolling"]
    harness_nll = rolling["bits_per_byte"] * len(text.encode()) * math.log(2)
    assert harness_nll == pytest.approx(ours_nll, rel=1e-5)
    (sample,) = results["lm_eval_samples"]["shardlab_rolling"]
    assert -sample["resps"][0][0] == pytest.approx(ours_nll, rel=1e-5)
    assert math.exp(ours_nll / results["tokens"]) == pytest.approx(results["ppl"], rel=1e-6)

    # Multiple choice: every choice's log-likelihood and the accuracy they give, as shardlab's model scores them.
    samples = sorted(results["lm_eval_samples"]["shardlab_choice"], key=lambda s: s["doc_id"])
    correct = 0
    for (question, choices, answer), s in zip(CHOICES, samples, strict=True):
        expected = choice_loglikelihoods(ours, encode, question, choices)
        got = [resp[0][0] for resp in s["resps"]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-4)
        correct += max(range(len(choices)), key=expected.__getitem__) == answer
    assert results["lm_eval"]["shardlab_choice"]["acc"] == pytest.approx(correct / len(CHOICES))


def test_an_unknown_harness_task_is_refused_in_one_line_with_the_nearest_name():
    known = ["arc_easy", "shardlab_choice", "shardlab_rolling"]
    with pytest.raises(ConfigError, match=r"^--lm-eval: no task 'shardlab_rollin' in lm-eval's tasks or .*lm_eval\. "):
        check_task_names(["shardlab_rolling", "shardlab_rollin"], known, [TASKS])
    with pytest.raises(ConfigError, match="Did you mean 'shardlab_rolling'"):
        check_task_names(["shardlab_rollin"], known, [TASKS])
    check_task_names(["arc_easy", "shardlab_*"], known, [])  # known names and patterns pass


def test_lm_eval_without_a_checkpoint_or_with_a_missing_task_folder_is_refused(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--lm-eval evaluates a trained checkpoint"):
        evaluate.main(["--random-init", "--lm-eval", "hellaswag"])
    missing = tmp_path / "no_such_folder"
    with pytest.raises(ConfigError, match=f"--lm-eval-include {missing}: not a folder"):
        evaluate.main([str(checkpoint), "--lm-eval", "x", "--lm-eval-include", str(missing), "--export-dir", "hf"])
    assert not (tmp_path / "hf").exists()


def test_a_dataset_the_hub_cannot_give_is_one_line_and_an_unresolvable_hub_means_offline(checkpoint, monkeypatch):
    """Offline, datasets raises ConnectionError after its retries (a minute, a 65-line traceback): one DataError line
    instead, and a hub host that does not resolve sets the offline flags before the harness is imported."""
    import lm_eval

    from shardlab_tasks.lm import harness

    monkeypatch.setenv("HF_ENDPOINT", "https://no-such-hub.invalid")
    for flag in harness.OFFLINE_FLAGS:
        monkeypatch.setenv(flag, "0")  # off; and put back after the test, which task_manager sets
    assert harness.hub_unreachable().startswith("no-such-hub.invalid does not resolve (")
    harness.task_manager(["shardlab_rolling"], [TASKS])
    assert all(os.environ[flag] == "1" for flag in harness.OFFLINE_FLAGS)

    def unreachable(**kwargs):
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", unreachable)
    with pytest.raises(DataError) as e:
        evaluate.main([str(checkpoint), "--lm-eval", "shardlab_rolling", "--lm-eval-include", str(TASKS)])
    assert str(e.value).startswith(
        "--lm-eval shardlab_rolling: Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled); "
        "no-such-hub.invalid does not resolve ("
    )
    assert "\n" not in str(e.value) and str(e.value).endswith("or give task YAMLs over local files (--lm-eval-include)")
