"""A model's own chat template (the Jinja2 ``chat_template`` of its tokenizer_config.json), rendered as transformers'
``apply_chat_template`` renders it, and the character spans of the assistant turns in the result.

Rendering: jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls, transformers'
``tojson`` (no HTML escaping), ``raise_exception`` and ``strftime_now``; the template sees ``messages``,
``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``). The text
is then tokenized whole, without added special tokens, as apply_chat_template(tokenize=True) does.

Assistant spans, prefix by prefix: for the assistant message i, the conversation up to it rendered with the generation
prompt ends where its answer starts, and the conversation through it rendered without ends where the answer (with its
end-of-turn tokens) ends. Both renders must be prefixes of the whole conversation's render: a template that rewrites
earlier turns (one that drops past reasoning, say) is refused for that record rather than trained on a wrong mask.
jinja2 comes with torch; nothing here imports transformers.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from shardlab.checkpoint.regular_file import NotAFile, describe_os_error, read_small_file
from shardlab.errors import ConfigError, DataError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""tokenizer_config.json entries a template may read (apply_chat_template passes the tokenizer's special tokens)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """A chat template and the special tokens it may read, from a tokenizer_config.json or a .jinja file."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.source, self.special_tokens, self.origin = source, special_tokens, origin
        try:
            self.template = _compile(source)
        except Exception as e:  # jinja2's TemplateSyntaxError, with the line
            raise ConfigError(f"data.chat_template: {origin} is not a Jinja2 template jinja2 compiles ({e})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
            **self.special_tokens,
        )  # fmt: skip

    def assistant_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the [start, end) character span of each assistant turn in it); ``where`` names
        the record in errors."""
        try:
            text = self.render(messages)
            spans = []
            for i, message in enumerate(messages):
                if message.get("role") != "assistant":
                    continue
                prompt = self.render(messages[:i], add_generation_prompt=True)
                through = self.render(messages[: i + 1])
                if not (text.startswith(prompt) and text.startswith(through) and len(prompt) <= len(through)):
                    raise DataError(
                        f"{where}: the chat template of {self.origin} renders turn {i} differently once later turns "
                        "follow, so its answer tokens cannot be found; give data.chat_template a template that "
                        "renders each turn the same whatever follows"
                    )
                spans.append((len(prompt), len(through)))
        except DataError:
            raise
        except Exception as e:  # raise_exception in the template, a missing key, ...
            raise DataError(f"{where}: the chat template of {self.origin} failed to render it ({e})") from None
        return text, spans


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
    which ``default`` is used) with its special tokens, or of a .jinja file (no special tokens). ``key`` names the
    setting the path came from in errors."""
    path = Path(path).expanduser()
    text = _read_template_file(path, key)
    if path.suffix != ".json":
        return ChatTemplate(text, {}, str(path))
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{key}: {path} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {path} holds a JSON {type(config).__name__}, not an object")
    return _from_config(config, path, key)


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
    special = {}
    for name in SPECIAL_TOKENS:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[name] = token
    return ChatTemplate(source, special, str(path))


def find_chat_template(setting: str | None, tokenizer: str) -> ChatTemplate | None:
    """data.chat_template if set, else the template of the tokenizer_config.json beside data.tokenizer (a model
    folder's) when it has one, else None."""
    if setting:
        return load_chat_template(setting)
    if tokenizer == "byte":
        return None
    beside = Path(tokenizer).expanduser().parent / "tokenizer_config.json"
    if not os.path.lexists(beside):
        return None
    try:  # read once, through the one reader, as data.chat_template's file
        config = json.loads(_read_template_file(beside, "data.tokenizer"))
    except ValueError:
        return None
    if not isinstance(config, dict) or "chat_template" not in config:
        return None
    return _from_config(config, beside, "data.tokenizer")
