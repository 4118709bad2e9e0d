"""Random access to the bins of one local shard file: Arrow IPC or WebDataset tar.

Both readers return the same `BinRecord` dict: key, input_ids (uint32), loss_mask (uint8), seq_lens (int32),
sample_ids (list[str]), images (list[bytes]), image_formats (list[str]), image_grid_thw (int32 [n, 3]).
Tar members are never extracted: they are located by offset (headers walked directly, `tarfile` only for unusual
archives) and a bin's members are read with one `pread`; `.npy` arrays are decoded directly when the header is a
plain one, otherwise by `np.load(allow_pickle=False)`, and nothing is unpickled.
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import re
import struct
import tarfile
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dataloader.storage import read_json, write_json_atomic
from packing.format import ARRAY_FIELDS, WDS_JSON_MEMBER

BinRecord = dict[str, Any]
_MEMBER_RE = re.compile(r"^([A-Za-z0-9_-]+)\.([A-Za-z0-9_.]+)$")
_IMG_RE = re.compile(r"^img(\d+)\.([A-Za-z0-9]+)$")


class ArrowShardReader:
    """Memory-maps an Arrow IPC file; bin i is row i of the concatenated record batches."""

    def __init__(self, path: str, *, label: str) -> None:
        self.label = label
        self._source = pa.memory_map(path, "r")
        self._file = ipc.open_file(self._source)
        rows = [self._file.get_batch(i).num_rows for i in range(self._file.num_record_batches)]
        self._starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self._batch_cache: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, row: int) -> BinRecord:
        if not 0 <= row < len(self):
            raise IndexError(f"{self.label}: row {row} out of range [0, {len(self)})")
        b = int(np.searchsorted(self._starts, row, side="right") - 1)
        if self._batch_cache is None or self._batch_cache[0] != b:
            self._batch_cache = (b, _columns_of(self._file.get_batch(b)))
        cols = self._batch_cache[1]
        j = row - int(self._starts[b])
        rec: BinRecord = {"key": cols["key"][j]}
        for name, dtype in ARRAY_FIELDS.items():
            offsets, flat = cols[name]
            rec[name] = np.asarray(flat[offsets[j] : offsets[j + 1]], dtype=dtype)
        rec["image_grid_thw"] = rec["image_grid_thw"].reshape(-1, 3)
        for name in ("sample_ids", "images", "image_formats"):
            offsets, flat = cols[name]
            rec[name] = flat[offsets[j] : offsets[j + 1]].to_pylist()
        return rec

    def close(self) -> None:
        self._source.close()


def _list_column(col: Any) -> tuple[np.ndarray, Any]:
    """(offsets rebased to 0, flat values) of a list column, respecting any slice of the array."""
    offsets = col.offsets.to_numpy()
    return offsets - offsets[0], col.flatten()


def _columns_of(batch: Any) -> dict[str, Any]:
    """Per-column (offsets, values) of one record batch; numeric values as numpy, others as Arrow."""
    cols: dict[str, Any] = {"key": batch.column("key").to_pylist()}
    for name in ARRAY_FIELDS:
        offsets, flat = _list_column(batch.column(name))
        if name == "image_grid_thw":
            offsets, flat = offsets * 3, flat.flatten()
        cols[name] = (offsets, flat.to_numpy(zero_copy_only=False))
    for name in ("sample_ids", "images", "image_formats"):
        cols[name] = _list_column(batch.column(name))
    return cols


class WdsShardReader:
    """Indexes the members of a WebDataset tar once; reads all members of a bin with one `pread`.

    `index_cache`: a file where the tar index of this exact content is kept (name it by the shard's verified
    sha256). The first reader on a machine writes it, atomically; later ones (other loader workers, other
    ranks) load it instead of walking the archive again.
    """

    def __init__(self, path: str, *, label: str, index_cache: str | None = None) -> None:
        self.label = label
        self._fh = open(path, "rb")  # noqa: SIM115 - kept open for the reader's lifetime
        self._keys: list[str] = []
        self._members: dict[str, dict[str, tuple[int, int]]] = {}
        self._spans: dict[str, tuple[int, int]] = {}
        try:
            entries = _tar_index(self._fh, label=label, index_cache=index_cache)
            for name, offset, size in entries:
                self._add_member(name, offset, size)
        except BaseException:
            self._fh.close()
            raise

    def _add_member(self, name: str, offset: int, size: int) -> None:
        match = _MEMBER_RE.match(name)
        if match is None:
            raise ValueError(f"{self.label}: unexpected tar member {name!r} (not a plain key.suffix file)")
        key, suffix = match.groups()
        if key not in self._members:
            self._members[key] = {}
            self._keys.append(key)
            self._spans[key] = (offset, offset + size)
        self._members[key][suffix] = (offset, size)
        start, end = self._spans[key]
        self._spans[key] = (min(start, offset), max(end, offset + size))

    def __len__(self) -> int:
        return len(self._keys)

    def read(self, row: int) -> BinRecord:
        if not 0 <= row < len(self):
            raise IndexError(f"{self.label}: row {row} out of range [0, {len(self)})")
        key = self._keys[row]
        members = self._members[key]
        start, end = self._spans[key]
        # A bin's members are adjacent in the tars we write: one read covers them and the headers between them
        # (were they scattered, the read would just cover more of the file).
        data = os.pread(self._fh.fileno(), end - start, start)
        if len(data) != end - start:
            raise ValueError(f"{self.label}: truncated tar member")
        view = memoryview(data)

        def member(suffix: str) -> memoryview:
            offset, size = members[suffix]
            return view[offset - start : offset - start + size]

        return decode_wds_bin(key, members, member, label=self.label)

    def close(self) -> None:
        self._fh.close()


TarEntry = tuple[str, int, int]  # (member name, offset of its data, size in bytes)
INDEX_CACHE_VERSION = 1


def _tar_index(fh: BinaryIO, *, label: str, index_cache: str | None) -> list[TarEntry]:
    """The index of the tar open in `fh`: from `index_cache` when it holds one for this file, else walked
    (and kept there, atomically)."""
    size = os.fstat(fh.fileno()).st_size
    if index_cache is not None and (entries := _load_index(index_cache, size)) is not None:
        return entries
    entries = index_tar(fh, label=label)
    if index_cache is not None:
        write_json_atomic(
            index_cache, {"version": INDEX_CACHE_VERSION, "file_size": size, "entries": entries}
        )
    return entries


def _load_index(path: str, file_size: int) -> list[TarEntry] | None:
    """A cached tar index for a file of `file_size` bytes; None when absent, unreadable or not for this file."""
    doc = read_json(path)
    try:
        if doc["version"] != INDEX_CACHE_VERSION or doc["file_size"] != file_size:
            return None
        entries = [(str(n), int(o), int(s)) for n, o, s in doc["entries"]]
    except (ValueError, KeyError, TypeError):  # also a missing file (None) or a document of another shape
        return None
    if any(o < 0 or s < 0 or o + s > file_size for _, o, s in entries):
        return None
    return entries


def build_index_cache(path: str, index_cache: str, *, label: str) -> None:
    """Makes sure `index_cache` holds the tar index of the shard file at `path` (walks it if not)."""
    with open(path, "rb") as fh:
        _tar_index(fh, label=label, index_cache=index_cache)


_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_POSIX_MAGIC = b"ustar\x0000"


def index_tar(fh: BinaryIO, *, label: str) -> list[TarEntry]:
    """(name, data offset, size) of every member of the tar open in `fh`, in archive order.

    Archives of regular files with key.suffix names (ustar, GNU or pax; long names as pax `path` or GNU long-name
    members) are walked directly; anything else (links, directories, odd names, global or unusual pax records) is
    indexed by `tarfile`, so the result equals `tarfile`'s view. Raises ValueError naming `label` on a damaged
    archive (truncated, bad header checksum).
    """
    size = os.fstat(fh.fileno()).st_size
    if size == 0:
        raise ValueError(f"{label}: empty file, not a tar archive")
    with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        entries = _walk_plain_tar(buf, label=label)
    if entries is not None:
        return entries
    fh.seek(0)
    try:
        with tarfile.open(fileobj=fh, mode="r:") as tar:
            members = list(tar)
    except tarfile.TarError as e:
        raise ValueError(f"{label}: unreadable tar archive: {e}") from None
    for m in members:
        if not m.isreg():
            raise ValueError(f"{label}: unexpected tar member {m.name!r} (not a plain key.suffix file)")
    return [(m.name, m.offset_data, m.size) for m in members]


def _walk_plain_tar(buf: Any, *, label: str) -> list[TarEntry] | None:
    """Entries of a tar of regular files (pax `path`/`size` records and GNU long names allowed), or None when
    the archive holds anything else and `tarfile` must index it."""
    entries: list[TarEntry] = []
    offset, end = 0, len(buf)
    long_name: str | None = None  # from a pax `path` record or a GNU long-name member, for the next header
    long_size: int | None = None  # from a pax `size` record
    extended = False
    while True:
        header = buf[offset : offset + _BLOCK]
        if len(header) < _BLOCK:
            raise ValueError(f"{label}: truncated tar archive (no end-of-archive block at offset {offset})")
        if header == _ZERO_BLOCK:
            return None if extended else entries  # an extension header needs a member after it
        checksum = _header_number(header[148:156], label, offset)
        if checksum != sum(header) - sum(header[148:156]) + 8 * 32 and checksum != _signed_checksum(header):
            raise ValueError(f"{label}: bad tar header checksum at offset {offset}")
        typeflag, data = header[156:157], offset + _BLOCK
        if typeflag not in (b"0", b"\0", b"x", b"L") or (extended and typeflag in (b"x", b"L")):
            return None  # global pax header, link, directory, ...: tarfile's rules apply
        size = _header_number(header[124:136], label, offset)
        if typeflag in (b"0", b"\0") and long_size is not None:
            size = long_size
        if size < 0 or data + size > end:
            raise ValueError(f"{label}: truncated tar member at offset {offset} (size {size})")
        offset = data + -(-size // _BLOCK) * _BLOCK
        if typeflag in (b"x", b"L"):
            extended = True
            if typeflag == b"L":
                long_name = _header_string(buf[data : data + size])
            elif (pax := _pax_name_size(buf[data : data + size])) is None:
                return None
            else:
                long_name, long_size = pax
            continue
        name = _header_string(header[0:100])
        if header[257:265] == _POSIX_MAGIC and (prefix := _header_string(header[345:500])):
            name = f"{prefix}/{name}"
        if typeflag == b"\0" and name.endswith("/"):
            return None  # an old-style directory
        name = name if long_name is None else long_name
        if _MEMBER_RE.match(name) is None:
            return None  # let tarfile name it exactly as before
        entries.append((name, data, size))
        long_name, long_size, extended = None, None, False


_PAX_RECORD_RE = re.compile(rb"(\d+) ([^=\n]+)=")
_PAX_IGNORED = {b"mtime", b"atime", b"ctime", b"uid", b"gid", b"uname", b"gname", b"comment"}


def _pax_name_size(records: bytes) -> tuple[str | None, int | None] | None:
    """`path` and `size` of a pax extended header, or None when it holds anything else tarfile would apply."""
    name: str | None = None
    size: int | None = None
    pos = 0
    while pos < len(records):
        match = _PAX_RECORD_RE.match(records, pos)
        if match is None:
            return None
        length, keyword = int(match.group(1)), match.group(2)
        value = records[match.end() : pos + length - 1]
        if length <= match.end() - pos or records[pos + length - 1 : pos + length] != b"\n":
            return None
        if keyword == b"path":
            try:
                name = value.decode("utf-8").rstrip("/")
            except UnicodeDecodeError:
                return None
        elif keyword == b"size" and value.isdigit():
            size = int(value)
        elif keyword not in _PAX_IGNORED:
            return None  # hdrcharset, linkpath, sparse maps, vendor keys: tarfile knows them
        pos += length
    return name, size


def _signed_checksum(header: bytes) -> int:
    """The header sum with bytes read as signed and the checksum field as spaces (some old tars use it)."""
    return sum(struct.unpack("148b8x356b", header)) + 8 * 32


def _header_string(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")


def _header_number(field: bytes, label: str, offset: int) -> int:
    """A numeric header field: NUL/space padded octal, or GNU base-256 (first byte 0x80 or 0xff)."""
    if field[0] in (0x80, 0xFF):
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[0] == 0xFF else value
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise ValueError(f"{label}: invalid tar header at offset {offset}") from None


_NPY_MAGIC = b"\x93NUMPY"
_NPY_HEADER_RE = re.compile(
    rb"\{'descr': '([<|>][a-z]\d+)', 'fortran_order': False, 'shape': \((|\d+,|\d+(?:, \d+)+)\), \} *\n"
)
# Plain little-endian numeric dtypes decoded directly; any other descr goes through np.load.
_NPY_DTYPES = {
    descr.encode(): np.dtype(descr)
    for descr in ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8")
}
_NPY_MAX_HEADER = 10000  # np.load's own limit for a safe header


def decode_npy(data: bytes | memoryview) -> np.ndarray:
    """The array in `.npy` bytes; common headers are parsed directly, others go to np.load (never unpickling).

    Raises ValueError on truncated data or anything np.load(allow_pickle=False) refuses.
    """
    view = memoryview(data)
    if bytes(view[:6]) == _NPY_MAGIC and len(view) >= 12 and view[7] == 0 and view[6] in (1, 2, 3):
        start = 10 if view[6] == 1 else 12
        header_len = int.from_bytes(view[8:start], "little")
        match = None
        if header_len <= _NPY_MAX_HEADER and start + header_len <= len(view):
            match = _NPY_HEADER_RE.fullmatch(bytes(view[start : start + header_len]))
        if match is not None and (dtype := _NPY_DTYPES.get(match.group(1))) is not None:
            shape_text = match.group(2)
            shape = tuple(int(d) for d in shape_text.split(b",") if d.strip())
            count = math.prod(shape)
            body = view[start + header_len :]
            if len(body) < count * dtype.itemsize:
                raise ValueError(
                    f"truncated .npy: shape {shape} of {dtype} needs {count * dtype.itemsize} bytes, has {len(body)}"
                )
            return np.frombuffer(body, dtype=dtype, count=count).reshape(shape).copy()
    return np.load(io.BytesIO(view), allow_pickle=False)  # type: ignore[no-any-return]


def decode_wds_bin(
    key: str, suffixes: Iterable[str], read: Callable[[str], bytes | memoryview], *, label: str
) -> BinRecord:
    """The record of bin `key` from its WebDataset members; `read(suffix)` gives a member's bytes."""
    try:
        meta = json.loads(bytes(read(WDS_JSON_MEMBER)))
        rec: BinRecord = {"key": key, "sample_ids": list(meta["sample_ids"])}
        for name, dtype in ARRAY_FIELDS.items():
            member = f"{name}.npy"
            data = read(member)
            try:
                arr = decode_npy(data)
            except ValueError as e:
                raise ValueError(f"{label}: bin {key} member {member!r}: {e}") from None
            rec[name] = np.asarray(arr, dtype=dtype)
    except KeyError as e:
        raise ValueError(f"{label}: bin {key} lacks member {e}") from None
    rec["image_grid_thw"] = rec["image_grid_thw"].reshape(-1, 3)
    images = sorted(
        (int(m.group(1)), m.group(2), suffix)
        for suffix in suffixes
        if (m := _IMG_RE.match(suffix)) is not None
    )
    rec["images"] = [bytes(read(suffix)) for _, _, suffix in images]
    rec["image_formats"] = list(meta.get("image_formats") or [ext for _, ext, _ in images])
    return rec


def open_shard_reader(
    path: str, fmt: str, *, label: str, index_cache: str | None = None
) -> ArrowShardReader | WdsShardReader:
    """A reader of the shard file at `path`; `index_cache` (WebDataset only) as in `WdsShardReader`."""
    if fmt == "arrow":
        return ArrowShardReader(path, label=label)
    if fmt == "wds":
        return WdsShardReader(path, label=label, index_cache=index_cache)
    raise ValueError(f"unknown shard format {fmt!r} (want 'arrow' or 'wds')")
