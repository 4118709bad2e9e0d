"""Raw input files: expansion of -i arguments, and reading records chunk by chunk.

A chunk is a contiguous range of records of one input file, the unit of parallel work of the scan and
lengths stages. Records carry their 1-based line number (JSONL: the line; JSON array: the line where the
element starts; Parquet: the row number), so every reject can name its file and line. JSON in the forms
users write it (BOM, JSONL inside `.json`, gzip, CRLF) is read by `json_records`.

Input files are canonical absolute paths, each read once however it was named (relative and absolute
paths, symlinks, a file also matched by a folder or glob). Inputs and the image root may also be fsspec URLs
(s3://, http(s)://; `mmpack.offline_packing.inputs.remote`): remote files are read with ranged reads and retries,
and `file://` URLs are the local paths they name.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from mmpack.offline_packing.inputs import remote
from mmpack.offline_packing.inputs.json_records import (
    RawRecord,
    parse_json_document,
    parse_json_line,
    parse_json_lines,
)

INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".tar")


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


def is_input_file(name: str) -> bool:
    """True for the file names the job reads (by suffix)."""
    return name.endswith(INPUT_SUFFIXES)


def expand_inputs(inputs: tuple[str, ...] | list[str], exclude: tuple[str, ...] = ()) -> list[str]:
    """Input files in a fixed order: each argument (file, folder, glob) expanded and sorted, in argument order.

    Paths come back absolute and normalised; a file named twice (relative and absolute path, a symlink,
    a file under a folder also given) is kept once, at its first place. Folders and globs never yield files
    under the folders of `exclude` (the job's output and work folder) nor under any folder that carries
    mmpack's marker (another packed dataset or work folder); a file named on its own under `exclude` is an
    error. Only regular files are read: a FIFO, socket or device named as an input is an error.
    """
    skip = _Excluded(exclude)
    files: list[str] = []
    seen: set[str] = set()
    for arg in map(remote.local_path, inputs):
        if remote.is_url(arg):
            found = [f for f in remote.expand(arg, INPUT_SUFFIXES) if not skip.url(f)]
            if not found:
                raise FileNotFoundError(f"input {arg!r} matches no {'/'.join(INPUT_SUFFIXES)} object")
            files += [f for f in found if f not in seen]
            seen.update(found)
            continue
        p = Path(arg).expanduser()
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file() and is_input_file(f.name))
            found = [f for f in found if not skip.local(f, str(p))]
        elif os.path.lexists(p) and not glob.has_magic(arg):
            skip.refuse_named(str(p))
            found = [str(p)]
        else:
            found = sorted(f for f in glob.glob(str(p), recursive=True) if is_input_file(f))
            found = [f for f in found if not skip.local(f, _glob_base(str(p)))]
        if not found:
            raise FileNotFoundError(
                f"input {arg!r} matches no {'/'.join(INPUT_SUFFIXES)} file; check the -i path"
            )
        for f in found:
            real = os.path.realpath(f)
            if real not in seen:
                _require_regular_file(f)
                seen.add(real)
                files.append(os.path.abspath(f))
    return files


class _Excluded:
    """Which files folder and glob expansion leaves out: the job's own folders and mmpack-marked ones."""

    def __init__(self, folders: tuple[str, ...]) -> None:
        self.urls = tuple(f.rstrip("/") + "/" for f in folders if remote.is_url(f))
        self.local_dirs = tuple(
            os.path.realpath(remote.local_path(f)) for f in folders if not remote.is_url(f)
        )
        self._marked: dict[str, bool] = {}

    def url(self, url: str) -> bool:
        return url.startswith(self.urls)

    def local(self, path: str, base: str) -> bool:
        """True if `path` (found under folder `base`) is in an excluded folder or a marked one below `base`."""
        real = os.path.realpath(path)
        if any(real == d or real.startswith(d + os.sep) for d in self.local_dirs):
            return True
        return any(
            self._has_marker(d) for d in _folders_between(os.path.abspath(base), os.path.abspath(path))
        )

    def refuse_named(self, path: str) -> None:
        real = os.path.realpath(path)
        for d in self.local_dirs:
            if real.startswith(d + os.sep):
                raise ValueError(
                    f"input {path} is inside this job's output or work folder {d}: mmpack never reads its own "
                    "files as input; move the input out or choose another -o / --work-dir"
                )

    def _has_marker(self, folder: str) -> bool:
        from mmpack.packing.ownership import has_marker

        if folder not in self._marked:
            self._marked[folder] = has_marker(folder)
        return self._marked[folder]


def _folders_between(base: str, path: str) -> Iterator[str]:
    """The folders from `path`'s own folder up to `base` (inclusive)."""
    folder = os.path.dirname(path)
    while True:
        yield folder
        if folder == base or os.path.dirname(folder) == folder or not folder.startswith(base):
            return
        folder = os.path.dirname(folder)


def _glob_base(pattern: str) -> str:
    """The folder a glob pattern starts from: its longest leading part without wildcards."""
    parts = Path(pattern).parts
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts))
    return str(Path(*fixed)) if fixed else "."


def _require_regular_file(path: str) -> None:
    """Raises ValueError naming `path` unless it is a regular file (a FIFO would block the read forever)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"input {path} does not exist (a broken link?); check the -i path") from None
    if not stat.S_ISREG(mode):
        raise ValueError(
            f"input {path} is {describe_mode(mode)}, not a regular file; mmpack reads only regular files"
        )


def describe_mode(mode: int) -> str:
    """ "a FIFO", "a socket", "a character device", ... for a `stat` mode."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
    )
    return next((what for test, what in kinds if test(mode)), "not a regular file")


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
    with remote.open_binary(path) as f:
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
    with remote.open_binary(chunk.path) as f:
        f.seek(chunk.byte_offset)
        line_no, produced = chunk.first_line - 1, 0
        for raw in f:
            line_no += 1
            if not raw.strip():
                continue
            if produced == chunk.count:
                break
            produced += 1
            yield parse_json_line(raw, line_no)


def _read_whole_file(path: str) -> list[RawRecord]:
    """All records of a .json, gzip, .parquet or .tar file (cached: several chunks of one file share it)."""
    if remote.is_url(path):
        _, size, version = remote.identity(path, "stat")
        return _read_whole_file_cached(path, size, version)
    st = os.stat(path)
    return _read_whole_file_cached(path, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=2)
def _read_whole_file_cached(path: str, size: int, version: int | str | None) -> list[RawRecord]:
    """Keyed by size and mtime (or ETag) too, so a rewritten file is read again."""
    if path.endswith(".tar"):
        return _read_tar(path)
    data = remote.read_all(path) if remote.is_url(path) else None
    if path.endswith(".parquet"):
        import io

        import pyarrow.parquet as pq

        rows = pq.read_table(io.BytesIO(data) if data is not None else path).to_pylist()
        # a column absent from a record reads back as null: drop those (mixed-format files)
        return [
            RawRecord(i + 1, {k: v for k, v in row.items() if v is not None}) for i, row in enumerate(rows)
        ]
    if path.endswith(".gz"):
        if data is not None:
            data = gzip.decompress(data)
        else:
            with gzip.open(path, "rb") as f:
                data = f.read()
        return parse_json_lines(data) if path.endswith(".jsonl.gz") else parse_json_document(data)
    return parse_json_document(data if data is not None else Path(path).read_bytes())


def _read_tar(path: str) -> list[RawRecord]:
    from mmpack.offline_packing.tar_source import index_tar, sample_record

    records = []
    for i, sample in enumerate(index_tar(path)):
        try:
            records.append(RawRecord(i + 1, sample_record(path, sample), tar_sample=sample))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            reason = "malformed_json" if isinstance(exc, json.JSONDecodeError) else "malformed_record"
            records.append(
                RawRecord(
                    i + 1, error=f"sample {sample.key!r}: {exc}", tar_sample=sample, error_reason=reason
                )
            )
    return records


def input_folder(path: str) -> str:
    """The folder of an input file (a URL's prefix up to its last slash): the default image root."""
    return remote.parent(path) if remote.is_url(path) else str(Path(path).parent)


def resolve_image_path(image: str, image_root: str) -> str:
    """The real path of `image` under `image_root` (a URL under a URL root).

    Raises:
        PermissionError: the path is absolute or escapes the root (`..`, symlinks pointing outside).
    """
    if not isinstance(image, str) or not image:
        raise PermissionError(f"image path must be a non-empty string, got {image!r}")
    if os.path.isabs(image) or image.startswith("~") or "\x00" in image:
        raise PermissionError(f"image path {image!r} is absolute; paths must be relative to the image root")
    image_root = remote.local_path(image_root)
    if remote.is_url(image_root):
        return remote.join_under(image_root, image)
    root = os.path.realpath(image_root)
    full = os.path.realpath(os.path.join(root, image))
    if os.path.commonpath([root, full]) != root:
        raise PermissionError(f"image path {image!r} escapes the image root {image_root}")
    return full
