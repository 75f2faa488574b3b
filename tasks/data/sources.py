"""A dataset source as rows: a JSONL, Parquet or CSV file (s3:// or local), or a 🤗 hub dataset.

    path, sha256 = fetch("s3://bucket/raw/chat.jsonl", workdir)    # a local copy and the sha256 of its bytes
    for number, row in read_rows(path):                              # number: 1-based; row: a dict, or None
        ...                                                          # for a line that is not a JSON object

Rows are read one by one and never dropped here: an unreadable JSONL line or a CSV line with more cells
than the header comes back as None, so validation counts it under its row number like any other bad row.
A row whose text is not valid UTF-8 (bytes of another encoding, a multibyte character cut in two, or a
lone surrogate escape such as "\\udc80") comes back as Unreadable("invalid_utf8", column): replacing the
bytes with U+FFFD would train on text the user never wrote.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tasks.common import storage
from tasks.common.config import ConfigError
from tasks.common.manifest import file_sha256
from tasks.data.config import FILE_FORMATS, source_kind


def fetch(source: str, workdir: Path) -> tuple[Path, str]:
    """A local file holding `source` (downloaded, or the hub dataset written as JSONL) and its sha256."""
    workdir.mkdir(parents=True, exist_ok=True)
    if source_kind(source) == "hub":
        path = _from_hub(source, workdir)
    elif storage.is_s3(source):
        path = storage.download_file(source, workdir / source.rstrip("/").rsplit("/", 1)[-1])
    else:
        path = storage.local_path(source)
    return path, file_sha256(path)


def _from_hub(source: str, workdir: Path) -> Path:
    """The hub dataset's train split as JSONL (its content hash is then that of the rows it holds)."""
    import datasets

    try:
        rows = datasets.load_dataset(source, split="train")
    except Exception as error:  # the hub's errors are many and long; the user needs the id and the cause
        raise ConfigError(
            f"source: cannot load hub dataset {source!r} ({type(error).__name__}: {' '.join(str(error).split())[:200]}); check the id or pass a file URI"
        ) from None
    path = workdir / (source.replace("/", "__") + ".jsonl")
    rows.to_json(str(path), lines=True, force_ascii=False)
    return path


def file_format(path: Path) -> str:
    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"source: {path.name} has an unknown format; use a .jsonl, .parquet or .csv file")
    return fmt


@dataclass(frozen=True)
class Unreadable:
    """A row that parsed but cannot be kept as text: `reason` is the validation check, `field` the column."""

    reason: str
    field: str = ""


Row = dict | Unreadable | None


def read_rows(path: Path) -> Iterator[tuple[int, Row]]:
    """(1-based row number, row) for every row of the file; row is None where it cannot be read, and
    Unreadable where it parsed but holds text that is not UTF-8."""
    reader = {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "csv": _csv_rows}[file_format(path)]
    return reader(path)


def _has_surrogate(value: Any) -> bool:
    """Whether a value (or any string inside a list or dict) holds a lone surrogate: an undecodable byte
    kept by errors="surrogateescape", or a JSON escape of half a character. Neither can be written as UTF-8."""
    if isinstance(value, str):
        return any("\ud800" <= ch <= "\udfff" for ch in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_surrogate(v) for v in value)
    return False


def checked_text(row: Any) -> Row:
    """The row itself, or Unreadable("invalid_utf8", <first column to blame>) when its text is not UTF-8."""
    if not isinstance(row, dict):
        return row
    for key, value in row.items():
        if _has_surrogate(key) or _has_surrogate(value):
            # A column name that is itself undecodable cannot be named as the user wrote it: ascii() shows its bytes.
            return Unreadable("invalid_utf8", key if not _has_surrogate(key) else ascii(key))
    return row


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Row]]:
    # surrogateescape keeps each undecodable byte as a lone surrogate, so the row is still parsed and its
    # column named, instead of U+FFFD silently standing in for the user's bytes (checked_text rejects it).
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        head = f.read(1024).lstrip()
        f.seek(0)
        if head.startswith("["):  # a .json file holding one array of rows
            try:
                rows = json.load(f)
            except ValueError as error:
                raise ConfigError(
                    f"source: {path.name} is not valid JSON ({error}); fix the file or write it as JSONL, one row a line"
                ) from None
            for number, row in enumerate(rows, start=1):
                yield number, checked_text(row) if isinstance(row, dict) else None
            return
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # a blank line is no row (a trailing newline, a spacer)
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            yield number, checked_text(row) if isinstance(row, dict) else None


def _parquet_rows(path: Path) -> Iterator[tuple[int, Row]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, …
        raise ConfigError(
            f"source: {path.name} is not a readable Parquet file ({' '.join(str(error).split())[:200]}); fix or re-export it"
        ) from None
    number = 0
    for batch in table.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _csv_rows(path: Path) -> Iterator[tuple[int, Row]]:
    # Row numbers count data rows (the header is not one), like a spreadsheet's minus one.
    csv.field_size_limit(min(2**31 - 1, sys.maxsize))
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:  # see _jsonl_rows
        for number, row in enumerate(csv.DictReader(f), start=1):
            yield number, None if None in row else checked_text(row)  # more cells than the header: malformed
