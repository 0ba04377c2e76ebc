"""Supervised fine-tuning data: instruction and chat records as token ids with an answer mask, packed into rows.

Records come from JSONL files (.gz and .zst too) or Parquet files (data.path: a file, directory or glob), or, with
data.path=null, from the embedded demo: one record per documented function of a few standard-library modules (its
signature and docstring the prompt, its body the answer). Two formats (data.format):
- ``chat``: a list of {role, content} messages (data.messages_field), rendered with the model's chat template
  (shardlab_tasks/lm/finetuning/sft_template.py); the assistant turns are the answer;
- ``prompt_completion``: a prompt and its answer (data.prompt_field, data.completion_field), rendered as a user and
  an assistant turn when there is a chat template, else joined as prompt + completion + end-of-text.
Only answer tokens are targets. A record goes to the validation split when a hash of its file and record number
falls in data.valid_percent (as the pretraining corpus splits documents). Samples longer than data.seq_len + 1 tokens
are cut; one left without an answer token is dropped. Rows are packed in record order
(shardlab_tasks/lm/sft_packing.py), so the dataset, a list of rows, is the same on every rank and world size, and the
run's global sample offset counts rows. Tokenized in memory at start (no cache): fine up to some 10^5 records.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import json
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from shardlab.errors import DataError
from shardlab.task import setting
from shardlab_tasks.lm.corpus.binarize import is_valid_document
from shardlab_tasks.lm.finetuning.sft_render import BoundedRenderer
from shardlab_tasks.lm.finetuning.sft_template import ChatTemplate
from shardlab_tasks.lm.loss import token_cross_entropy
from shardlab_tasks.lm.sft_packing import IGNORE, pack, packed_row

FORMATS = ("text", "chat", "prompt_completion")
"""data.format values: text is pretraining on documents; the others are fine-tuning records."""

DEMO_MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "ntpath", "genericpath", "string", "colorsys", "heapq",
                "bisect", "calendar", "base64", "json.encoder", "json.decoder", "html", "statistics", "difflib",
                "glob", "quopri", "csv", "copy", "keyword", "operator", "locale", "gettext", "ipaddress",
                "urllib.parse", "email.utils", "argparse", "configparser", "pathlib", "dataclasses", "functools",
                "inspect", "pprint", "random", "tokenize", "traceback", "uuid", "zipfile", "tarfile", "shutil",
                "logging", "fractions", "os", "linecache", "mimetypes", "plistlib", "queue", "sched", "selectors",
                "shelve", "tempfile", "threading", "timeit", "types", "typing", "warnings", "weakref", "ast", "dis",
                "enum", "collections", "abc", "codecs", "contextlib", "email.message", "http.client",
                "urllib.request", "unittest.case", "imaplib", "ftplib", "pydoc", "asyncio.base_events",
                "asyncio.events", "subprocess", "cmd", "bz2", "lzma", "platform", "poplib", "smtplib", "socketserver",
                "ssl", "symtable", "urllib.robotparser")  # fmt: skip
"""Standard-library modules whose documented functions and methods make the embedded demo (~410 on Python 3.11)."""

RECORD_MAX_CHARS = 4 * 2**20
"""The most characters a chat record's messages may hold (~1M tokens, past any context trained on): a record is
rendered and tokenized whole at every start, on every rank."""

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
"""Message roles a record may hold: those of the published chat templates (OpenAI's developer, Llama 3.1's ipython for
tool output)."""

NAMED_MAX = 5
"""How many records the start line names for each kind of record skipped, cut or dropped (then "..." and the count)."""

DEMO_MAX_CHARS = 250
"""Longest prompt + body the demo keeps: a sample fits in 256 byte tokens (the default LM's context) and several pack
into a row."""


class BadRecord(DataError):
    """A record that cannot be trained on as written (empty or null content, an unknown role, no answer): refused
    naming its file:line, or skipped with data.skip_bad_records=true."""


@dataclass
class Sample:
    ids: list[int]
    answer: list[bool]
    """Whether each token is an answer token (a target of the loss)."""


# ---- records ---------------------------------------------------------------------------------------------------
def demo_records() -> Iterator[tuple[str, dict[str, str]]]:
    """(split key, {prompt, completion}) for each documented public function and method of DEMO_MODULES whose source
    this Python has: the prompt is its ``def`` line and docstring, the completion the body after them.
    Deterministic for a Python version."""
    for module_name in DEMO_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for qualname, fn in _public_functions(module):
            pair = _function_pair(fn)
            if pair is not None:
                yield f"stdlib/{module_name}.{qualname}", {"prompt": pair[0], "completion": pair[1]}


def _public_functions(module) -> Iterator[tuple[str, Any]]:
    """(qualified name, function) of the module's own public functions and its classes' methods, sorted by name."""
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            yield name, value
        elif inspect.isclass(value):
            for method_name, method in sorted(vars(value).items()):
                if inspect.isfunction(method) and not method_name.startswith("_"):
                    yield f"{name}.{method_name}", method


def _function_pair(fn) -> tuple[str, str] | None:
    """(signature and docstring, body) of a function's source, or None without a docstring, body or source."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        node = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef) or len(node.body) < 2 or ast.get_docstring(node) is None:
        return None
    lines = source.splitlines(keepends=True)
    prompt = "".join(lines[node.lineno - 1 : node.body[0].end_lineno])  # decorators left out: the def on
    body = "".join(lines[node.body[1].lineno - 1 : node.end_lineno])
    if len(prompt) + len(body) > DEMO_MAX_CHARS:
        return None
    return prompt, body


def file_records(path: str) -> Iterator[tuple[str, str, dict]]:
    """(split key, where, record) for each record of the JSONL and Parquet files under data.path, in file order."""
    from shardlab_tasks.lm.corpus.corpus import find_sources, read_blocks

    for source in find_sources(Path(path).expanduser()):
        if source.format == "parquet":
            yield from _parquet_records(source)
        elif source.format == "jsonl":
            for block in read_blocks(source):
                for n, line in enumerate(block.data.splitlines(), start=block.first_line):
                    if line.strip():
                        yield f"{source.split_key}:{n}", f"{source.path}:{n}", _json_record(line, source.path, n)
        else:
            raise DataError(
                f"data.path: {source.path} is not JSONL or Parquet; fine-tuning records (data.format) are read from "
                ".jsonl (.gz, .zst) and .parquet files"
            )


def _json_record(line: bytes, path: Path, n: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{n}: not a JSON object ({e}); fix or delete the line") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{n}: a JSON {type(record).__name__}, not an object; fix or delete the line")
    return record


def _parquet_records(source) -> Iterator[tuple[str, str, dict]]:
    from shardlab_tasks.lm.corpus import columnar

    pq = columnar.require("pyarrow.parquet", f"{source.path} (a Parquet file)")
    for n, record in enumerate(pq.read_table(source.path).to_pylist(), start=1):
        yield f"{source.split_key}:{n}", f"{source.path} row {n}", record


# ---- samples -----------------------------------------------------------------------------------------------------
def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids of ``text``, the [start, end) characters of each token), as apply_chat_template tokenizes: the
    whole text, no special tokens added."""
    if getattr(tokenizer, "tok", None) is None:  # the byte tokenizer: a token per UTF-8 byte
        offsets = [(i, i + 1) for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]
        return list(text.encode("utf-8")), offsets
    encoding = tokenizer.tok.encode(text, add_special_tokens=False)
    return list(encoding.ids), list(encoding.offsets)


def encode_with_starts(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(token ids of ``text``, the character where each token starts): encode_with_offsets' starts (the preference
    pairs of shardlab_tasks/lm/finetuning/preference.py read them)."""
    ids, offsets = encode_with_offsets(tokenizer, text)
    return ids, [start for start, _ in offsets]


def span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], overlap: bool) -> list[bool]:
    """Whether each token is an answer token: it overlaps a span (``overlap``: transformers' rule for
    {% generation %} spans) or starts inside one. One pass: tokens and spans are both in order."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        inside = k < len(spans) and (end > spans[k][0] if overlap else start >= spans[k][0])
        mask.append(inside)
    return mask


def without_trailing_whitespace(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each span less the whitespace it ends with (ChatML's newline after <|im_end|>): data.train_after_end_of_turn
    false."""
    out = []
    for a, b in spans:
        while b > a and text[b - 1].isspace():
            b -= 1
        out.append((a, b))
    return out


def message_errors(messages: Any, where: str) -> None:
    """A BadRecord naming the first problem of a chat record's messages: not a list of {role, content} objects, an
    unknown role, a content that is null, not a string or (an assistant's) empty, no assistant turn."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise BadRecord(f"{where}: messages must be a list of {{role, content}} objects; name the field with "
                        "data.messages_field")  # fmt: skip
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        if role not in ROLES:
            raise BadRecord(f"{where}: message {i} has role {role!r}, not one of {', '.join(ROLES)}; fix the role "
                            "or delete the record (data.skip_bad_records=true skips such records)")  # fmt: skip
        if not isinstance(content, str):
            what = "no content" if content is None else f"a {type(content).__name__} content, not a string"
            raise BadRecord(f"{where}: message {i} ({role}) has {what}; write its text as a string or delete the "
                            "record (data.skip_bad_records=true skips such records)")  # fmt: skip
        if role == "assistant" and not content.strip():
            raise BadRecord(f"{where}: message {i} (assistant) has empty content (it would train on a lone "
                            "end-of-turn); fill it or delete the record (data.skip_bad_records=true skips such "
                            "records)")  # fmt: skip
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord(f"{where}: no assistant turn, so nothing to train on; add the answer or delete the record "
                        "(data.skip_bad_records=true skips such records)")  # fmt: skip


def chat_sample(template: ChatTemplate, tokenizer, messages: Any, where: str, after_end_of_turn: bool = True) -> Sample:
    """The rendered conversation's tokens and its answer tokens: those overlapping a {% generation %} block where the
    template marks them (as transformers' return_assistant_tokens_mask), else those starting inside an assistant
    turn, the whitespace after its end-of-turn token included unless ``after_end_of_turn`` is false."""
    message_errors(messages, where)
    size = sum(len(m["content"]) for m in messages)
    if size > RECORD_MAX_CHARS:
        raise DataError(
            f"{where}: the record's messages hold {size:,} characters, more than the {RECORD_MAX_CHARS:,} a "
            "fine-tuning record may hold (longer than any data.seq_len trains on); split it or delete the line"
        )
    text, spans = template.assistant_spans(messages, where)
    ids, offsets = encode_with_offsets(tokenizer, text)
    if not template.marks_generation and not after_end_of_turn:
        spans = without_trailing_whitespace(text, spans)
    return Sample(ids, span_mask(offsets, spans, overlap=template.marks_generation))


def record_sample(record: dict, where: str, d: Any, tokenizer, template: ChatTemplate | None) -> Sample:
    """A record of data.format as a sample."""
    after_end_of_turn = setting(d, "train_after_end_of_turn", True)
    if d.format == "chat":
        if d.messages_field not in record:
            raise DataError(f"{where}: no {d.messages_field!r} field (found: {', '.join(record)}); name it with "
                            "data.messages_field")  # fmt: skip
        return chat_sample(template, tokenizer, record[d.messages_field], where, after_end_of_turn)
    for key in (d.prompt_field, d.completion_field):
        if key not in record:
            raise DataError(f"{where}: no {key!r} text field (found: {', '.join(record)}); name the fields with "
                            "data.prompt_field and data.completion_field")  # fmt: skip
        if not isinstance(record[key], str):
            what = "null" if record[key] is None else f"a {type(record[key]).__name__}, not a string"
            raise BadRecord(f"{where}: {key!r} is {what}; write it as a string or delete the record "
                            "(data.skip_bad_records=true skips such records)")  # fmt: skip
    prompt, completion = record[d.prompt_field], record[d.completion_field]
    if not completion.strip():
        raise BadRecord(f"{where}: {d.completion_field!r} is empty, nothing to train on; fill it or delete the record "
                        "(data.skip_bad_records=true skips such records)")  # fmt: skip
    if template is not None:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return chat_sample(template, tokenizer, messages, where, after_end_of_turn)
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion) + [tokenizer.eod]
    return Sample(p + c, [False] * len(p) + [True] * len(c))


# ---- the splits ----------------------------------------------------------------------------------------------------
class PackedRows(Dataset):
    """Rows of data.seq_len positions, each a (3, seq_len) tensor (shardlab_tasks/lm/sft_packing.py); sample i is row
    i."""

    def __init__(self, samples: list[Sample], seq_len: int, pad_id: int, packed: bool) -> None:
        self.samples, self.seq_len, self.pad_id = samples, seq_len, pad_id
        lengths = [len(s.ids) - 1 for s in samples]
        self.rows = pack(lengths, seq_len) if packed else [[i] for i in range(len(samples))]
        self.answer_tokens = sum(sum(s.answer[1:]) for s in samples)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return packed_row([(self.samples[j].ids, self.samples[j].answer) for j in self.rows[i]], self.seq_len,
                          self.pad_id)  # fmt: skip


@dataclass
class Named:
    """A count of records and the first NAMED_MAX of them by file:line (what the start line prints)."""

    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, where: str) -> None:
        self.count += 1
        if len(self.first) < NAMED_MAX:
            self.first.append(where)

    def __str__(self) -> str:
        if not self.count:
            return "0"
        more = ", ..." if self.count > len(self.first) else ""
        return f"{self.count:,} ({', '.join(self.first)}{more})"


@dataclass
class SFTSplits:
    train: PackedRows
    valid: PackedRows
    cut: Named
    """Samples cut to data.seq_len + 1 tokens."""
    dropped: Named
    """Samples left without an answer token (their prompt fills data.seq_len), not trained on."""
    records: int = 0
    """Records read (every one: held out, cut, dropped and skipped ones too)."""
    skipped: Named = field(default_factory=Named)
    """Bad records skipped (data.skip_bad_records=true)."""

    def summary(self, source: str, seq_len: int) -> str:
        """The line a run starts with: what was read and what became of it, as the corpus cache's lines say."""
        train, valid = self.train, self.valid
        skipped = f", {self.skipped} skipped as bad (data.skip_bad_records)" if self.skipped.count else ""
        return (
            f"fine-tuning records from {source}: {self.records:,} read, {len(valid.samples):,} held out for "
            f"validation, {self.cut} cut (longer than data.seq_len={seq_len}), {self.dropped} dropped (no "
            f"answer token within it){skipped}\n  {len(train.samples):,} train samples in {len(train):,} rows "
            f"({train.answer_tokens:,} answer tokens), {len(valid.samples):,} valid in {len(valid):,} rows "
            f"({valid.answer_tokens:,})"
        )


def open_sft_splits(d: Any, tokenizer, template: ChatTemplate | None, packed: bool) -> SFTSplits:
    """The train and validation rows of data.* (data.path's records, or the demo's). A bad record (BadRecord) is
    refused naming it, or with data.skip_bad_records counted and named in the start line."""
    if d.path is None:
        records = ((key, key, record) for key, record in demo_records())
    else:
        records = file_records(d.path)
    splits: dict[str, list[Sample]] = {"train": [], "valid": []}
    cut, dropped, skipped, read = Named(), Named(), Named(), 0
    skip_bad = setting(d, "skip_bad_records", False)
    # a model folder's template is someone else's code: rendered in a child process with limits (sft_render.py)
    with BoundedRenderer(template) if template is not None else contextlib.nullcontext() as renderer:
        for key, where, record in records:
            read += 1
            try:
                sample = record_sample(record, where, d, tokenizer, renderer)
            except BadRecord:
                if not skip_bad:
                    raise
                skipped.add(where)
                continue
            if len(sample.ids) > d.seq_len + 1:
                sample = Sample(sample.ids[: d.seq_len + 1], sample.answer[: d.seq_len + 1])
                cut.add(where)
            if not any(sample.answer[1:]):
                dropped.add(where)
                continue
            splits["valid" if is_valid_document(key, d.valid_percent) else "train"].append(sample)
    if not splits["train"]:
        raise DataError(f"data.path: {d.path} gives no training sample with an answer token; check data.format "
                        "and its fields, or raise data.seq_len")  # fmt: skip
    train, valid = (PackedRows(splits[s], d.seq_len, tokenizer.eod, packed) for s in ("train", "valid"))
    return SFTSplits(train, valid, cut, dropped, read, skipped)


# ---- the loss ------------------------------------------------------------------------------------------------------
def answer_token_loss(model, batch: torch.Tensor, device: torch.device, packed: bool):
    """Mean cross-entropy over the answer tokens of a batch of rows (batch, 3, seq_len), in fp32; (loss, sums of the
    loss and of the answer tokens). A packed row passes its segments, so no sample sees another; rows of one sample
    each need none (their padding follows the sample) and take the causal kernel of pretraining."""
    batch = batch.to(device, non_blocking=True)
    inputs, targets, segments = batch.unbind(1)
    return answer_loss(model(inputs, segments) if packed else model(inputs), targets)


def answer_loss(logits: torch.Tensor, targets: torch.Tensor):
    """Mean cross-entropy of ``logits`` over the answer tokens of ``targets`` (IGNORE elsewhere), in fp32; (loss, sums
    of the loss and of the answer tokens). Also the last pipeline stage's loss (LanguageModelingTask.pipeline_loss)."""
    flat = targets.reshape(-1)
    loss_sum = token_cross_entropy(logits, flat, ignore_index=IGNORE, reduction="sum")
    count = (flat != IGNORE).sum()
    return loss_sum / count.clamp(min=1), {"loss_sum": loss_sum.detach(), "count": count.float()}
