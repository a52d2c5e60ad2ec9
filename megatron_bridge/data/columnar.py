"""Columnar inputs of `mbr data`: parquet, Arrow IPC (file or stream, `.arrow`/`.feather`), and
directories written by `datasets`' `save_to_disk` (their arrow files, in `state.json`'s order).

Rows are read with pyarrow in record batches of at most `BATCH_ROWS` rows (parquet: its own
batch reader over the needed column only; Arrow: memory-mapped, batch by batch), so memory
stays bounded by one batch whatever the file's size. The `datasets` package is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_bridge.errors import UserError

COLUMNAR_SUFFIXES = (".parquet", ".arrow", ".feather")
BATCH_ROWS = 1024
SAVE_TO_DISK_FILES = ("state.json", "dataset_info.json")


def is_save_to_disk(d: Path) -> bool:
    """A directory written by `Dataset.save_to_disk` (arrow files + state.json + dataset_info.json)."""
    return d.is_dir() and all((d / n).is_file() for n in SAVE_TO_DISK_FILES)


def save_to_disk_files(d: Path) -> list[Path]:
    """The arrow files of a `save_to_disk` directory, in the dataset's row order (`state.json`'s
    `_data_files`). A `DatasetDict` directory is refused with the split directories to pick."""
    if (d / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in d.iterdir() if is_save_to_disk(p))
        raise UserError(
            f"input {d} is a DatasetDict; pass one split's directory, e.g. input={d / (splits or ['train'])[0]}"
        )
    try:
        state = json.loads((d / "state.json").read_text(encoding="utf-8"))
        files = [d / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{d / 'state.json'}: not a datasets save_to_disk state ({e})") from e
    for f in files:
        if not f.is_file():
            raise UserError(f"{d / 'state.json'} lists {f.name}, which is missing")
    return files


def _batches(path: Path, column: str | None, optional: tuple[str, ...] = ()) -> Iterator[Any]:
    """pyarrow record batches of `path`'s `column` (checked to exist; None: no column is required)
    and those of the `optional` columns it has, at most BATCH_ROWS rows each: parquet through its
    batch reader (only these columns decoded), Arrow memory-mapped."""
    import pyarrow as pa

    def wanted(names: list[str]) -> list[str]:
        if column is not None:
            _need(path, column, names)
        return [c for c in (column, *optional) if c is not None and c in names]

    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path)
            yield from pf.iter_batches(batch_size=BATCH_ROWS, columns=wanted(pf.schema_arrow.names))
            return
        source = pa.memory_map(str(path), "r")
        try:
            reader: Any = pa.ipc.open_file(source)
            cols = wanted(reader.schema.names)
            for i in range(reader.num_record_batches):
                yield from _slices(reader.get_batch(i).select(cols))
        except pa.ArrowInvalid:  # not the IPC file format: the stream format (what datasets writes)
            source.seek(0)
            stream = pa.ipc.open_stream(source)
            cols = wanted(stream.schema.names)
            for b in stream:
                yield from _slices(b.select(cols))
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"cannot read {path} with pyarrow: {e}") from e


def _slices(batch: Any) -> Iterator[Any]:
    """A record batch in zero-copy slices of at most BATCH_ROWS rows (rows become Python objects
    one slice at a time)."""
    for off in range(0, batch.num_rows, BATCH_ROWS):
        yield batch.slice(off, BATCH_ROWS)


def _need(path: Path, column: str, names: list[str]) -> None:
    if column not in names:
        raise UserError(
            f"{path}: no column {column!r} (columns: {', '.join(map(repr, names))}); "
            "pass text_key=NAME (text) or messages_key=NAME (chat) to read another column"
        )


def iter_column(path: Path, column: str) -> Iterator[tuple[str, Any]]:
    """("path:row N", value) for each row of `column`, in file order, one bounded batch at a time."""
    for where, row in iter_rows(path, column):
        yield where, row[column]


def iter_rows(path: Path, column: str | None, optional: tuple[str, ...] = ()) -> Iterator[tuple[str, dict[str, Any]]]:
    """("path:row N", {column: value, ...}) per row: `column` and those of the `optional` columns
    the file has (image chats: the `images` column beside the messages; preference pairs: no
    required column, the row's fields checked by their reader)."""
    row = 0
    for batch in _batches(path, column, optional):
        names = batch.schema.names
        for values in zip(*(batch.column(i).to_pylist() for i in range(len(names)))):
            row += 1
            yield f"{path}:row {row}", dict(zip(names, values))


def iter_texts(path: Path, text_key: str) -> Iterator[str]:
    """The documents of a columnar file: its `text_key` column, each a string."""
    for where, text in iter_column(path, text_key):
        if not isinstance(text, str):
            raise UserError(f"{where}: {text_key!r} is a {type(text).__name__}, not a string")
        yield text
