"""Parquet files and Arrow files (a dataset saved by Hugging Face ``datasets``' save_to_disk) as corpus blocks.

A row is one document, its text in the column ``data.text_field``. Only that column is read, a record batch at a
time (Parquet: row group by row group; Arrow: memory-mapped), so memory follows one row group, not the file.
pyarrow is an optional extra (``pip install 'shardlab[corpora]'``), imported only when such a file is read; worker
processes never read files. This module imports the corpus reader's shared pieces from
shardlab_tasks/lm/corpus/sources.py, never shardlab_tasks/lm/corpus/corpus.py (which imports this one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus.sources import Block, Source, read_small, regular_path, require

ROWS_PER_BATCH = 256
"""Rows decoded at once from a Parquet row group: a transient ~MBs for documents of KBs (the batch is then cut into
blocks of ~1 MB of text, as few or many rows as that takes)."""
FIX_FIELD = "name the text column with data.text_field (shardlab-preprocess: --text-field)"
FIX_DAMAGED = "the file is damaged: download or write it again, or remove it from data.path"


def _pyarrow():
    return require("pyarrow", "Parquet and Arrow files")


def _check_column(source: Source, schema, field: str) -> None:
    pa = _pyarrow()
    if field not in schema.names:
        raise DataError(f"{source.path}: no {field!r} column (found: {', '.join(schema.names)}); {FIX_FIELD}")
    kind = schema.field(field).type
    is_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise DataError(f"{source.path}: column {field!r} holds {kind}, not text; {FIX_FIELD}")


def _parquet_batches(source: Source, field: str, check_only: bool) -> Iterator[tuple[int, object]]:
    pq = require("pyarrow.parquet", "Parquet files")
    try:
        pf = pq.ParquetFile(regular_path(source.path, source.root))
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, its IOError an OSError
        raise DataError(f"{source.path}: not a readable Parquet file ({_first_line(e)}); {FIX_DAMAGED}") from None
    _check_column(source, pf.schema_arrow, field)
    if check_only:
        return
    row = 0
    for group in range(pf.num_row_groups):
        rows = pf.metadata.row_group(group).num_rows
        try:
            batches = pf.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=[group], columns=[field], use_threads=False)
            for batch in batches:
                yield row, batch.column(0)
                row += batch.num_rows
        except (OSError, ValueError) as e:
            raise DataError(
                f"{source.path}: rows {row + 1}-{row + rows} (row group {group}) are unreadable ({_first_line(e)}); "
                f"{FIX_DAMAGED}"
            ) from None


def _arrow_batches(source: Source, field: str, check_only: bool) -> Iterator[tuple[int, object]]:
    pa = _pyarrow()
    real = regular_path(source.path, source.root)
    try:
        mapped = pa.memory_map(str(real))
        try:
            reader = pa.ipc.open_stream(mapped)  # datasets' save_to_disk writes the streaming format
            batches = iter(reader)
        except pa.ArrowInvalid:
            mapped.seek(0)
            reader = pa.ipc.open_file(mapped)  # the random-access (Feather v2) format
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except (OSError, ValueError) as e:
        raise DataError(f"{source.path}: not a readable Arrow file ({_first_line(e)}); {FIX_DAMAGED}") from None
    _check_column(source, reader.schema, field)
    if check_only:
        return
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except (OSError, ValueError) as e:
            raise DataError(f"{source.path}: unreadable after row {row} ({_first_line(e)}); {FIX_DAMAGED}") from None
        if batch is None:
            return
        yield row, batch.column(batch.schema.get_field_index(field))
        row += batch.num_rows


def _batches(source: Source, field: str, check_only: bool = False) -> Iterator[tuple[int, object]]:
    """(rows before it, its text column) of each record batch, after checking the file has a text column."""
    read = _parquet_batches if source.format == "parquet" else _arrow_batches
    return read(source, field, check_only)


def check(source: Source, field: str) -> None:
    """Raise the one-line DataError of a file that cannot be read or has no text column ``field``: reads only the
    file's footer or schema, so a corpus of thousands of shards is checked in seconds, before preprocessing."""
    for _ in _batches(source, field, check_only=True):
        pass


def read_blocks(source: Source, field: str, block_bytes: int) -> Iterator[Block]:
    """The file's documents in blocks of whole rows, ~``block_bytes`` of text each; ``Block.first_line`` is the
    1-based number of a block's first row."""
    import numpy as np

    pc = require("pyarrow.compute", "Parquet and Arrow files")
    texts: list[str] = []
    size, first, index = 0, 1, 0
    for row, column in _batches(source, field):
        if column.null_count:
            at = row + 1 + column.is_null().to_pylist().index(True)
            raise DataError(f"{source.path}: row {at}: {field!r} is null; filter such rows out of the file")
        lengths = pc.binary_length(column).to_numpy(zero_copy_only=False)
        start = 0
        while start < len(column):
            # The rows that fill the block to block_bytes (at least one): an Arrow batch of 1,000 long documents
            # (datasets writes such) is cut into ~1 MB blocks, so the blocks in flight to workers stay ~MBs.
            filled = np.cumsum(lengths[start:])
            take = min(int(np.searchsorted(filled, block_bytes - size)) + 1, len(column) - start)
            if not texts:
                first = row + start + 1
            try:
                texts += column.slice(start, take).to_pylist()
            except UnicodeDecodeError:  # writers check UTF-8, so a damaged page: say where, as for unreadable rows
                at = row + start + 1
                raise DataError(
                    f"{source.path}: rows {at}-{at + take - 1} hold text that is not UTF-8; {FIX_DAMAGED}"
                ) from None
            size += int(filled[take - 1])
            start += take
            if size >= block_bytes:
                yield Block(source, index, first, b"", texts=texts, size=size)
                texts, size, index = [], 0, index + 1
    if texts or index == 0:
        yield Block(source, index, first, b"", last=True, texts=texts, size=size)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


STATE_BYTES = 1 << 20
"""The most a dataset's state.json or dataset_dict.json may hold: datasets writes a few hundred bytes per file."""


def dataset_files(folder: Path, root: Path | None = None) -> list[Path] | None:
    """The Arrow files of a dataset saved by ``datasets``' save_to_disk in ``folder`` (listed by its state.json), or
    None when the folder holds no such dataset; a DatasetDict (several splits) is refused: one split is a corpus.
    ``root``: the corpus folder, which the JSON files (and, when read, the files they list) may not lead out of."""
    import json

    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads(read_small(folder / "dataset_dict.json", root, STATE_BYTES)).get("splits") or []
            splits = [str(s) for s in splits] if isinstance(splits, list) else []
        except (ValueError, AttributeError):
            splits = []
        example = folder / (splits[0] if splits else "train")
        raise DataError(
            f"data.path: {folder} holds a DatasetDict saved by datasets (splits: {', '.join(splits) or '?'}); "
            f"point data.path at the split to train on, e.g. {example}"
        )
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        files = [folder / f["filename"] for f in json.loads(read_small(state, root, STATE_BYTES))["_data_files"]]
    except (ValueError, KeyError, TypeError):
        return None  # a state.json of something else
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(f"{state} lists {', '.join(missing)}, which is missing; save the dataset again")
    return files
