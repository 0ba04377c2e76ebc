"""task=dpo's pieces: preference records read and checked (file:line in one line), conversational pairs tokenized
as TRL tokenizes them through transformers' chat template, the embedded demo, the loss variants, the LoRA reference
(adapters off) and the config checks. tests/unit/test_dpo_trl.py holds the comparison with TRL's DPOTrainer,
tests/distributed/test_dpo_parity.py the world sizes and resumes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from shardlab.cli.preflight import compose_config
from shardlab.errors import ConfigError, DataError
from shardlab.runner import build_task
from shardlab_tasks.lm.finetuning.dpo import DPOSettings, dpo_errors, dpo_loss
from shardlab_tasks.lm.finetuning.preference import collate_pairs, demo_pairs, record_pair
from shardlab_tasks.lm.models.lora import LoRALinear, adapters_off
from tests.unit.test_sft import CHAT, LLAMA3_TEMPLATE, QWEN2_TEMPLATE, chat_folder, untagged

TINY = ["task=dpo", "model.num_layers=1", "model.dim=32", "model.num_heads=2", "data.seq_len=64"]


def dpo_task(*overrides: str):
    return build_task(compose_config([*TINY, *overrides]), world_size=1)


GOOD = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "p", "chosen": "a"}, r"no 'rejected' field \(found: prompt, chosen\)"),
        ({"prompt": "p", "chosen": 4, "rejected": "b"}, r"a preference record holds three .*chosen: int"),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "an empty chosen or rejected answer"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "chosen and rejected are the same answer"),
        ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": None}],
          "rejected": [{"role": "assistant", "content": "b"}]}, r"message 0 of 'chosen' has NoneType content, not a"),
        ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "conversational pairs need a chat template"),
    ],
)  # fmt: skip
def test_a_bad_record_is_refused_in_one_line_naming_its_file_and_line(tmp_path, bad, message):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n")
    task = dpo_task(f"data.path={data}")
    with pytest.raises(DataError, match=f"^{data}:3: {message}") as error:
        task.prepare_data()
    assert "\n" not in str(error.value)


def test_standard_pairs_append_end_of_text_and_train_on_the_answers_only(tmp_path):
    task = dpo_task()
    pair = record_pair(GOOD, "t", task.cfg.data, task.tokenizer, None)
    eod = task.tokenizer.eod
    assert pair.chosen.ids == [*b"2 + 2 = 4", eod] and pair.rejected.ids == [*b"2 + 2 = 5", eod]
    assert pair.chosen.answer == [False] * 7 + [True] * 3  # " 4" and the end of text: TRL's completion + EOS


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, QWEN2_TEMPLATE], ids=["llama3", "qwen2"])
def test_conversational_pairs_are_tokenized_as_trl_tokenizes_them(tmp_path, template):
    """TRL's DPOTrainer: the prompt rendered with the generation prompt, prompt + answer rendered whole, both by
    apply_chat_template; the answer starts where the three token lists part."""
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(chat_folder(tmp_path / "reference", template))
    ours = chat_folder(tmp_path / "ours", untagged(template))
    task = dpo_task(f"data.tokenizer={ours / 'tokenizer.json'}")
    prompt, chosen = CHAT[:4], CHAT[4:]
    rejected = [{"role": "assistant", "content": "Rome, I think."}]
    explicit = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    implicit = {"chosen": prompt + chosen, "rejected": prompt + rejected}  # TRL's extract_prompt: the shared turns
    for record in (explicit, implicit):
        pair = record_pair(record, "t", task.cfg.data, task.tokenizer, task.chat_template)
        prompt_ids = reference.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]  # fmt: skip
        for sample, answer in ((pair.chosen, chosen), (pair.rejected, rejected)):
            full = reference.apply_chat_template(prompt + answer, tokenize=True, return_dict=True)["input_ids"]
            assert sample.ids == list(full)
            assert sample.answer == [i >= len(prompt_ids) for i in range(len(full))]
            assert list(full[: len(prompt_ids)]) == list(prompt_ids)
    assert task.tokenizer.decode([t for t, a in zip(pair.chosen.ids, pair.chosen.answer, strict=True) if a]).startswith(
        "Roma."
    )


def test_the_demo_prefers_each_functions_body_to_another_functions():
    pairs = demo_pairs()
    assert len(pairs) > 300 and pairs == demo_pairs()  # deterministic
    for _, record in pairs:
        assert record["chosen"] != record["rejected"]
        assert len(record["prompt"]) + max(len(record["chosen"]), len(record["rejected"])) <= 250
    bodies = {record["chosen"] for _, record in pairs}
    assert all(record["rejected"] in bodies for _, record in pairs)  # a real body, of another function


def test_demo_splits_fill_the_default_batches():
    task = build_task(compose_config(["task=dpo"]), world_size=1)
    task.prepare_data()
    s = task.preference_splits
    assert s.truncated == s.dropped == 0 and len(s.train) > 300 and len(s.valid) >= 8
    batch = task.collate([task.train_dataset[i] for i in range(8)])
    assert batch["rows"].shape[:3] == (8, 2, 3) and batch["rows"].shape[3] <= 256
    assert batch["index"].tolist() == list(range(8))
    assert task.valid_dataset[0]["index"] == len(task.train_dataset)  # one reference table for both splits


@pytest.mark.parametrize(("multiple", "width"), [(1, 5), (2, 6), (4, 8), (16, 9)])
def test_pairs_are_cut_to_a_multiple_of_the_tensor_parallel_degree(multiple, width):
    """Sequence parallelism splits every row's positions evenly over the tensor ranks: the longest sample (5 of 9
    positions) rounded up to the degree, never past the rows' width."""
    items = []
    for i, used in enumerate((3, 5)):
        rows = torch.arange(2 * 3 * 9).view(2, 3, 9)
        rows[:, 2] = (torch.arange(9) >= used).long()  # segment 0: the sample; 1: its padding
        items.append({"rows": rows, "index": torch.tensor(i)})
    batch = collate_pairs(items, multiple)
    assert batch["rows"].shape == (2, 2, 3, width)
    assert torch.equal(batch["rows"], torch.stack([item["rows"] for item in items])[..., :width])


def test_label_smoothing_puts_the_optimum_at_a_finite_margin_and_ipo_at_its_target():
    """Conservative DPO assumes a share e of flipped labels: its loss is smallest where sigmoid(beta * margin) =
    1 - e, not at an infinite margin; IPO's where the per-token margin is 1 / (2 beta)."""
    beta, e = 0.5, 0.1
    optimum = math.log((1 - e) / e) / beta
    margins = torch.tensor([optimum - 1, optimum, optimum + 1], requires_grad=True)
    policy = torch.stack([margins, torch.zeros(3)], dim=1)
    loss, _ = dpo_loss(policy, torch.zeros(3, 2), torch.ones(3, 2), DPOSettings(beta, "sigmoid", e))
    loss.sum().backward()
    assert margins.grad[0] < 0 and abs(margins.grad[1]) < 1e-6 and margins.grad[2] > 0
    plain, _ = dpo_loss(policy.detach(), torch.zeros(3, 2), torch.ones(3, 2), DPOSettings(beta, "sigmoid", 0.0))
    assert torch.all(plain[1:] < plain[:-1])  # plain DPO: always better with a larger margin
    counts = torch.tensor([[4.0, 2.0]])
    target = torch.tensor([[4.0 / (2 * beta), 0.0]])  # chosen 1 / (2 beta) per token above its reference
    ipo, _ = dpo_loss(target, torch.zeros(1, 2), counts, DPOSettings(beta, "ipo", 0.0))
    assert ipo.item() == pytest.approx(0.0, abs=1e-12)


def test_adapters_off_computes_the_base_layer_and_turns_them_back_on():
    base = torch.nn.Linear(8, 4)
    layer = LoRALinear(base, rank=2, alpha=4.0, dropout=0.0)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    model = torch.nn.Sequential(layer)
    x = torch.randn(3, 8)
    adapted = model(x)
    with adapters_off(model):
        torch.testing.assert_close(model(x), torch.nn.functional.linear(x, base.weight, base.bias))
    torch.testing.assert_close(model(x), adapted)
    assert not torch.allclose(adapted, torch.nn.functional.linear(x, base.weight, base.bias))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.dpo.beta=0", r"task.dpo.beta must be > 0"),
        ("task.dpo.loss_type=kto", r"task.dpo.loss_type must be one of sigmoid, ipo, got 'kto'"),
        ("task.dpo.label_smoothing=0.5", r"task.dpo.label_smoothing must be in \[0, 0.5\)"),
    ],
)
def test_dpo_config_mistakes_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        dpo_task(override)


def test_the_reference_benchmark_writes_its_figures(tmp_path):
    from shardlab_bench import dpo_reference as bench_dpo_reference

    out = tmp_path / "r.json"
    result = bench_dpo_reference.main(["--steps", "2", "--out", str(out), *TINY[1:], "data.seq_len=256"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["pairs"] > 300 and result["table_bytes"] == result["pairs"] * 2 * 4
    assert result["precompute_s"] > 0 and result["frozen_reference_forward_per_step_s"] > 0
    assert result["meta"]["commit"] is not None and result["frozen_copy_bytes_fp32"] > result["table_bytes"]


def test_a_partial_dpo_section_on_a_task_without_its_schema_is_refused_by_its_keys_not_a_key_error():
    """`+task.dpo.loss_type=kto` on task=lm (no DPO schema there: the section holds only the key given) used to fail
    reading the missing task.dpo.beta ("Key 'beta' is not in struct"); the keys not given take their defaults and the
    refusal names the keys that are wrong."""
    settings = DPOSettings.of(OmegaConf.create({"dpo": {"loss_type": "kto"}}))
    assert (settings.beta, settings.label_smoothing) == (DPOSettings.beta, DPOSettings.label_smoothing)
    assert dpo_errors(settings) == ["task.dpo.loss_type='kto' is not a DPO loss; known: sigmoid, ipo"]
