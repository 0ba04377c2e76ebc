"""A chat template's render is bounded in time, memory and output (shardlab_tasks/lm/finetuning/sft_render.py), each
refusal one line naming the record and the template; compiling a template computes nothing of it; the sandbox still
blocks a template reaching Python (issue 47, item 4)."""

from __future__ import annotations

import json

import pytest

from shardlab.errors import DataError
from shardlab_tasks.lm.finetuning import sft_template
from shardlab_tasks.lm.finetuning.sft_render import BoundedRenderer
from shardlab_tasks.lm.finetuning.sft_template import ChatTemplate

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>"
PLAIN += "{% endif %}"

ATTACKS = {
    "loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took more than 2 s"),
    "repeat": ("{{ 'a'*10**10 }}", "needed more than the 256 MiB of memory a render may take"),
    "tojson": ("{{ messages|tojson(indent=10**9) }}", "needed more than the 256 MiB of memory a render may take"),
    "strftime": ("{{ strftime_now('%Y'*10**8) }}", "refused: fix the template or delete the record"),
}


def test_a_template_renders_in_the_child_as_in_the_process():
    template = ChatTemplate(PLAIN, {}, "plain.jinja")
    with BoundedRenderer(template, timeout_s=30) as renderer:
        assert renderer.assistant_spans(CHAT, "c.jsonl:1") == template.assistant_spans(CHAT, "c.jsonl:1")
        assert renderer.assistant_spans(CHAT[:1], "c.jsonl:2") == ("<user>hi</s>", [])


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_template_past_its_time_or_memory_is_refused_in_one_line_naming_record_and_template(attack):
    """Nested range(100000) loops ran past 15 s; 'a'*10**10, tojson(indent=10**9) and strftime_now('%Y'*10**8) each
    passed 1.5 GB in seconds (here with 2 s and 256 MiB, the defaults being 10 s and 2 GiB)."""
    source, reason = ATTACKS[attack]
    renderer = BoundedRenderer(ChatTemplate(source + PLAIN, {}, f"{attack}.jinja"), timeout_s=2, memory_bytes=2**28)
    with renderer, pytest.raises(DataError) as refused:
        renderer.assistant_spans(CHAT, "chat.jsonl:9")
    message = str(refused.value)
    assert message.startswith(f"chat.jsonl:9: the chat template of {attack}.jinja ") and reason in message
    assert "\n" not in message


def test_an_output_past_the_cap_is_refused_as_it_streams(monkeypatch):
    monkeypatch.setattr(sft_template, "RENDER_MAX_CHARS", 1000)
    template = ChatTemplate("{% for i in range(100) %}{{ 'x' * 20 }}{% endfor %}" + PLAIN, {}, "long.jinja")
    with pytest.raises(DataError, match=r"^c.jsonl:3: the chat template of long.jinja rendered more than 1,000 char"):
        template.assistant_spans(CHAT, "c.jsonl:3")


@pytest.mark.parametrize(
    ("source", "folded"),
    [("{{ 'ab' * 3 }}", "ababab"), ("{{ 'ab' | center(12) }}", "ab".center(12)), ("{{ 'ab' + 'cd' }}", "abcd"),
     ("{{ 'aa' | replace('a', 'xy') }}", "xyxy")],
)  # fmt: skip
def test_compiling_a_template_computes_none_of_its_expressions(source, folded):
    """jinja2 folds constant expressions while compiling: 'a'*10**10 (or a filter with constant arguments) ran in the
    process that only compiles the template to check it, outside any bound (10 GB: the kernel killed it). The code
    compiled holds the expression, not its value, and the render (in the bounded child) computes it."""
    template = ChatTemplate(source, {}, "t.jinja")
    code = template.template.environment.compile(source, raw=True)
    assert folded not in code
    assert template.render([]) == folded


@pytest.mark.parametrize(
    "payload",
    ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ messages.__class__.__init__.__globals__ }}",
     "{{ cycler.__init__.__globals__.os.system('true') }}", "{% set x = messages.append(1) %}"],
)  # fmt: skip
def test_the_sandbox_still_refuses_a_template_reaching_python(payload):
    with BoundedRenderer(ChatTemplate(payload + PLAIN, {}, "evil.jinja"), timeout_s=30) as renderer:
        with pytest.raises(DataError, match=r"^c.jsonl:1: the chat template of evil.jinja failed to render it \("):
            renderer.assistant_spans(CHAT, "c.jsonl:1")


def test_a_chat_corpus_is_rendered_in_the_bounded_child(tmp_path, monkeypatch):
    """data.format=chat through prepare_data: a template that loops for ever is refused naming the file and line."""
    from shardlab_tasks.lm.finetuning import sft_render
    from tests.unit.test_sft import chat_folder, sft_task

    monkeypatch.setattr(sft_render, "RENDER_TIMEOUT_S", 2.0)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT + CHAT}) + "\n")
    loops = "{% if messages|length > 2 %}" + ATTACKS["loops"][0] + "{% endif %}" + PLAIN
    folder = chat_folder(tmp_path / "model", loops)
    task = sft_task(tmp_path, f"data.tokenizer={folder / 'tokenizer.json'}", "data.format=chat", f"data.path={path}")
    with pytest.raises(DataError, match=rf"^{path}:2: the chat template of .*tokenizer_config.json took more than 2 s"):
        task.prepare_data()
