"""The job's local work folder: per-chunk stage outputs, completion markers and atomic local writes.

Every file is written to a temporary name and renamed, and a chunk's `.done.json` is written after its
outputs, so a killed job leaves either complete files or none, never a partial one under a final name.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

# the stage modules take the project's one atomic writer from here
from packing.fileio import atomic_write_bytes as atomic_write_bytes
from packing.fileio import atomic_write_json as atomic_write_json


def npy_bytes(arr: np.ndarray) -> bytes:
    """The bytes of `arr` as a C-order .npy file (no pickled objects)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def atomic_write_npy(path: Path, arr: np.ndarray) -> None:
    """Write `arr` to `path` as a .npy file, atomically."""
    atomic_write_bytes(path, npy_bytes(arr))


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def jsonl_line(row: dict) -> bytes:
    """One compact sorted-key JSON object and its newline (deterministic bytes)."""
    return (json.dumps(row, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n").encode()


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Atomically write one compact sorted-key JSON object per line."""
    atomic_write_bytes(path, b"".join(jsonl_line(r) for r in rows))


def read_done_marker(path: Path, fingerprint: str) -> dict | None:
    """The completion marker at `path` if it records `fingerprint` (same options as now), else None."""
    if not path.is_file():
        return None
    marker = read_json(path)
    return marker if marker.get("fingerprint") == fingerprint else None


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class WorkDir:
    """Layout of the work folder: `<root>/<stage>/...` plus `<root>/<stage>.done.json` markers."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def stage_dir(self, stage: str) -> Path:
        d = self.root / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    def chunk_path(self, stage: str, chunk: int, suffix: str) -> Path:
        return self.stage_dir(stage) / f"chunk-{chunk:06d}.{suffix}"

    def marker(self, stage: str) -> Path:
        return self.root / f"{stage}.done.json"

    def is_done(self, stage: str, fingerprint: str) -> bool:
        """True when `stage` completed with the same options (fingerprint) as now."""
        return read_done_marker(self.marker(stage), fingerprint) is not None

    def mark_done(self, stage: str, fingerprint: str, info: dict) -> None:
        atomic_write_json(self.marker(stage), {"fingerprint": fingerprint, **info})

    def read_marker(self, stage: str) -> dict:
        return read_json(self.marker(stage))

    def clear_marker(self, stage: str) -> None:
        self.marker(stage).unlink(missing_ok=True)
