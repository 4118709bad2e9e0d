"""The tar index of a WebDataset shard and its cache file, shared by the processes of a machine (the walk
itself is packing.tar_index)."""

from __future__ import annotations

import os
from typing import BinaryIO

from dataloader.storage import read_json, write_json_atomic
from packing.tar_index import MEMBER_RE, TarEntry, _walk_plain_tar, index_tar

__all__ = [
    "INDEX_CACHE_VERSION",
    "MEMBER_RE",
    "TarEntry",
    "_walk_plain_tar",
    "build_index_cache",
    "index_tar",
]

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
