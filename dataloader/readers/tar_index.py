"""The tar index of a WebDataset shard and its cache file, shared by the processes of a machine (the walk
itself is mmpack.packing.tar_index)."""

from __future__ import annotations

import os
from typing import Any

from mmpack.dataloader.storage import read_json, write_json_atomic
from mmpack.packing.tar_index import MEMBER_RE, TarEntry, index_tar, walk_plain_tar

__all__ = [
    "INDEX_CACHE_VERSION",
    "MEMBER_RE",
    "BinMembers",
    "TarEntry",
    "build_index_cache",
    "group_members",
    "index_tar",
    "shard_bins",
    "walk_plain_tar",
]

# 2: the members grouped by bin, as the reader uses them (1 held the flat member list; such files are redone)
INDEX_CACHE_VERSION = 2

# One bin of a WebDataset shard: key, the byte span [start, end) its members cover, suffix -> (offset, size).
BinMembers = tuple[str, int, int, dict[str, tuple[int, int]]]


def group_members(entries: list[TarEntry], *, label: str) -> list[BinMembers]:
    """The members of a WebDataset tar grouped by key, keys in archive order (names checked as key.suffix)."""
    bins: dict[str, list[Any]] = {}
    for name, offset, size in entries:
        match = MEMBER_RE.match(name)
        if match is None:
            raise ValueError(f"{label}: unexpected tar member {name!r} (not a plain key.suffix file)")
        key, suffix = match.groups()
        entry = bins.get(key)
        if entry is None:
            bins[key] = [key, offset, offset + size, {suffix: (offset, size)}]
            continue
        entry[3][suffix] = (offset, size)
        entry[1], entry[2] = min(entry[1], offset), max(entry[2], offset + size)
    return [(key, start, end, members) for key, start, end, members in bins.values()]


def shard_bins(fd: int, *, label: str, index_cache: str | None) -> list[BinMembers]:
    """The bins of the tar open as descriptor `fd`: from `index_cache` when it holds them for this file, else
    walked and grouped (and kept there, atomically)."""
    size = os.fstat(fd).st_size
    if index_cache is not None and (bins := _load_index(index_cache, size)) is not None:
        return bins
    with os.fdopen(os.dup(fd), "rb") as fh:
        bins = group_members(index_tar(fh, label=label), label=label)
    if index_cache is not None:
        doc = {
            "version": INDEX_CACHE_VERSION,
            "file_size": size,
            "bins": [
                [key, start, end, {s: list(m) for s, m in members.items()}]
                for key, start, end, members in bins
            ],
        }
        write_json_atomic(index_cache, doc)
    return bins


def _load_index(path: str, file_size: int) -> list[BinMembers] | None:
    """Cached bins for a file of `file_size` bytes; None when absent, unreadable or not for this file.

    The bins are used as JSON gives them (a list per bin, a [offset, size] list per member: the reader only
    unpacks them), after checking every number is an int inside the file and every member inside its bin's
    span: rebuilding them as tuples cost as much as reading the file, once per shard in every worker."""
    doc = read_json(path)
    try:
        if doc["version"] != INDEX_CACHE_VERSION or doc["file_size"] != file_size:
            return None
        bins = doc["bins"]
        for key, start, end, members in bins:
            ints = type(start) is int and type(end) is int
            if not (ints and type(key) is str and 0 <= start <= end <= file_size):
                return None
            for offset, size in members.values():
                ints = type(offset) is int and type(size) is int
                if not (ints and size >= 0 and start <= offset <= end - size):
                    return None
    except (ValueError, KeyError, TypeError, AttributeError):  # also a missing file (None), another shape
        return None
    return bins  # type: ignore[no-any-return]


def build_index_cache(path: str, index_cache: str, *, label: str) -> None:
    """Makes sure `index_cache` holds the bins of the shard file at `path` (walks it if not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        shard_bins(fd, label=label, index_cache=index_cache)
    finally:
        os.close(fd)
