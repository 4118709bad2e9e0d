"""The index of a tar archive: (member name, data offset, size) per member, walked from the headers directly
(`tarfile` only for unusual archives), and its cache file shared by the processes of a machine."""

from __future__ import annotations

import mmap
import os
import re
import struct
import tarfile
from typing import Any, BinaryIO

from dataloader.storage import read_json, write_json_atomic

MEMBER_RE = re.compile(r"^([A-Za-z0-9_-]+)\.([A-Za-z0-9_.]+)$")


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
        if MEMBER_RE.match(name) is None:
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
