"""Supervised fine-tuning (data.format=chat / prompt_completion): the model's chat template rendered as transformers
renders it, answer tokens as the only targets, packed rows computing what unpacked ones do, the demo learning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError, DataError
from shardlab.runner import build_task, run_rank
from shardlab_tasks.lm.finetuning.sft import (
    RECORD_MAX_CHARS,
    PackedRows,
    Sample,
    answer_token_loss,
    demo_records,
    open_sft_splits,
    record_sample,
)
from shardlab_tasks.lm.finetuning.sft_render import BoundedRenderer
from shardlab_tasks.lm.finetuning.sft_template import PREFIX_RENDER_MAX_TURNS, ChatTemplate, load_chat_template
from shardlab_tasks.lm.sft_packing import IGNORE, document_mask, pack, segment_positions
from tests.hf_folders import write_tokenizer

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""Meta-Llama-3-8B-Instruct's chat_template."""

QWEN2_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {%- if message['role'] not in ('system', 'user', 'assistant') %}
        {{- raise_exception('roles are system, user or assistant, not ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] + '<|im_end|>' + '\n' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
"""Qwen2's chat_template written over lines (trim_blocks and lstrip_blocks decide its whitespace), with the
``{% generation %}`` marks transformers' return_assistant_tokens_mask reads: the reference for the answer mask."""

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]

CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France? "},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy, «in Italian»?"},
    {"role": "assistant", "content": "Roma."},
]


def untagged(template: str) -> str:
    """The template without transformers' generation marks (shardlab finds answers by rendering prefixes)."""
    return template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")


def chat_folder(folder: Path, template: str, bos: str = "<|begin_of_text|>") -> Path:
    """A tokenizer folder: the byte-level tokenizer.json plus the chat special tokens, and a tokenizer_config.json
    with ``template``."""
    from tokenizers import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": "<|endoftext|>",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def sft_task(tmp_path: Path, *overrides: str):
    cfg = compose_config(["model=gpt_tiny", "model.num_layers=1", "model.dim=32", "model.num_heads=2",
                          "data.format=prompt_completion", "data.seq_len=64", *overrides])  # fmt: skip
    return build_task(cfg, world_size=1)


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, QWEN2_TEMPLATE], ids=["llama3", "qwen2"])
def test_chat_template_renders_the_tokens_and_answer_mask_of_transformers(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    reference_folder = chat_folder(tmp_path / "reference", template)
    ours_folder = chat_folder(tmp_path / "ours", untagged(template))
    reference = transformers.AutoTokenizer.from_pretrained(reference_folder)
    task = sft_task(tmp_path, f"data.tokenizer={ours_folder / 'tokenizer.json'}", "data.format=chat")
    for messages in (CHAT, CHAT[1:3]):
        sample = record_sample({"messages": messages}, "test", task.cfg.data, task.tokenizer, task.chat_template)
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert sample.ids == list(expected)
        text = reference.apply_chat_template(messages, tokenize=False)
        assert task.chat_template.render(messages) == text
        answers = task.tokenizer.decode([t for t, a in zip(sample.ids, sample.answer, strict=True) if a])
        end = "<|eot_id|>" if template is LLAMA3_TEMPLATE else "<|im_end|>\n"
        assert answers == "".join(m["content"] + end for m in messages if m["role"] == "assistant")
        if template is QWEN2_TEMPLATE:  # the {% generation %} spans transformers finds: the same tokens
            tagged = reference.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            assert sample.answer == [bool(m) for m in tagged["assistant_masks"]]
    generation = task.chat_template.render(CHAT[1:2], add_generation_prompt=True)
    assert generation == reference.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)


def test_a_template_error_names_the_record_and_a_chat_without_template_is_refused(tmp_path):
    folder = chat_folder(tmp_path / "qwen", untagged(QWEN2_TEMPLATE))
    task = sft_task(tmp_path, f"data.tokenizer={folder / 'tokenizer.json'}", "data.format=chat")
    with pytest.raises(DataError, match=r"data.jsonl:7: the chat template .* failed to render it \(roles are"):
        messages = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
        record_sample({"messages": messages}, "data.jsonl:7", task.cfg.data, task.tokenizer, task.chat_template)
    with pytest.raises(ConfigError, match=r"^data.format=chat needs a chat template: set data.chat_template"):
        sft_task(tmp_path, "data.format=chat")
    refused = r"^data.format must be one of text, chat, prompt_completion, preference, got 'cht'"
    with pytest.raises(ConfigError, match=refused):
        sft_task(tmp_path, "data.format=cht")
    with pytest.raises(ConfigError, match="no chat_template string"):
        write_tokenizer(tmp_path)  # a tokenizer_config.json without a chat_template
        load_chat_template(tmp_path / "tokenizer_config.json")


def test_prompt_tokens_carry_no_loss(tmp_path):
    task = sft_task(tmp_path)  # byte tokenizer, no template: prompt + completion + end-of-text
    sample = record_sample({"prompt": "def f(x):\n", "completion": "    return x\n"}, "t", task.cfg.data,
                           task.tokenizer, None)  # fmt: skip
    n_prompt = len("def f(x):\n")
    assert sample.answer == [False] * n_prompt + [True] * (len("    return x\n") + 1)
    assert sample.ids[-1] == task.tokenizer.eod
    rows = PackedRows([sample, sample], 64, task.tokenizer.eod, packed=True)
    batch = rows[0][None]
    model = task.build_model()  # the modules' default init: random enough for gradients
    logits = {}

    def keep_logits(module, args, out):
        out.retain_grad()
        logits["x"] = out

    model.head.register_forward_hook(keep_logits)
    loss, stats = answer_token_loss(model, batch, torch.device("cpu"), packed=True)
    loss.backward()
    assert stats["count"] == 2 * (len("    return x\n") + 1)
    # A position's logits get a gradient exactly when its next token is an answer token: the prompt's carry none.
    trained = (logits["x"].grad[0].abs().sum(-1) > 0).tolist()
    targets = batch[0, 1].tolist()
    assert trained == [t != IGNORE for t in targets]
    assert trained[: n_prompt - 1] == [False] * (n_prompt - 1)


def test_segments_restart_positions_and_keep_attention_within_each_sample():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = document_mask(segments)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[2].tolist() == [True, True, True, False, False, False]
    assert pack([3, 3, 2, 5, 1], 6) == [[0, 1], [2], [3, 4]]


def random_samples(n: int, generator: torch.Generator) -> list[Sample]:
    samples = []
    for _ in range(n):
        length = int(torch.randint(4, 20, (1,), generator=generator))
        prompt = int(torch.randint(1, length - 1, (1,), generator=generator))
        ids = torch.randint(0, 257, (length,), generator=generator).tolist()
        samples.append(Sample(ids, [False] * prompt + [True] * (length - prompt)))
    return samples


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_rows_give_the_loss_and_gradients_of_the_same_samples_unpacked(tmp_path, arch):
    model_args = ["model=llama_tiny", "model.num_kv_heads=1"] if arch == "llama" else ["model=gpt_tiny"]
    cfg = compose_config([*model_args, "model.num_layers=2", "model.dim=32", "model.num_heads=2",
                          "data.format=prompt_completion", "data.seq_len=40"])  # fmt: skip
    task = build_task(cfg, world_size=1)
    samples = random_samples(9, torch.Generator().manual_seed(0))
    packed, unpacked = (PackedRows(samples, 40, 256, packed=p) for p in (True, False))
    assert len(packed) < len(unpacked) == 9  # several samples share a row
    torch.manual_seed(0)
    model = task.build_model()

    def loss_and_grads(rows: PackedRows, use_segments: bool):
        model.zero_grad()
        batch = torch.stack([rows[i] for i in range(len(rows))])
        loss, stats = answer_token_loss(model, batch, torch.device("cpu"), use_segments)
        loss.backward()
        return loss.detach(), stats["count"], [p.grad.clone() for p in model.parameters()]

    loss, count, grads = loss_and_grads(packed, True)
    loss_u, count_u, grads_u = loss_and_grads(unpacked, False)
    assert count == count_u == sum(sum(s.answer[1:]) for s in samples)
    torch.testing.assert_close(loss, loss_u, rtol=1e-5, atol=1e-6)
    for g, g_u in zip(grads, grads_u, strict=True):
        torch.testing.assert_close(g, g_u, rtol=1e-4, atol=1e-6)
    leaky, _, _ = loss_and_grads(packed, False)  # packed without the segments: samples see each other
    assert not torch.allclose(leaky, loss_u, rtol=1e-4)


def test_records_of_jsonl_and_parquet_give_the_same_samples_and_a_stable_split(tmp_path):
    records = [{"q": f"question {i}?", "a": f"answer {i}."} for i in range(200)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pq" / "data.parquet")
    fields = ["data.prompt_field=q", "data.completion_field=a", "data.valid_percent=20"]
    jsonl = sft_task(tmp_path, f"data.path={tmp_path / 'data.jsonl'}", *fields)
    parquet = sft_task(tmp_path, f"data.path={tmp_path / 'pq'}", *fields)
    jsonl.prepare_data()
    parquet.prepare_data()
    a, b = jsonl.sft_splits, parquet.sft_splits
    assert 20 < len(a.valid.samples) < 60 and len(a.train.samples) + len(a.valid.samples) == 200
    assert [s.ids for s in a.valid.samples] == [s.ids for s in b.valid.samples]  # the same records held out
    assert all(torch.equal(a.train[i], b.train[i]) for i in range(len(a.train)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "x", "a": "y"}\n{"question": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no 'q' text field \(found: question\); name the fields"):
        sft_task(tmp_path, f"data.path={bad}", *fields).prepare_data()


def test_the_demo_is_stdlib_functions_with_their_docstring_as_prompt_and_body_as_answer():
    records = dict(demo_records())
    assert len(records) > 300
    assert records["stdlib/calendar.isleap"] == {
        "prompt": 'def isleap(year):\n    """Return True for leap years, False for non-leap years."""\n',
        "completion": "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
    }
    assert not any(key.rsplit(".", 1)[-1].startswith("_") for key in records)  # public functions and methods only
    assert list(records) == [key for key, _ in demo_records()]  # the same order every time


def test_the_demo_answer_token_loss_falls_in_a_short_run(tmp_path):
    cfg = compose_config([
        "task=sft", "model.num_layers=2", "model.dim=64", "model.num_heads=4", "data.seq_len=128",
        "optimization.max_steps=30", "optimization.batch_size=8", "optimizer.lr=3e-3", "validation.interval_steps=30",
        "validation.num_batches=4", "validation.batch_size=8", "checkpoint.interval_steps=0",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.interval_steps=1",
    ])  # fmt: skip
    assert cfg.task.name == "lm" and cfg.data.format == "prompt_completion"
    result = run_rank(cfg, tmp_path, dist_env.detect())
    train = [r["loss"] for r in result["history"] if r["split"] == "train"]
    assert sum(train[-5:]) / 5 < 0.6 * sum(train[:5]) / 5, train
    assert result["final"]["loss"] < 0.6 * train[0]


def test_splits_are_deterministic_and_hold_packed_rows_of_answer_samples(tmp_path):
    task = sft_task(tmp_path, "data.seq_len=256")
    d = task.cfg.data
    first = open_sft_splits(d, task.tokenizer, None, packed=True)
    again = open_sft_splits(d, task.tokenizer, None, packed=True)
    assert len(first.train) == len(again.train) and torch.equal(first.train[3], again.train[3])
    assert len(first.train) < len(first.train.samples) and len(first.valid) > 0  # packing: fewer rows than samples
    assert first.cut.count == first.dropped.count == 0  # the demo's samples fit the default LM's context
    short = open_sft_splits(OmegaConf.merge(d, {"seq_len": 64}), task.tokenizer, None, packed=True)
    assert short.cut.count > 0 and short.dropped.count > 0  # cut to 65 tokens; those whose prompt fills them left out
    assert all(short.train[i].shape == (3, 64) and (short.train[i][1] != IGNORE).any() for i in range(len(short.train)))


SFT_TINY = [
    "task=sft", "model.num_layers=1", "model.dim=32", "model.num_heads=2", "model.max_seq_len=128",
    "data.seq_len=128", "optimization.max_steps=4", "optimizer.lr=3e-3", "lr_scheduler.warmup_steps=0",
    "validation.interval_steps=0", "validation.batch_size=4", "checkpoint.interval_steps=0",
    "logging.progress_bar=false", "logging.tensorboard=false", "logging.interval_steps=1",
]  # fmt: skip
"""task=sft on the demo, small enough for a few steps in a second or two."""


def keep_params(trainer) -> dict:
    return {"params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def test_gradients_are_the_global_answer_token_mean_whatever_the_update_freq(tmp_path, capsys):
    """Rows hold different numbers of answer tokens, so the mean of two micro-batch means is not the step's mean;
    the trainer weighs each micro-batch by its share of the step's answer tokens (LanguageModelingTask.loss_count)."""
    whole, split = (
        run_rank(compose_config([*SFT_TINY, *overrides]), tmp_path / name, dist_env.detect(), after_fit=keep_params)
        for name, overrides in (
            ("whole", ["optimization.batch_size=8"]),
            ("split", ["optimization.batch_size=4", "optimization.update_freq=2"]),
        )
    )
    assert capsys.readouterr().out.count("fine-tuning records from the embedded demo") == 2  # one line per run
    for metric in ("loss", "gnorm"):  # gnorm: before clipping, so a wrong scale shows even where Adam hides it
        got, expected = ([r[metric] for r in res["history"] if r["split"] == "train"] for res in (split, whole))
        assert len(expected) == 4
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    for key, value in whole["params"].items():
        torch.testing.assert_close(split["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_the_start_line_counts_records_read_held_out_cut_and_dropped(tmp_path, capsys):
    records = [{"prompt": "p" * 10, "completion": "a" * 5}] * 30  # 16 tokens: fit
    records += [{"prompt": "p" * 20, "completion": "a" * 30}] * 7  # 51 tokens: cut, answer tokens left
    records += [{"prompt": "p" * 40, "completion": "a"}] * 5  # the prompt fills the row: dropped
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    task = sft_task(tmp_path, f"data.path={tmp_path / 'r.jsonl'}", "data.seq_len=32", "data.valid_percent=20")
    task.prepare_data()
    s = task.sft_splits
    assert (s.records, s.cut.count, s.dropped.count) == (42, 12, 5)
    held_out = len(s.valid.samples)
    assert 0 < held_out < 37 and len(s.train.samples) == 37 - held_out
    f = tmp_path / "r.jsonl"
    cut = ", ".join(f"{f}:{n}" for n in range(31, 36))  # the first five named, then "..."
    dropped = ", ".join(f"{f}:{n}" for n in range(38, 43))  # all five
    assert task.data_summary() == (
        f"fine-tuning records from {f}: 42 read, {held_out} held out for validation, 12 ({cut}, ...) cut "
        f"(longer than data.seq_len=32), 5 ({dropped}) dropped (no answer token within it)\n  {37 - held_out} train "
        f"samples in {len(s.train)} rows ({s.train.answer_tokens:,} answer tokens), {held_out} valid in "
        f"{len(s.valid)} rows ({s.valid.answer_tokens:,})"
    )
    assert sft_task(tmp_path, "data.format=text").data_summary() is None  # the corpus cache prints its own


LLAMA3_GENERATION_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""A Llama 3-style template whose answers are marked with {% generation %} (the BOS written once, by the template)."""


def saved_by_transformers(tmp_path: Path, template: str):
    """A folder as transformers 5 saves it (the template in chat_template.jinja), whose tokenizer adds a BOS of its
    own when asked for special tokens (so a BOS added twice shows); (folder, its transformers tokenizer)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, processors

    source = chat_folder(tmp_path / "source", "")
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    bos = [("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))]
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=bos)
    tok.save(str(source / "tokenizer.json"))
    reference = transformers.AutoTokenizer.from_pretrained(source)
    reference.chat_template = template
    reference.save_pretrained(tmp_path / "saved")
    assert "chat_template" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    return tmp_path / "saved", transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")


def assert_as_transformers(task, reference, messages) -> None:
    """The sample's ids and answer mask are apply_chat_template's ids and return_assistant_tokens_mask."""
    sample = record_sample({"messages": messages}, "t", task.cfg.data, task.tokenizer, task.chat_template)
    expected = reference.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert sample.ids == list(expected["input_ids"])
    assert sample.answer == [bool(m) for m in expected["assistant_masks"]]
    assert any(sample.answer)


def test_a_folder_transformers_5_saves_with_generation_marks_gives_its_ids_and_answer_mask(tmp_path):
    folder, reference = saved_by_transformers(tmp_path, LLAMA3_GENERATION_TEMPLATE)
    task = sft_task(tmp_path, f"data.tokenizer={folder / 'tokenizer.json'}", "data.format=chat")
    assert task.chat_template.origin == str(folder / "chat_template.jinja") and task.chat_template.marks_generation
    bos = task.tokenizer.tok.token_to_id("<|begin_of_text|>")
    for messages in (CHAT, CHAT[1:3], [*CHAT[1:3], {"role": "assistant", "content": " two answers in a row "}]):
        assert_as_transformers(task, reference, messages)
        sample = record_sample({"messages": messages}, "t", task.cfg.data, task.tokenizer, task.chat_template)
        assert sample.ids.count(bos) == 1 and sample.ids[0] == bos  # the template's BOS, once
    with BoundedRenderer(task.chat_template) as renderer:  # the child process gives the same spans
        text, spans = renderer.assistant_spans(CHAT, "t")
    assert (text, spans) == task.chat_template.assistant_spans(CHAT, "t") and len(spans) == 2


def test_a_chatml_template_in_tokenizer_config_gives_transformers_ids_and_mask(tmp_path):
    """The template as a named list in tokenizer_config.json (``default`` used); marked with {% generation %}, the
    mask is transformers'; unmarked, today's rule gives the same mask, and data.train_after_end_of_turn=false leaves
    out the newline after <|im_end|> (transformers' mask when the marks end before it)."""
    transformers = pytest.importorskip("transformers")
    named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"}]
    folders = {}
    for name, template in (
        ("marked", QWEN2_TEMPLATE),
        ("unmarked", untagged(QWEN2_TEMPLATE)),
        (
            "short",
            QWEN2_TEMPLATE.replace(
                "'<|im_end|>' + '\n' }}{%- endgeneration %}", "'<|im_end|>' }}{%- endgeneration %}{{- '\n' }}"
            ),
        ),
    ):
        folders[name] = chat_folder(tmp_path / name, "")
        config = json.loads((folders[name] / "tokenizer_config.json").read_text())
        config["chat_template"] = [*named, {"name": "default", "template": template}]
        (folders[name] / "tokenizer_config.json").write_text(json.dumps(config))
    assert json.loads((folders["short"] / "tokenizer_config.json").read_text())["chat_template"][1]["template"] != (
        QWEN2_TEMPLATE
    )  # its marks end before the newline
    reference, short = (transformers.AutoTokenizer.from_pretrained(folders[n]) for n in ("marked", "short"))
    for name, ref, overrides in (
        ("marked", reference, []),
        ("unmarked", reference, []),
        ("unmarked", short, ["data.train_after_end_of_turn=false"]),
        ("short", short, []),
    ):
        task = sft_task(tmp_path, f"data.tokenizer={folders[name] / 'tokenizer.json'}", "data.format=chat", *overrides)
        assert task.chat_template.marks_generation == (name != "unmarked")
        for messages in (CHAT, CHAT[1:3]):
            assert_as_transformers(task, ref, messages)


BAD_CHATS = {
    "empty": ([{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}],
              r"message 1 \(assistant\) has empty content .*; fill it or delete the record"),
    "null": ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
             r"message 1 \(assistant\) has no content; write its text as a string"),
    "list": ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
             r"message 1 \(assistant\) has a list content, not a string"),
    "role": ([{"role": "usr", "content": "q"}, {"role": "assistant", "content": "a"}],
             r"message 0 has role 'usr', not one of system, developer, user, assistant"),
    "no_answer": ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                  r"no assistant turn, so nothing to train on; add the answer or delete the record"),
}  # fmt: skip
GOOD_CHAT = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]


def test_bad_chat_records_are_refused_naming_file_and_line_or_skipped_and_named(tmp_path):
    folder = chat_folder(tmp_path / "qwen", untagged(QWEN2_TEMPLATE))
    data = tmp_path / "chat.jsonl"
    chat = [f"data.tokenizer={folder / 'tokenizer.json'}", "data.format=chat", f"data.path={data}", "data.seq_len=256"]
    for name, (messages, message) in BAD_CHATS.items():
        data.write_text("\n".join(json.dumps({"messages": m}) for m in [GOOD_CHAT, GOOD_CHAT, messages]) + "\n")
        with pytest.raises(DataError, match=rf"^{data}:3: {message}") as e:
            sft_task(tmp_path, *chat).prepare_data()
        assert "\n" not in str(e.value), name
    lines = [GOOD_CHAT] * 3 + [m for m, _ in BAD_CHATS.values()] * 2  # 10 bad records on lines 4..13
    data.write_text("\n".join(json.dumps({"messages": m}) for m in lines) + "\n")
    task = sft_task(tmp_path, *chat, "data.skip_bad_records=true", "data.valid_percent=0")
    task.prepare_data()
    s = task.sft_splits
    assert (s.records, s.skipped.count, len(s.train.samples)) == (13, 10, 3)
    named = ", ".join(f"{data}:{n}" for n in range(4, 9))
    assert f", 10 ({named}, ...) skipped as bad (data.skip_bad_records)\n" in task.data_summary()


def test_bad_prompt_completion_records_are_refused_naming_file_and_line(tmp_path):
    data = tmp_path / "pc.jsonl"
    for record, message in (
        ({"prompt": "p", "completion": None}, "'completion' is null"),
        ({"prompt": 3, "completion": "a"}, "'prompt' is a int, not a string"),
        ({"prompt": "p", "completion": ""}, "'completion' is empty, nothing to train on"),
    ):
        data.write_text(json.dumps({"prompt": "p", "completion": "a"}) + "\n" + json.dumps(record) + "\n")
        with pytest.raises(DataError, match=rf"^{data}:2: {message}; .*data.skip_bad_records=true skips"):
            sft_task(tmp_path, f"data.path={data}").prepare_data()


# ---- linear, bounded costs (issue 47, item 4) ----------------------------------------------------------------------
def long_chat(turns: int, pad: str = "") -> list[dict]:
    return [m for i in range(turns) for m in ({"role": "user", "content": f"{pad}question {i}"},
                                                {"role": "assistant", "content": f"answer {i}{pad}"})]  # fmt: skip


def counted_renders(template, monkeypatch) -> list[int]:
    calls = []
    render = type(template).render
    monkeypatch.setattr(type(template), "render", lambda self, *a, **k: calls.append(1) or render(self, *a, **k))
    return calls


@pytest.mark.parametrize("template", [untagged(QWEN2_TEMPLATE), LLAMA3_TEMPLATE], ids=["qwen2", "llama3"])
def test_a_record_is_rendered_a_fixed_number_of_times_whatever_its_turns(template, monkeypatch):
    """The prefix of every assistant turn was rendered twice (500/1000/2000 turns in 0.42/1.56/6.72 s; 12,000 in
    about 4 minutes at every start): now the record, the record marked, and the first answer's two prefixes; the
    spans are those every turn's prefixes give."""
    chat = ChatTemplate(template, {"bos_token": "<s>"}, "test.jinja")
    messages = long_chat(300)
    calls = counted_renders(chat, monkeypatch)
    text, spans = chat.assistant_spans(messages, "chat.jsonl:7")
    assert len(calls) == 4
    expected = [chat._prefix_span(messages, i, text, "chat.jsonl:7") for i in range(1, 600, 2)]
    assert spans == expected and len(spans) == 300


def test_a_template_the_markers_cannot_follow_falls_back_for_few_turns_and_refuses_many():
    """Llama 3's template trims each content: padded contents defeat the markers, so each turn's prefixes give the
    spans, for records of up to PREFIX_RENDER_MAX_TURNS answers; more are refused naming the record."""
    chat = ChatTemplate(LLAMA3_TEMPLATE, {"bos_token": "<s>"}, "llama3.jinja")
    few = long_chat(PREFIX_RENDER_MAX_TURNS, pad="  ")
    text, spans = chat.assistant_spans(few, "chat.jsonl:3")
    assert spans == [chat._prefix_span(few, i, text, "x") for i in range(1, len(few), 2)]
    with pytest.raises(DataError, match=r"^chat.jsonl:4: the chat template of llama3.jinja changes the text of a turn"):
        chat.assistant_spans(long_chat(PREFIX_RENDER_MAX_TURNS + 1, pad="  "), "chat.jsonl:4")


def test_a_record_past_the_size_cap_is_refused_naming_its_file_and_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    big = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * (RECORD_MAX_CHARS + 1)}]
    path.write_text(json.dumps({"messages": long_chat(1)}) + "\n" + json.dumps({"messages": big}) + "\n")
    folder = chat_folder(tmp_path / "qwen", untagged(QWEN2_TEMPLATE))
    task = sft_task(tmp_path, f"data.tokenizer={folder / 'tokenizer.json'}", "data.format=chat", f"data.path={path}")
    with pytest.raises(DataError, match=rf"^{path}:2: the record's messages hold 4,194,306 characters, more than"):
        task.prepare_data()
