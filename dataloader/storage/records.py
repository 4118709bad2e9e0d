"""Small per-shard facts kept on local disk: content digests and JSON records written atomically."""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any

from packing.fileio import atomic_write_json

CHUNK_BYTES = 4 << 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str) -> Any:
    """The JSON document at `path`; None when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json_atomic(path: str, doc: Any) -> None:
    """Writes `doc` (and its folder) so readers see all of it or nothing; a failure only loses the shortcut."""
    with contextlib.suppress(OSError):
        atomic_write_json(path, doc, indent=None)
