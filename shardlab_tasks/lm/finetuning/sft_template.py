"""A model's own chat template (its folder's ``chat_template.jinja``, as transformers 5 saves it, or the Jinja2
``chat_template`` of its tokenizer_config.json), rendered as transformers' ``apply_chat_template`` renders it, and the
character spans of the assistant turns in the result.

A template with transformers' ``{% generation %}`` ... ``{% endgeneration %}`` marks gives its spans itself: what the
marked blocks output, counted as transformers counts them (the characters the render has yielded when a block
ends), from one render; the answer tokens are then those overlapping a span (shardlab_tasks/lm/finetuning/sft.py), as
``return_assistant_tokens_mask`` gives them. A template without marks is searched as follows.

Rendering: jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls, transformers'
``tojson`` (no HTML escaping), ``raise_exception`` and ``strftime_now``; the template sees ``messages``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``). The text
is then tokenized whole, without added special tokens, as apply_chat_template(tokenize=True) does.

Assistant spans, prefix by prefix: for the assistant message i, the conversation up to it rendered with the generation
prompt ends where its answer starts, and the conversation through it rendered without ends where the answer (with its
end-of-turn tokens) ends. Both renders must be prefixes of the whole conversation's render: a template that rewrites
earlier turns (one that drops past reasoning, say) is refused for that record rather than trained on a wrong mask.
Rendering every turn's prefixes costs the square of the turns (12,000 turns: 4 minutes at every start), so only the
first answer is found that way; the others come from one more render, with each message's content between numbered
markers (private-use characters): the first answer tells what lies between the generation prompt and the content and
after the content to the end of the turn, and every other answer must show the same. A template the markers cannot
follow (one that trims a content, say) falls back to every turn's prefixes, for records of at most
PREFIX_RENDER_MAX_TURNS answers.
jinja2 comes with torch; nothing here imports transformers.
"""

from __future__ import annotations

import json
import os
import re
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from shardlab.errors import ConfigError, DataError
from shardlab.files.regular_file import NotAFile, describe_os_error, read_small_file

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""tokenizer_config.json entries a template may read (apply_chat_template passes the tokenizer's special tokens)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


FOLDABLE_BINOPS = frozenset({"+", "-", "*", "/", "//", "%", "**"})
"""Operators jinja2 would compute while compiling when both sides are constants (``'a'*10**10``: 10 GB in the process
that merely compiles the template); intercepted, they are computed when rendering, in the bounded child."""


def _unfolded(func):
    """``func`` as a filter or test jinja2 never calls while compiling (it folds calls with constant arguments:
    ``'a'|center(10**10)`` would run in the compiling process): marked to take the context, which it hands on as
    the original asks."""
    import jinja2
    from jinja2.utils import _PassArg

    passed = _PassArg.from_obj(func)
    if passed is _PassArg.context:
        return func

    @jinja2.pass_context
    def call(context, *args, **kwargs):
        first = {_PassArg.environment: (context.environment,), _PassArg.eval_context: (context.eval_ctx,)}
        return func(*first.get(passed, ()), *args, **kwargs)

    return call


class _Tracking:
    """The characters a render has yielded so far, and the [start, end) spans its generation blocks output."""

    def __init__(self) -> None:
        self.size, self.spans = 0, []


_TRACKING: ContextVar[_Tracking | None] = ContextVar("generation_spans", default=None)
GENERATION_MARK = re.compile(r"{%-?\s*generation\s*[-+]?%}")
"""A ``{% generation %}`` tag in a template's source: its spans then come from the marks."""


def _generation_extension():
    """jinja2's extension for transformers' ``{% generation %}`` blocks: each outputs its body and, while a render
    tracks them, records where the body lies (the characters yielded before it, as transformers counts)."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationMarks(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            if (tracking := _TRACKING.get()) is not None:
                tracking.spans.append((tracking.size, tracking.size + len(text)))
            return text

    return GenerationMarks


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = FOLDABLE_BINOPS

    extensions = [jinja2.ext.loopcontrols, _generation_extension()]
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = _tojson
    env.filters = {name: _unfolded(f) for name, f in env.filters.items()}
    env.tests = {name: _unfolded(f) for name, f in env.tests.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


RENDER_MAX_CHARS = 64 * 2**20
"""The most characters one render may output: a record's messages hold at most 4 Mi
(shardlab_tasks/lm/finetuning/sft.py), the template's own text around them is far less."""


class RenderTooLarge(Exception):
    """A render passed RENDER_MAX_CHARS (``size``: the characters output when it stopped)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class ChatTemplate:
    """A chat template and the special tokens it may read, from a tokenizer_config.json or a .jinja file."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.source, self.special_tokens, self.origin = source, special_tokens, origin
        self.marks_generation = GENERATION_MARK.search(source) is not None
        """Whether the template marks its answers with {% generation %} (its spans are then the marks')."""
        try:
            self.template = _compile(source)
        except Exception as e:  # jinja2's TemplateSyntaxError, with the line
            raise ConfigError(f"data.chat_template: {origin} is not a Jinja2 template jinja2 compiles ({e})") from None

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False, tracking: _Tracking | None = None
    ) -> str:
        """The template's output, streamed and refused past RENDER_MAX_CHARS (RenderTooLarge); ``tracking`` collects
        the spans of its {% generation %} blocks."""
        pieces, tracking = [], tracking or _Tracking()
        reset = _TRACKING.set(tracking)
        try:
            for piece in self.template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                **self.special_tokens,
            ):  # fmt: skip
                tracking.size += len(piece)
                if tracking.size > RENDER_MAX_CHARS:
                    raise RenderTooLarge(tracking.size)
                pieces.append(piece)
        finally:
            _TRACKING.reset(reset)
        return "".join(pieces)

    def _spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The text and answer spans: the {% generation %} blocks' where the template marks them, else found from
        its renders (module docstring)."""
        if self.marks_generation:
            tracking = _Tracking()
            return self.render(messages, tracking=tracking), tracking.spans
        text = self.render(messages)
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not assistants:
            return text, []
        first = self._prefix_span(messages, assistants[0], text, where)
        spans = self._marked_spans(messages, assistants, text, first)
        if spans is None:
            if len(assistants) > PREFIX_RENDER_MAX_TURNS:
                raise DataError(
                    f"{where}: the chat template of {self.origin} changes the text of a turn (trims it, say), so "
                    f"its {len(assistants)} answers could only be found by rendering each turn's prefixes, which "
                    f"costs the square of the turns; records of more than {PREFIX_RENDER_MAX_TURNS} answers are "
                    "refused with it: split the record"
                )
            spans = [self._prefix_span(messages, i, text, where) for i in assistants]
        return text, spans

    def assistant_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the [start, end) character span of each assistant turn in it); ``where`` names
        the record in errors. Linear in the turns (module docstring): the record rendered once plain and once
        marked, and the first assistant turn's two prefixes; only a template the markers cannot follow renders the
        prefixes of every turn, for at most PREFIX_RENDER_MAX_TURNS of them."""
        try:
            text, spans = self._spans(messages, where)
        except (DataError, MemoryError):
            raise
        except RenderTooLarge as e:
            raise DataError(
                f"{where}: the chat template of {self.origin} rendered more than {RENDER_MAX_CHARS:,} characters of "
                f"it ({e.size:,} so far); refused: fix the template or delete the record"
            ) from None
        except Exception as e:  # raise_exception in the template, a missing key, ...
            raise DataError(f"{where}: the chat template of {self.origin} failed to render it ({e})") from None
        return text, spans

    def _prefix_span(self, messages: list[dict], i: int, text: str, where: str) -> tuple[int, int]:
        """Assistant turn ``i``'s span by its prefixes: the conversation before it with the generation prompt ends
        where its answer starts, the conversation through it ends where the answer (and its end of turn) ends."""
        prompt = self.render(messages[:i], add_generation_prompt=True)
        through = self.render(messages[: i + 1])
        if not (text.startswith(prompt) and text.startswith(through) and len(prompt) <= len(through)):
            raise DataError(
                f"{where}: the chat template of {self.origin} renders turn {i} differently once later turns "
                "follow, so its answer tokens cannot be found; give data.chat_template a template that "
                "renders each turn the same whatever follows"
            )
        return len(prompt), len(through)

    def _marked_spans(
        self, messages: list[dict], assistants: list[int], text: str, first: tuple[int, int]
    ) -> list[tuple[int, int]] | None:
        """Every assistant span from one render with each content wrapped in markers, the first turn's span telling
        what lies between the generation prompt and the content, and after the content to the end of the turn;
        None where the markers do not show that (a template that trims or rewrites a content)."""
        marked = _marked(messages)
        bounds = None if marked is None else _content_bounds(self.render(marked), text, len(messages))
        if bounds is None or any(i not in bounds for i in assistants):
            return None
        start0, end0 = bounds[assistants[0]]
        if not (first[0] <= start0 <= end0 <= first[1]):
            return None
        lead, trail = text[first[0] : start0], text[end0 : first[1]]
        spans, done = [], 0
        for i in assistants:
            start, end = bounds[i]
            span = (start - len(lead), end + len(trail))
            if span[0] < done or text[span[0] : start] != lead or text[end : span[1]] != trail:
                return None
            spans.append(span)
            done = span[1]
        return spans


PREFIX_RENDER_MAX_TURNS = 64
"""The most assistant turns found by rendering each turn's prefixes (quadratic: 12,000 turns took 4 minutes at every
start, on every rank), for a template whose output the markers cannot follow."""

_START, _END = "\ue000", "\ue001"
"""Markers around each message's content (private-use characters, which no template or case filter changes), each
followed by the message's number as one private-use character of planes 15 and 16."""
_NUMBERED = 2 * 65534


def _marked(messages: list[dict]) -> list[dict] | None:
    """``messages`` with each string content between numbered markers; None when one cannot be marked (not a string,
    holding a marker already, more messages than numbers)."""
    if len(messages) > _NUMBERED:
        return None
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, str) or _START in content or _END in content:
            return None
        number = chr(0xF0000 + i if i < 65534 else 0x100000 + i - 65534)
        out.append({**m, "content": f"{_START}{number}{content}{_END}{number}"})
    return out


def _number(ch: str) -> int:
    code = ord(ch)
    return code - 0xF0000 if code < 0x100000 else code - 0x100000 + 65534


_MARKS = re.compile(f"[{_START}{_END}][\U000f0000-\U000ffffd\U00100000-\U0010fffd]")


def _content_bounds(marked: str, text: str, count: int) -> dict[int, tuple[int, int]] | None:
    """Message number -> [start, end) of its content in ``text``, from the marked render; None unless the marked
    render is ``text`` with markers, each message's pair once and in order."""
    starts: dict[int, int] = {}
    bounds: dict[int, tuple[int, int]] = {}
    for k, m in enumerate(_MARKS.finditer(marked)):
        i, at = _number(m.group()[1]), m.start() - 2 * k  # where it is in the render without markers
        if i >= count or i in bounds or (m.group()[0] == _START) == (i in starts):
            return None
        if m.group()[0] == _START:
            starts[i] = at
        else:
            bounds[i] = (starts[i], at)
    if len(bounds) != len(starts) or _MARKS.sub("", marked) != text:
        return None
    return bounds


def _read_template_file(path: Path, key: str) -> str:
    """The text of a template file (a .jinja or a tokenizer_config.json) through the one reader: a regular file of at
    most SMALL_FILE_MAX_BYTES (a 4 GB tokenizer_config.json was once read whole), links followed as in a Hugging Face
    cache; a ConfigError naming ``key`` and the file otherwise."""
    fix = "give a tokenizer_config.json or a .jinja file"
    try:
        return read_small_file(path).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{key}: {path} does not exist; {fix}") from None
    except NotAFile as e:
        raise ConfigError(f"{key}: {path} {e.reason}; {fix}") from None
    except OSError as e:
        raise ConfigError(f"{key}: {path} {describe_os_error(path, e)}; {fix}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {path} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None


def load_chat_template(path: str | Path, key: str = "data.chat_template") -> ChatTemplate:
    """The template of a tokenizer_config.json (its ``chat_template``: a string, or a list of named templates of
    which ``default`` is used) with its special tokens, or of a .jinja file with the special tokens of the
    tokenizer_config.json beside it, if any (a folder as transformers 5 saves it). ``key`` names the setting the path
    came from in errors."""
    path = Path(path).expanduser()
    text = _read_template_file(path, key)
    if path.suffix != ".json":
        beside = path.parent / "tokenizer_config.json"
        config = _config_beside(beside, key) if os.path.lexists(beside) else {}
        return ChatTemplate(text, _special_tokens(config or {}), str(path))
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{key}: {path} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {path} holds a JSON {type(config).__name__}, not an object")
    return _from_config(config, path, key)


def _special_tokens(config: dict) -> dict[str, str]:
    """The special tokens (SPECIAL_TOKENS) a tokenizer_config.json's object names, as strings."""
    special = {}
    for name in SPECIAL_TOKENS:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[name] = token
    return special


def _from_config(config: dict, path: Path, key: str) -> ChatTemplate:
    """The template of a tokenizer_config.json's object, with the special tokens it names."""
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise ConfigError(
            f"{key}: {path} has no chat_template string; give a .jinja file, or use "
            "data.format=prompt_completion (joined without a template)"
        )
    return ChatTemplate(source, _special_tokens(config), str(path))


def _config_beside(path: Path, key: str) -> dict | None:
    """A tokenizer_config.json's object, read once through the one reader; None when it is not a JSON object."""
    try:
        config = json.loads(_read_template_file(path, key))
    except ValueError:
        return None
    return config if isinstance(config, dict) else None


def find_chat_template(setting: str | None, tokenizer: str) -> ChatTemplate | None:
    """data.chat_template if set, else the model folder's (the one beside data.tokenizer): its chat_template.jinja
    (transformers 5's form, which transformers prefers to the config's) with the special tokens of its
    tokenizer_config.json, else that config's chat_template, else None."""
    if setting:
        return load_chat_template(setting)
    if tokenizer == "byte":
        return None
    folder = Path(tokenizer).expanduser().parent
    if os.path.lexists(folder / "chat_template.jinja"):
        return load_chat_template(folder / "chat_template.jinja", "data.tokenizer")
    beside = folder / "tokenizer_config.json"
    if not os.path.lexists(beside):
        return None
    config = _config_beside(beside, "data.tokenizer")
    if config is None or "chat_template" not in config:
        return None
    return _from_config(config, beside, "data.tokenizer")
