"""The project's one tar walker: (member name, data offset, size) of every member, from the headers.

Used by the loader (WebDataset shards, mmpack.dataloader.readers), the offline job (raw WebDataset input,
mmpack.offline_packing.tar_source) and `mmpack stats` (bin metadata of tar shards). Stdlib only.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import re
import struct
import tarfile
from collections.abc import Iterator
from typing import IO, Any

TarEntry = tuple[str, int, int]  # (member name, offset of its data, size in bytes)
MEMBER_RE = re.compile(r"^([A-Za-z0-9_-]+)\.([A-Za-z0-9_.]+)$")  # a plain WebDataset key.suffix member

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_POSIX_MAGIC = b"ustar\x0000"


def index_tar(fh: IO[bytes], *, label: str, non_regular: str = "raise") -> list[TarEntry]:
    """(name, data offset, size) of every member of the tar open in `fh`, in archive order.

    Archives of regular files with key.suffix names (ustar, GNU or pax; long names as pax `path` or GNU long-name
    members) are walked directly; anything else (links, directories, odd names, global or unusual pax records) is
    indexed by `tarfile`, so the result equals `tarfile`'s view. Members that are not regular files raise
    ValueError (`non_regular="raise"`) or are left out ("skip"). `fh` is a local file (memory-mapped) or any
    seekable binary file object (a remote object: headers read by seeking). Raises ValueError naming `label` on
    a damaged archive (truncated, bad header checksum).
    """
    if non_regular not in ("raise", "skip"):
        raise ValueError(f"non_regular must be 'raise' or 'skip', got {non_regular!r}")
    with _buffer_of(fh) as buf:
        if len(buf) == 0:
            raise ValueError(f"{label}: empty file, not a tar archive")
        entries = walk_plain_tar(buf, label=label)
    if entries is not None:
        return entries
    fh.seek(0)
    try:
        with tarfile.open(fileobj=fh, mode="r:") as tar:
            members = list(tar)
    except tarfile.TarError as e:
        raise ValueError(f"{label}: unreadable tar archive: {e}") from None
    if non_regular == "raise":
        for m in members:
            if not m.isreg():
                raise ValueError(f"{label}: unexpected tar member {m.name!r} (not a plain key.suffix file)")
    return [(m.name, m.offset_data, m.size) for m in members if m.isreg()]


@contextlib.contextmanager
def _buffer_of(fh: IO[bytes]) -> Iterator[Any]:
    """The bytes of `fh` as a sliceable buffer: a memory map of a local file, else reads by seeking."""
    try:
        fileno = fh.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fileno = -1
    if fileno >= 0 and os.fstat(fileno).st_size > 0:
        with mmap.mmap(fileno, 0, access=mmap.ACCESS_READ) as buf:
            yield buf
    else:
        yield _SeekingView(fh)


class _SeekingView:
    """`len()` and byte slices of a seekable file object, read on demand."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._size = fh.seek(0, os.SEEK_END)

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _ = span.indices(self._size)
        self._fh.seek(start)
        return self._fh.read(max(0, stop - start))


def walk_plain_tar(buf: Any, *, label: str) -> list[TarEntry] | None:
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
