"""Raw input files: expansion of -i arguments, and reading records chunk by chunk.

A chunk is a contiguous range of records of one input file, the unit of parallel work of the scan and
lengths stages. Records carry their 1-based line number (JSONL: the line; JSON array: the line where the
element starts; Parquet: the row number), so every reject can name its file and line.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

INPUT_SUFFIXES = (".jsonl", ".json", ".parquet", ".tar")


@dataclass(frozen=True)
class Chunk:
    """Records [start, start + count) of input file `path` (record indices, 0-based)."""

    index: int
    source_index: int
    path: str
    start: int
    count: int
    byte_offset: int = 0  # JSONL: byte offset of record `start`'s line
    first_line: int = 1  # JSONL: 1-based line number at byte_offset


@dataclass(frozen=True)
class RawRecord:
    """One record as read: either a parsed object or the JSON error that prevented parsing it."""

    line: int
    obj: object = None
    error: str | None = None
    tar_sample: object = None  # tar_source.TarSample when the record comes from a WebDataset tar
    error_reason: str = "malformed_json"


def expand_inputs(inputs: tuple[str, ...] | list[str]) -> list[str]:
    """Input files in a fixed order: each argument (file, folder, glob) expanded and sorted, in argument order."""
    files: list[str] = []
    for arg in inputs:
        p = Path(arg).expanduser()
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in INPUT_SUFFIXES)
        elif p.is_file():
            found = [str(p)]
        else:
            found = sorted(f for f in glob.glob(str(p), recursive=True) if Path(f).suffix in INPUT_SUFFIXES)
        if not found:
            raise FileNotFoundError(f"input {arg!r} matches no .json/.jsonl/.parquet/.tar file")
        files += [f for f in found if f not in files]
    return files


def plan_chunks(files: list[str], chunk_size: int) -> list[Chunk]:
    """Split every input file into chunks of at most `chunk_size` records."""
    chunks: list[Chunk] = []
    for src, path in enumerate(files):
        if path.endswith(".jsonl"):
            starts = _jsonl_record_starts(path)
            for k in range(0, len(starts), chunk_size):
                offset, line = starts[k]
                n = min(chunk_size, len(starts) - k)
                chunks.append(Chunk(len(chunks), src, path, k, n, offset, line))
        else:
            n_records = len(_read_whole_file(path))
            for k in range(0, max(n_records, 1), chunk_size):
                chunks.append(Chunk(len(chunks), src, path, k, min(chunk_size, n_records - k)))
    return chunks


def _jsonl_record_starts(path: str) -> list[tuple[int, int]]:
    """(byte offset, line number) of every non-blank line of a JSONL file."""
    starts = []
    offset = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                starts.append((offset, line_no))
            offset += len(line)
    return starts


def read_chunk(chunk: Chunk) -> Iterator[RawRecord]:
    """The records of one chunk, in order."""
    if chunk.path.endswith(".jsonl"):
        yield from _read_jsonl_chunk(chunk)
    else:
        yield from _read_whole_file(chunk.path)[chunk.start : chunk.start + chunk.count]


def _read_jsonl_chunk(chunk: Chunk) -> Iterator[RawRecord]:
    with open(chunk.path, "rb") as f:
        f.seek(chunk.byte_offset)
        line_no, produced = chunk.first_line - 1, 0
        for raw in f:
            line_no += 1
            if not raw.strip():
                continue
            if produced == chunk.count:
                break
            produced += 1
            try:
                yield RawRecord(line_no, json.loads(raw))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield RawRecord(line_no, error=f"invalid JSON: {exc}")


def _read_whole_file(path: str) -> list[RawRecord]:
    """All records of a .json array, .parquet or .tar file (cached: several chunks of one file share it)."""
    st = os.stat(path)
    return _read_whole_file_cached(path, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=2)
def _read_whole_file_cached(path: str, size: int, mtime_ns: int) -> list[RawRecord]:
    """Keyed by size and mtime too, so a rewritten file is read again."""
    if path.endswith(".tar"):
        return _read_tar(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        # a column absent from a record reads back as null: drop those (mixed-format files)
        return [
            RawRecord(i + 1, {k: v for k, v in row.items() if v is not None}) for i, row in enumerate(rows)
        ]
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return _split_json_array(text)


def _read_tar(path: str) -> list[RawRecord]:
    from offline_packing.tar_source import index_tar, sample_record

    records = []
    for i, sample in enumerate(index_tar(path)):
        try:
            records.append(RawRecord(i + 1, sample_record(path, sample), tar_sample=sample))
        except (ValueError, UnicodeDecodeError) as exc:
            reason = "malformed_json" if isinstance(exc, json.JSONDecodeError) else "malformed_record"
            records.append(
                RawRecord(
                    i + 1, error=f"sample {sample.key!r}: {exc}", tar_sample=sample, error_reason=reason
                )
            )
    return records


def _split_json_array(text: str) -> list[RawRecord]:
    """Elements of a top-level JSON array with the line each starts on; one error record if unparsable."""
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        try:  # a single object is a one-record file
            return [RawRecord(text.count("\n", 0, pos) + 1, json.loads(text))]
        except json.JSONDecodeError as exc:
            return [RawRecord(exc.lineno, error=f"invalid JSON: {exc}")]
    records: list[RawRecord] = []
    pos = _skip_ws(text, pos + 1)
    line, counted_to = 1, 0
    while pos < len(text) and text[pos] != "]":
        line += text.count("\n", counted_to, pos)
        counted_to = pos
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            # the rest of the array cannot be split reliably: one reject for it
            records.append(RawRecord(line, error=f"invalid JSON: {exc}"))
            return records
        records.append(RawRecord(line, obj))
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
    return records


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def resolve_image_path(image: str, image_root: str) -> str:
    """The real path of `image` under `image_root`.

    Raises:
        PermissionError: the path is absolute or escapes the root (`..`, symlinks pointing outside).
    """
    if not isinstance(image, str) or not image:
        raise PermissionError(f"image path must be a non-empty string, got {image!r}")
    if os.path.isabs(image) or image.startswith("~") or "\x00" in image:
        raise PermissionError(f"image path {image!r} is absolute; paths must be relative to the image root")
    root = os.path.realpath(image_root)
    full = os.path.realpath(os.path.join(root, image))
    if os.path.commonpath([root, full]) != root:
        raise PermissionError(f"image path {image!r} escapes the image root {image_root}")
    return full
