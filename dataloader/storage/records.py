"""Small per-shard facts kept on local disk: content digests and JSON records written atomically."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any

from mmpack.packing.fileio import atomic_write_json

CHUNK_BYTES = 4 << 20
_RECORD_READ = 64 << 10  # records are a few KB: one read is all but always enough


def file_stamp(st: os.stat_result) -> dict[str, int]:
    """What tells a file's bytes apart without reading them (as far as a stat can): size, mtime, inode."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev}


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str) -> Any:
    """The JSON document at `path`; None when it is missing or unreadable.

    Read with plain system calls (open, read until a short read, close): the loader reads a few of these
    small records per shard in every worker, and a Python file object adds several more calls each."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        parts = []
        while True:
            chunk = os.read(fd, _RECORD_READ)
            parts.append(chunk)
            if len(chunk) < _RECORD_READ:
                break
        return json.loads(b"".join(parts))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def write_json_atomic(path: str, doc: Any) -> None:
    """Writes `doc` (and its folder) so readers see all of it or nothing; a failure only loses the shortcut."""
    with contextlib.suppress(OSError):
        atomic_write_json(path, doc, indent=None)
