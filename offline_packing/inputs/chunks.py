"""Input files cut into chunks, and the records of a chunk read back.

A chunk is a contiguous range of records of one input file, the unit of parallel work of the scan and
lengths stages. Records carry their 1-based line number (JSONL: the line; JSON array: the line where the
element starts; Parquet: the row number; tar: the sample index), so every reject can name its file and line.

How each kind of input is read:

- JSONL (`.jsonl`, and `.json` files holding JSONL, `json_records.looks_like_json_lines`): line by line in
  bounded memory (`json_lines`), chunks addressed by byte offset;
- the same gzip-compressed (`.jsonl.gz`, `.json.gz`): line by line while decompressing, chunks addressed by
  record index (`json_lines.gzip_cursor`); never decompressed whole;
- a plain JSON document that is an array: element by element in bounded memory (`json_array`), chunks
  addressed by the position of their first element, noted in a first pass;
- other JSON documents (a pretty-printed object; any gzip document), Parquet and WebDataset tars: read whole
  once per process (kept in the job context's caches), then sliced; a document or Parquet file over
  `MAX_DOCUMENT_BYTES` (a gzip document decompressed no further) is an error naming it.

A record longer than `max_record_bytes` (its JSON text, or its tar `.json` member) is a `record_too_large`
reject, found before it is parsed or kept in memory.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmpack.offline_packing.config import DEFAULT_MAX_RECORD_BYTES
from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.inputs.json_array import ArrayPosition, ArrayReader, chunk_starts, open_array
from mmpack.offline_packing.inputs.json_lines import (
    Line,
    StreamCursor,
    count_lines,
    empty_gzip,
    gzip_failure,
    iter_lines,
    reading,
)
from mmpack.offline_packing.inputs.json_records import (
    RawRecord,
    looks_like_json_lines,
    parse_json_document,
    parse_json_line,
    too_large,
)
from mmpack.offline_packing.inputs.remote import is_url
from mmpack.offline_packing.tar_source import index_tar, sample_record

if TYPE_CHECKING:
    from mmpack.offline_packing.context import JobContext

# A JSON document (but a plain array), a gzip document decompressed or a Parquet file's data is read whole (unlike
# JSON Lines): past this it is an error, so a small file that expands without bound (a gzip bomb) never fills the
# memory. Real documents stay well under it (LLaVA-1.5's 665k-sample mixture is a 1 GB JSON array).
MAX_DOCUMENT_BYTES = 2 << 30


@dataclass(frozen=True)
class Chunk:
    """Records [start, start + count) of input file `path` (record indices, 0-based)."""

    index: int
    source_index: int
    path: str
    start: int
    count: int
    byte_offset: int = 0  # plain JSONL: byte offset of record `start`'s line
    first_line: int = 1  # plain JSONL: 1-based line number at byte_offset
    array_at: ArrayPosition | None = None  # plain JSON array: where record `start`'s element starts


def plan_chunks(
    ctx: JobContext, files: list[str], chunk_size: int, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> list[Chunk]:
    """Split every input file into chunks of at most `chunk_size` records."""
    chunks: list[Chunk] = []
    for src, path in enumerate(files):
        kind = input_kind(ctx, path, max_record_bytes)
        if kind == "lines":
            starts = _record_starts(ctx, path, max_record_bytes)
            for k in range(0, len(starts), chunk_size):
                offset, line = starts[k]
                chunks.append(
                    Chunk(len(chunks), src, path, k, min(chunk_size, len(starts) - k), offset, line)
                )
            continue
        if kind == "array":
            chunks.extend(_array_chunks(ctx, path, src, len(chunks), chunk_size, max_record_bytes))
            continue
        n_records = (
            count_lines(ctx.remote, path, max_record_bytes)
            if kind == "gzip-lines"
            else len(_whole_file(ctx, path, max_record_bytes))
        )
        for k in range(0, max(n_records, 1), chunk_size):
            chunks.append(Chunk(len(chunks), src, path, k, min(chunk_size, n_records - k)))
    return chunks


def read_chunk(
    ctx: JobContext, chunk: Chunk, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> Iterator[RawRecord]:
    """The records of one chunk, in order."""
    kind = input_kind(ctx, chunk.path, max_record_bytes)
    if kind == "lines":
        with reading(ctx.remote, chunk.path) as f:
            f.seek(chunk.byte_offset)
            lines = iter_lines(
                f, max_record_bytes, first_line=chunk.first_line, first_offset=chunk.byte_offset
            )
            for _, line in zip(range(chunk.count), lines):
                yield _record_of(line, max_record_bytes)
    elif kind == "array":
        if chunk.array_at is not None and chunk.count > 0:
            with reading(ctx.remote, chunk.path) as f:
                reader = ArrayReader(f, chunk.array_at, max_record_bytes)
                for _, record in zip(range(chunk.count), reader.records()):
                    assert record is not None
                    yield record
    elif kind == "gzip-lines":
        for line in _gzip_cursor(ctx, chunk.path, max_record_bytes).records(chunk.start, chunk.count):
            yield _record_of(line, max_record_bytes)
    else:
        yield from _whole_file(ctx, chunk.path, max_record_bytes)[chunk.start : chunk.start + chunk.count]


def _gzip_cursor(ctx: JobContext, path: str, max_record_bytes: int) -> StreamCursor:
    """This process's cursor over a gzip input (keyed by its identity, so a rewritten file starts afresh):
    the chunks of a file one worker reads in order continue where the previous one stopped."""
    key = (path, *_identity(ctx, path), max_record_bytes)
    return ctx.caches.get(
        "gzip_cursor", key, lambda: StreamCursor(ctx.remote, path, max_record_bytes), maxsize=2
    )


def input_kind(ctx: JobContext, path: str, max_record_bytes: int) -> str:
    """ "lines" (plain JSONL), "gzip-lines" (JSONL in gzip), "array" (a plain JSON array, read element by
    element), "document" (JSON read whole), "parquet" or "tar"."""
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".tar"):
        return "tar"
    gz = path.endswith(".gz")
    if path.endswith((".jsonl", ".jsonl.gz")):
        return "gzip-lines" if gz else "lines"
    key = (path, *_identity(ctx, path), max_record_bytes)
    return ctx.caches.get("input_kind", key, lambda: _sniffed_kind(ctx, path, max_record_bytes), maxsize=64)


def _sniffed_kind(ctx: JobContext, path: str, max_record_bytes: int) -> str:
    """A `.json` / `.json.gz` file: JSONL content or one JSON document, from its first two records."""
    with reading(ctx.remote, path) as f:
        lines = [line for _, line in zip(range(2), iter_lines(f, max_record_bytes))]
    head = [line.raw if line.raw is not None else line.head for line in lines]
    complete = not lines or lines[0].raw is not None
    if not looks_like_json_lines(head, complete):
        return "document" if path.endswith(".gz") or not _is_array(ctx, path) else "array"
    return "gzip-lines" if path.endswith(".gz") else "lines"


def _record_starts(ctx: JobContext, path: str, max_record_bytes: int) -> list[tuple[int, int]]:
    """(byte offset, line number) of every record (non-blank line) of a plain JSONL file."""
    with reading(ctx.remote, path) as f:
        return [(line.offset, line.number) for line in iter_lines(f, max_record_bytes)]


def _is_array(ctx: JobContext, path: str) -> bool:
    with reading(ctx.remote, path) as f:
        return open_array(f, None) is not None


def _array_chunks(
    ctx: JobContext, path: str, src: int, first: int, chunk_size: int, max_record_bytes: int
) -> list[Chunk]:
    """The chunks of a plain JSON array, from a first pass over its elements (one empty chunk for no element, as
    for a document read whole)."""
    with reading(ctx.remote, path) as f:
        starts, n_records = chunk_starts(f, chunk_size, max_record_bytes)
    if not starts:
        return [Chunk(first, src, path, 0, 0)]
    return [
        Chunk(first + i, src, path, i * chunk_size, min(chunk_size, n_records - i * chunk_size), at.byte_offset,
              at.line, at)
        for i, at in enumerate(starts)
    ]  # fmt: skip


def _record_of(line: Line, max_record_bytes: int) -> RawRecord:
    if line.raw is None:
        return too_large(line.number, line.length, max_record_bytes)
    return parse_json_line(line.raw, line.number)


def _identity(ctx: JobContext, path: str) -> tuple[int | None, object]:
    if is_url(path):
        _, size, version = ctx.remote.identity(path, "stat")
        return size, version
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _whole_file(ctx: JobContext, path: str, max_record_bytes: int) -> list[RawRecord]:
    """All records of a JSON document, Parquet or tar file (cached: several chunks of one file share it;
    keyed by size and mtime or ETag too, so a rewritten file is read again)."""
    key = (path, *_identity(ctx, path), max_record_bytes)
    return ctx.caches.get("whole_file", key, lambda: _read_whole_file(ctx, path, max_record_bytes), maxsize=2)


def _read_whole_file(ctx: JobContext, path: str, max_record_bytes: int) -> list[RawRecord]:
    if path.endswith(".tar"):
        return _read_tar(ctx, path, max_record_bytes)
    size = _identity(ctx, path)[0]
    if size is not None and size > MAX_DOCUMENT_BYTES and not path.endswith(".parquet"):
        raise _document_too_large(path, "is")
    data = ctx.remote.read_all(path) if is_url(path) else None
    if path.endswith(".parquet"):
        return _read_parquet(path, data, max_record_bytes)
    if path.endswith(".gz"):
        data = _decompress_bounded(path, data if data is not None else Path(path).read_bytes())
    return parse_json_document(data if data is not None else Path(path).read_bytes(), max_record_bytes)


def _document_too_large(path: str, verb: str) -> PackError:
    return PackError(
        f"input {path} {verb} larger than {MAX_DOCUMENT_BYTES >> 20} MiB, and a JSON document (one object, a gzip "
        "document) or a Parquet file is read whole; write it as JSON Lines (.jsonl or .jsonl.gz) or as a plain "
        ".json array, which are read record by record, or split it into several files"
    )


def _decompress_bounded(path: str, data: bytes) -> bytes:
    """A gzip document's bytes; first measured in 1 MiB pieces, none kept, so that one expanding past
    `MAX_DOCUMENT_BYTES` (a gzip bomb) is an error before its bytes fill the memory."""
    if not data:
        raise empty_gzip(path)
    size = 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz:
            while piece := gz.read(1 << 20):
                size += len(piece)
                if size > MAX_DOCUMENT_BYTES:
                    raise _document_too_large(path, "expands to")
        if size == 0:
            raise empty_gzip(path, decompressed=True)
        return gzip.decompress(data)
    except (EOFError, gzip.BadGzipFile, OSError, zlib.error) as exc:
        raise gzip_failure(path, exc) from None


def _read_parquet(path: str, data: bytes | None, max_record_bytes: int) -> list[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(io.BytesIO(data) if data is not None else path) as parquet:
            meta = parquet.metadata
            groups = (meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            if sum(groups) > MAX_DOCUMENT_BYTES:  # its data uncompressed, before any of it is read
                raise _document_too_large(path, "expands to")
            rows = parquet.read().to_pylist()
    except (pa.ArrowException, OSError, ValueError) as exc:
        said = " ".join(str(exc).split())  # pyarrow's messages span lines
        raise PackError(
            f"input {path} is not a Parquet file pyarrow can read ({said}); check or rewrite it"
        ) from None
    records = []
    for i, row in enumerate(rows):
        # a column absent from a record reads back as null: drop those (mixed-format files)
        record = {k: v for k, v in row.items() if v is not None}
        n = len(json.dumps(record, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
        records.append(
            too_large(i + 1, n, max_record_bytes) if n > max_record_bytes else RawRecord(i + 1, record)
        )
    return records


def _read_tar(ctx: JobContext, path: str, max_record_bytes: int) -> list[RawRecord]:
    records = []
    for i, sample in enumerate(index_tar(ctx, path)):
        size = sample.members.get("json", sample.members.get("txt", (0, 0)))[1]
        if size > max_record_bytes:
            records.append(too_large(i + 1, size, max_record_bytes, tar_sample=sample))
            continue
        try:
            records.append(RawRecord(i + 1, sample_record(ctx.remote, path, sample), tar_sample=sample))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            reason = "malformed_json" if isinstance(exc, json.JSONDecodeError) else "malformed_record"
            records.append(
                RawRecord(
                    i + 1, error=f"sample {sample.key!r}: {exc}", tar_sample=sample, error_reason=reason
                )
            )
    return records
