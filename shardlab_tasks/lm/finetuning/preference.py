"""Preference pairs (data.format=preference): a prompt with a chosen and a rejected answer, as token rows for DPO.

Records come as the SFT records do (shardlab_tasks/lm/finetuning/sft.py: JSONL or Parquet under data.path, or the
embedded demo with data.path=null) in TRL's two preference formats:
- standard: ``prompt``, ``chosen`` and ``rejected`` strings (data.prompt_field, data.chosen_field,
  data.rejected_field); each answer gets the end-of-text token, as TRL's DPOTrainer appends the EOS;
- conversational: ``prompt`` a list of {role, content} messages and ``chosen``/``rejected`` lists holding the
  assistant's turn(s), rendered with the model's chat template (the prompt with the generation prompt); without a
  prompt field, ``chosen`` and ``rejected`` are whole conversations and the messages they share are the prompt.
As TRL tokenizes them: the prompt alone and the prompt followed by each answer, the answer tokens being those after
the longest prefix the three share (a template or a merge across the boundary can make the prompt alone differ).
Each pair is checked: a record lacking a field, of the wrong type, or whose answers are empty or identical is refused
in one line naming file:line. A pair longer than data.seq_len + 1 is cut (both rows), and one left without an
answer token in either row is dropped, counted as SFT counts them. Each answer is a row of its own (collate_pairs),
or with data.pack=true a micro-batch's answers share rows as segments (pack_pairs).

The demo: for each of the SFT demo's stdlib functions, its def line and docstring the prompt, its body the chosen
answer, and the body of the next function whose body fits beside the prompt the rejected one: a plausible answer to
another question. Deterministic for a Python version.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus.binarize import is_valid_document
from shardlab_tasks.lm.finetuning.sft import DEMO_MAX_CHARS, Sample, demo_records, encode_with_starts, file_records
from shardlab_tasks.lm.finetuning.sft_template import ChatTemplate
from shardlab_tasks.lm.sft_packing import IGNORE, PAD_SEGMENT, pack, packed_row, rounded_up


@dataclass
class Pair:
    chosen: Sample
    rejected: Sample


# ---- records ---------------------------------------------------------------------------------------------------
def demo_pairs() -> list[tuple[str, dict[str, str]]]:
    """(split key, {prompt, chosen, rejected}) from the SFT demo's records (sft.demo_records)."""
    records = list(demo_records())
    pairs = []
    for i, (key, record) in enumerate(records):
        prompt, body = record["prompt"], record["completion"]
        for k in range(1, len(records)):
            other = records[(i + k) % len(records)][1]["completion"]
            if other != body and len(prompt) + len(other) <= DEMO_MAX_CHARS:
                pairs.append((key, {"prompt": prompt, "chosen": body, "rejected": other}))
                break
    return pairs


def _messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)


def _fields(record: dict, where: str, d: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a record: three strings, or three message lists (an implicit prompt taken from
    the messages chosen and rejected share); refused in one line naming ``where`` otherwise."""
    names = (d.prompt_field, d.chosen_field, d.rejected_field)
    prompt, chosen, rejected = (record.get(name) for name in names)
    fix = "data.prompt_field, data.chosen_field and data.rejected_field name the fields"
    for name, value in zip(names[1:], (chosen, rejected), strict=True):
        if value is None:
            raise DataError(f"{where}: no {name!r} field (found: {', '.join(record)}); {fix}")
    if prompt is None and _messages(chosen) and _messages(rejected):  # TRL's implicit prompt
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return prompt, chosen, rejected
    if _messages(prompt) and _messages(chosen) and _messages(rejected):
        return prompt, chosen, rejected
    for name, value in zip(names, (prompt, chosen, rejected), strict=True):
        for i, message in enumerate(value if isinstance(value, list) else []):
            content = message.get("content") if isinstance(message, dict) else message
            if not isinstance(content, str):
                raise DataError(f"{where}: message {i} of {name!r} has {type(content).__name__} content, not a "
                                "string; fix or delete the record")  # fmt: skip
    kinds = ", ".join(f"{n}: {type(v).__name__}" for n, v in zip(names, (prompt, chosen, rejected), strict=True))
    raise DataError(
        f"{where}: a preference record holds three strings or three lists of {{role, content}} messages ({kinds}); "
        f"{fix}"
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def record_pair(record: dict, where: str, d: Any, tokenizer, template: ChatTemplate | None) -> Pair:
    """A record as its chosen and rejected samples (prompt tokens first, answer tokens marked), as TRL tokenizes."""
    prompt, chosen, rejected = _fields(record, where, d)
    if not chosen or not rejected:
        raise DataError(f"{where}: an empty chosen or rejected answer; fix or delete the record")
    if chosen == rejected:
        raise DataError(f"{where}: chosen and rejected are the same answer, nothing to prefer; fix or delete it")
    if isinstance(prompt, str):
        ids = [tokenizer.encode(text) for text in (prompt, prompt + chosen, prompt + rejected)]
        ids[1].append(tokenizer.eod)
        ids[2].append(tokenizer.eod)
    else:
        if template is None:
            raise DataError(f"{where}: conversational pairs need a chat template; set data.chat_template")
        try:
            texts = [template.render(prompt, add_generation_prompt=True), template.render(prompt + chosen),
                     template.render(prompt + rejected)]  # fmt: skip
        except Exception as e:  # raise_exception in the template, a missing key, ...
            raise DataError(f"{where}: the chat template of {template.origin} failed to render it ({e})") from None
        ids = [encode_with_starts(tokenizer, text)[0] for text in texts]
    start = min(_common_prefix(ids[0], ids[1]), _common_prefix(ids[0], ids[2]))
    c, r = ids[1], ids[2]
    return Pair(Sample(c, [i >= start for i in range(len(c))]), Sample(r, [i >= start for i in range(len(r))]))


# ---- the splits ----------------------------------------------------------------------------------------------------
class PairRows(Dataset):
    """Pair i as {"rows": a (2, 3, seq_len) tensor, its chosen and its rejected sample each in a row of its own
    (shardlab_tasks/lm/sft_packing.py), "index": i + offset}: the index names the pair in the precomputed reference
    log-probabilities (shardlab_tasks/lm/finetuning/dpo.py), the validation split's after the training split's."""

    def __init__(self, pairs: list[Pair], seq_len: int, pad_id: int, offset: int = 0) -> None:
        self.pairs, self.seq_len, self.pad_id, self.offset = pairs, seq_len, pad_id, offset
        self.answer_tokens = sum(sum(s.answer[1:]) for p in pairs for s in (p.chosen, p.rejected))

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        pair = self.pairs[i]
        rows = [packed_row([(s.ids, s.answer)], self.seq_len, self.pad_id) for s in (pair.chosen, pair.rejected)]
        return {"rows": torch.stack(rows), "index": torch.tensor(i + self.offset)}


@dataclass
class PreferenceSplits:
    train: PairRows
    valid: PairRows
    truncated: int
    """Pairs cut to data.seq_len + 1 tokens."""
    dropped: int
    """Pairs left without an answer token in a row (their prompt fills data.seq_len), not trained on."""
    records: int
    """Records read (every one: held out, cut and dropped ones too)."""

    def summary(self, source: str, seq_len: int) -> str:
        train, valid = self.train, self.valid
        return (
            f"preference pairs from {source}: {self.records:,} read, {len(valid):,} held out for validation, "
            f"{self.truncated:,} cut (longer than data.seq_len={seq_len}), {self.dropped:,} dropped (no answer token "
            f"within it)\n  {len(train):,} train pairs ({train.answer_tokens:,} answer tokens), {len(valid):,} valid "
            f"({valid.answer_tokens:,})"
        )


def _cut(sample: Sample, length: int) -> Sample:
    return Sample(sample.ids[:length], sample.answer[:length])


def open_preference_splits(d: Any, tokenizer, template: ChatTemplate | None) -> PreferenceSplits:
    """The train and validation pairs of data.* (data.path's records, or the demo's)."""
    records: Iterator[tuple[str, str, dict]]
    if d.path is None:
        records = ((key, key, record) for key, record in demo_pairs())
    else:
        records = file_records(d.path)
    splits: dict[str, list[Pair]] = {"train": [], "valid": []}
    truncated = dropped = read = 0
    limit = d.seq_len + 1
    for key, where, record in records:
        read += 1
        pair = record_pair(record, where, d, tokenizer, template)
        if max(len(pair.chosen.ids), len(pair.rejected.ids)) > limit:
            pair, truncated = Pair(_cut(pair.chosen, limit), _cut(pair.rejected, limit)), truncated + 1
        if not (any(pair.chosen.answer[1:]) and any(pair.rejected.answer[1:])):
            dropped += 1
            continue
        splits["valid" if is_valid_document(key, d.valid_percent) else "train"].append(pair)
    if not splits["train"]:
        raise DataError(f"data.path: {d.path} gives no training pair with answer tokens; check data.format=preference "
                        "and its fields, or raise data.seq_len")  # fmt: skip
    train = PairRows(splits["train"], d.seq_len, tokenizer.eod)
    valid = PairRows(splits["valid"], d.seq_len, tokenizer.eod, offset=len(train))
    return PreferenceSplits(train, valid, truncated, dropped, read)


def collate_pairs(items: list[dict[str, torch.Tensor]], multiple: int = 1) -> dict[str, torch.Tensor]:
    """A batch of pairs, its rows cut after the longest sample's last position, rounded up to a ``multiple`` of
    positions (LanguageModelingTask.sequence_multiple): padding at the end of causal rows changes no log-probability
    before it, so the forward pays for real tokens only."""
    rows = torch.stack([item["rows"] for item in items])
    used = rounded_up(int((rows[:, :, 2] == 0).sum(-1).max()), multiple)  # segment 0: the sample; -1: its padding
    return {"rows": rows[..., :used].contiguous(), "index": torch.stack([item["index"] for item in items])}


def pack_pairs(
    items: list[dict[str, torch.Tensor]], seq_len: int, pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """A micro-batch of pairs packed (data.pack=true): its 2 n answers' sequences, pair j's chosen numbered 2 j and its
    rejected 2 j + 1, filled in that order into rows of seq_len positions (sft_packing.pack: next fit, so it depends
    on the micro-batch alone and every rank and every replay packs alike), each sequence a segment whose id is its
    number: the models keep attention within it and restart its positions, and the loss sums its log-probabilities
    back to its pair (shardlab_tasks/lm/finetuning/dpo.py: pair_logps). A pair's two answers may land in different rows:
    the whole micro-batch goes through one forward either way. Rows cut after the longest row's last sequence (rounded
    up to
    ``multiple``); "index" as collate_pairs gives it (the precomputed reference's pair numbers)."""
    sequences = []
    for item in items:
        for answer in item["rows"]:  # (3, seq_len): the sample's positions (segment 0), then its padding
            sequences.append(answer[:2, : int((answer[2] == 0).sum())])
    groups = pack([s.shape[1] for s in sequences], seq_len)
    width = rounded_up(max(sum(sequences[k].shape[1] for k in group) for group in groups), multiple)
    rows = torch.tensor([pad_id, IGNORE, PAD_SEGMENT]).repeat(len(groups), width, 1).transpose(1, 2).contiguous()
    for r, group in enumerate(groups):
        at = 0
        for k in group:
            n = sequences[k].shape[1]
            rows[r, :2, at : at + n] = sequences[k]
            rows[r, 2, at : at + n] = k
            at += n
    return {"rows": rows, "index": torch.stack([item["index"] for item in items])}
