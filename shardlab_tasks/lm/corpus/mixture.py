"""Weighted mixtures of corpora (data.sources): each source is its own preprocessed corpus, and the data order, not
the files, decides how often each is read.

Global sample g (the run's data position, shardlab.data) maps to a source and a position in it by arithmetic alone:
the stream is cut into chunks of PERIOD samples, each chunk holds every source's share of PERIOD (largest remainders)
spread evenly through it (source s's k-th sample at key (k + phase_s) / n_s, the keys of all sources merged), so any
window of L consecutive samples holds L * weight_s samples of s, give or take two. The k-th sample of source s is
position k of its endless stream of epochs, each epoch a permutation seeded by (seed, the source's name, epoch): a
source that runs out repeats, reshuffled. Nothing depends on the world size or on where a run resumed, and weights
live only here: changing one re-preprocesses nothing.
"""

from __future__ import annotations

import bisect
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from shardlab.data import GlobalOrder
from shardlab.errors import DataError
from shardlab.task import setting
from shardlab_tasks.lm.corpus.cache import cache_key, corpus_sources, read_corpus_meta
from shardlab_tasks.lm.corpus.data import open_splits, prepare_corpus
from shardlab_tasks.lm.loss import token_cross_entropy

PERIOD = 4096
"""Samples per chunk of the assignment: shares are exact per chunk to 1/PERIOD (0.02 points)."""


def chunk_counts(weights: list[float], period: int = PERIOD) -> list[int]:
    """Each source's samples per chunk: weight x period rounded by largest remainders (they sum to period), and at
    least one, so a small weight is never rounded away. More sources than ``period`` cannot each have one (the
    largest would be taken down to 0 and never read): a DataError, which mixture_errors says before any preprocessing;
    so are weights that are not finite and positive with a finite sum (1e308 twice sums to inf: shares of 0)."""
    if len(weights) > period:
        raise DataError(too_many_sources(len(weights), period))
    total = sum(weights)
    if not weights or not all(math.isfinite(w) and w > 0 for w in weights) or not math.isfinite(total):
        raise DataError(f"mixture weights must be finite numbers > 0 with a finite sum, got {weights[:8]}")
    exact = [w / total * period for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda s: exact[s] - math.floor(exact[s]), reverse=True)
    for s in by_remainder[: max(0, period - sum(counts))]:
        counts[s] += 1
    while sum(counts) > period:  # the minimum of one pushed the total over: take from the largest
        counts[max(range(len(counts)), key=lambda s: counts[s])] -= 1
    return counts


def too_many_sources(count: int, period: int = PERIOD) -> str:
    """The refusal of a mixture with more sources than a chunk has samples (each source needs one per chunk)."""
    return (
        f"data.sources names {count} corpora; a mixture reads at most {period} (each source takes at least one of the "
        f"{period} samples of every chunk): merge small sources into one corpus folder"
    )


def source_seed(seed: int, name: str) -> int:
    """A source's own seed: by its name, so adding a source to a mixture leaves the others' shuffles as they were."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62


class MixtureOrder(GlobalOrder):
    """The training order of a mixture: global sample offset -> index into MixtureBlocks (its sources laid end to
    end). A GlobalOrder in the trainer's eyes (draw, indices, seed), so ranks, resume and DataLoader work unchanged."""

    def __init__(self, names: list[str], sizes: list[int], weights: list[float], seed: int) -> None:
        super().__init__(sum(sizes), seed, shuffle=True)
        self.names, self.sizes = names, sizes
        self.starts = np.cumsum([0, *sizes[:-1]])
        self.counts = chunk_counts(weights)
        # The source phases come from the seed, so two seeds interleave differently; ties break by source order.
        g = torch.Generator().manual_seed(seed)
        phases = torch.rand(len(sizes), generator=g, dtype=torch.float64).tolist()
        keys = [((k + phases[s]) / n, s, k) for s, n in enumerate(self.counts) for k in range(n)]
        keys.sort()
        self.source_of = np.array([s for _, s, _ in keys], dtype=np.int64)
        self.rank_of = np.array([k for _, _, k in keys], dtype=np.int64)
        self._source_perms: dict[tuple[int, int], torch.Tensor] = {}

    def locate(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) of each global offset: k counts that source's samples before it in the stream."""
        chunk, j = np.divmod(offsets, PERIOD)
        source = self.source_of[j]
        return source, chunk * np.asarray(self.counts)[source] + self.rank_of[j]

    def _source_permutation(self, source: int, epoch: int) -> torch.Tensor:
        key = (source, epoch)
        if key not in self._source_perms:
            g = torch.Generator().manual_seed(source_seed(self.seed, self.names[source]) * 7919 + epoch)
            self._source_perms[key] = torch.randperm(self.sizes[source], generator=g)
        return self._source_perms[key]

    def draw(self, start: int, count: int) -> None:
        """The permutations the global batch [start, start + count) reads, drawn on every rank in the same step (as
        GlobalOrder.draw); those it no longer reads are freed."""
        source, k = self.locate(np.arange(start, start + count))
        needed = {(int(s), int(e)) for s, e in zip(source, k // np.asarray(self.sizes)[source], strict=True)}
        for s, e in sorted(needed):
            self._source_permutation(s, e)
        self._source_perms = {key: p for key, p in self._source_perms.items() if key in needed}

    def indices(self, start: int, count: int) -> list[int]:
        source, k = self.locate(np.arange(start, start + count))
        epoch, pos = np.divmod(k, np.asarray(self.sizes)[source])
        return [
            int(self.starts[s]) + int(self._source_permutation(int(s), int(e))[p])
            for s, e, p in zip(source, epoch, pos, strict=True)
        ]

    def source_names(self, start: int, count: int) -> list[str]:
        """Which source each of global samples [start, start + count) comes from (tests, the dry run's shares)."""
        return [self.names[s] for s in self.locate(np.arange(start, start + count))[0]]


class MixtureBlocks(Dataset):
    """The sources' blocks laid end to end: index = a source's start + its block (MixtureOrder picks them)."""

    def __init__(self, parts: list[Dataset]) -> None:
        self.parts = parts
        self.starts = np.cumsum([0, *[len(p) for p in parts]]).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """(source, position in it) of index ``i``."""
        s = bisect.bisect_right(self.starts, i) - 1
        return s, i - self.starts[s]

    def __getitem__(self, i: int) -> torch.Tensor:
        s, pos = self.locate(i)
        return self.parts[s][pos]


class MixtureValid(Dataset):
    """The sources' validation blocks taken in turn (one of each while each lasts), each with its source's number,
    so validation.num_batches of any size measures every source: item = (tokens, source)."""

    def __init__(self, parts: list[Dataset]) -> None:
        self.parts = parts
        self.sizes = [len(p) for p in parts]

    def __len__(self) -> int:
        return sum(self.sizes)

    def locate(self, i: int) -> tuple[int, int]:
        """(source, position) of item ``i`` of the round robin: rounds of every source with blocks left."""
        active, done = list(range(len(self.sizes))), 0
        for s in sorted(active, key=lambda s: (self.sizes[s], s)):
            span = (self.sizes[s] - done) * len(active)
            if i < span:
                rounds, column = divmod(i, len(active))
                return active[column], done + rounds
            i, done = i - span, self.sizes[s]
            active.remove(s)
        raise IndexError(i)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        s, pos = self.locate(i)
        return self.parts[s][pos], s


def source_sums(token_losses: torch.Tensor, sources: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Per-source loss sums and token counts of a validation batch (token_losses: rows x tokens, fp32). Every source
    gets its keys, zeros included: the ranks all-reduce the same keys in the same order."""
    per_row = token_losses.sum(dim=1).detach()
    sources = sources.to(per_row.device)
    sums = {}
    for s, name in enumerate(names):
        mine = sources == s
        sums[f"loss_sum/{name}"] = (per_row * mine).sum()
        sums[f"count/{name}"] = mine.sum().float().cpu() * token_losses.size(1)
    return sums


def summarize_sources(sums: dict[str, float], names: list[str], weights: list[float]) -> dict[str, float]:
    """Each source's loss ('web/loss'; logged as valid/web/loss) and the mixture's: the weighted mean of the sources'
    losses, what the training mixture's expected loss is, whatever share of each the validation batches held."""
    metrics, total, weighted = {}, 0.0, 0.0
    for name, weight in zip(names, weights, strict=True):
        count = sums.get(f"count/{name}", 0.0)
        if count > 0:
            loss = sums[f"loss_sum/{name}"] / count
            metrics[f"{name}/loss"] = loss
            metrics[f"{name}/ppl"] = math.exp(min(loss, 50.0))
            total, weighted = total + weight, weighted + weight * loss
    if total == 0:
        return metrics
    loss = weighted / total
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), **metrics}  # the mixture's first, as a single corpus's


def epochs_seen(num_samples: int, seq_len: int, weight: float, train_tokens: int) -> float:
    """How many epochs of a source ``num_samples`` training samples read: samples x seq_len x weight / its tokens."""
    return num_samples * seq_len * weight / max(train_tokens, 1)


def mixture_valid_loss(model, batch: list, device: torch.device, names: list[str]):
    """The LM's loss on a mixture's validation batch [tokens, source of each row]: the mean next-token loss, with the
    sums of the whole batch and of each source apart."""
    tokens, sources = batch
    tokens = tokens.to(device, non_blocking=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)
    per_token = token_cross_entropy(logits, targets, reduction="none").view_as(targets)
    loss, n = per_token.mean(), targets.numel()
    sums = {"loss_sum": loss.detach() * n, "count": torch.tensor(float(n))}
    return loss, {**sums, **source_sums(per_token, sources, names)}


@dataclass
class Mixture:
    """The opened corpora of data.sources, in its order: names, weights (summing to 1), caches and their splits."""

    names: list[str]
    weights: list[float]
    corpora: list[Path]
    metas: list[dict]
    train: MixtureBlocks
    valid: MixtureValid

    def order(self, seed: int) -> MixtureOrder:
        return MixtureOrder(self.names, [len(p) for p in self.train.parts], self.weights, seed)

    def identity(self) -> str:
        """What this rank opened, a clause per source (shardlab.distributed.join compares the ranks' lines)."""
        return "; ".join(
            f"{name} x{w:.4g}: {m['train_tokens']:,} train / {m['valid_tokens']:,} valid tokens "
            f"({m.get('content_digest') or 'cache ' + corpus.name})"
            for name, w, m, corpus in zip(self.names, self.weights, self.metas, self.corpora, strict=True)
        )


def source_text_field(d, source) -> str:
    """A source's text field: its own, else data.text_field."""
    return setting(source, "text_field") or setting(d, "text_field", "text")


def open_mixture(d, tokenizer) -> Mixture:
    """Preprocess (each into its own cache, exactly as a data.path corpus) and open every corpus of data.sources."""
    names, weights, corpora, metas, trains, valids = [], [], [], [], [], []
    for name, source in d.sources.items():
        corpus = prepare_corpus(
            source.path, d.cache_dir, tokenizer, d.valid_percent, d.max_corpus_mb, source_text_field(d, source),
            setting(d, "num_preprocess_workers", -1),
        )  # fmt: skip
        try:
            train, valid = open_splits(corpus, d.seq_len)
        except DataError as e:
            raise DataError(f"data.sources.{name}: {e}") from None
        names.append(name)
        weights.append(float(source.weight))
        corpora.append(corpus)
        metas.append(read_corpus_meta(corpus))
        trains.append(train)
        valids.append(valid)
    total = sum(weights)
    weights = [w / total for w in weights]
    return Mixture(names, weights, corpora, metas, MixtureBlocks(trains), MixtureValid(valids))


def mixture_errors(d) -> list[str]:
    """data.sources' problems, each naming its key: one corpus key at a time, positive weights, corpora that exist."""
    sources = setting(d, "sources") or {}
    if not sources:
        return []
    errors = [] if len(sources) <= PERIOD else [too_many_sources(len(sources))]
    if d.path is not None:
        errors.append(
            "data.path and data.sources both name the training corpus; keep one (a mixture names each corpus in "
            "data.sources.<name>.path)"
        )
    if setting(d, "format", "text") != "text":
        errors.append(f"data.sources mixes pretraining corpora; data.format={d.format} reads one data.path")
    for name, source in sources.items():
        if "/" in name or not name:
            errors.append(f"data.sources: {name!r} cannot name a source (it names metrics: valid/<name>/loss)")
        weight = setting(source, "weight")
        if not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
            errors.append(
                f"data.sources.{name}.weight must be a number > 0, finite (weights are relative: 0.8 and 0.2, or 4 "
                f"and 1), got {weight}"
            )
        if setting(source, "path") is not None:
            try:
                corpus_sources(source.path)
            except DataError as e:
                errors.append(f"data.sources.{name}.path: {e}")
    return errors + _weight_sum_errors(sources)


def _weight_sum_errors(sources) -> list[str]:
    """Weights each finite can still sum past a float (1e308 twice: inf), and every share would then be 0."""
    weights = [setting(s, "weight") for s in sources.values()]
    if not all(isinstance(w, int | float) and math.isfinite(w) for w in weights):
        return []  # each bad weight is named above
    if math.isfinite(sum(float(w) for w in weights)):
        return []
    return [
        f"data.sources' weights sum past the largest float ({max(weights):.3g} is one); weights are relative: "
        "scale them down (0.8 and 0.2, or 4 and 1)"
    ]


def cached_meta(d, source, tokenizer) -> dict | None:
    """meta.json of a source's cache if it is built, else None: found by the key prepare_corpus names it by, reading
    no corpus file."""
    files, name = corpus_sources(source.path)
    key = cache_key(files, tokenizer, d.valid_percent, int(d.max_corpus_mb * 2**20), source_text_field(d, source))
    corpus = Path(d.cache_dir).expanduser() / f"{name}-{key}"
    return read_corpus_meta(corpus) if (corpus / "meta.json").exists() else None


def plan_lines(cfg, tokenizer) -> list[str]:
    """dry_run: each source's tokens, weight and the epochs of it the run reads; a warning for each that repeats."""
    d, o = cfg.data, cfg.optimization
    samples = o.max_steps * o.batch_size * setting(o, "update_freq", 1)
    total = sum(float(s.weight) for s in d.sources.values())
    lines = [
        f"data.sources: {len(d.sources)} corpora, {samples:,} samples of {d.seq_len} tokens in {o.max_steps} steps"
    ]
    warnings = []
    for name, source in d.sources.items():
        weight = float(source.weight) / total
        meta = cached_meta(d, source, tokenizer)
        if meta is None:
            size = sum(f.path.stat().st_size for f in corpus_sources(source.path)[0]) / 2**20
            lines.append(
                f"  {name}: weight {weight:.3f}, not preprocessed yet ({size:,.1f} MB of text): epochs unknown"
            )
            continue
        epochs = epochs_seen(samples, d.seq_len, weight, meta["train_tokens"])
        lines.append(f"  {name}: weight {weight:.3f}, {meta['train_tokens']:,} train tokens, {epochs:.2f} epochs")
        if epochs > 1:
            warnings.append(
                f"warning: data.sources.{name} repeats: the run reads it {epochs:.2f} times (each epoch reshuffled); "
                "lower its weight or add text to it"
            )
    return lines + warnings
