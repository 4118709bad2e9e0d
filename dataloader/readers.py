"""Random access to the bins of one local shard file: Arrow IPC or WebDataset tar.

Both readers return the same `BinRecord` dict: key, input_ids (uint32), loss_mask (uint8), seq_lens (int32),
sample_ids (list[str]), images (list[bytes]), image_formats (list[str]), image_grid_thw (int32 [n, 3]).
Tar members are never extracted: they are located by offset and read as bytes; arrays go through
`np.load(allow_pickle=False)` and nothing is unpickled.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

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
    """Indexes the members of a WebDataset tar once; reads a bin's members by offset."""

    def __init__(self, path: str, *, label: str) -> None:
        self.label = label
        self._fh = open(path, "rb")  # noqa: SIM115 - kept open for the reader's lifetime
        self._keys: list[str] = []
        self._members: dict[str, dict[str, tuple[int, int]]] = {}
        with tarfile.open(fileobj=self._fh, mode="r:") as tar:
            for m in tar:
                self._add_member(m)

    def _add_member(self, m: tarfile.TarInfo) -> None:
        match = _MEMBER_RE.match(m.name)
        if not m.isreg() or match is None:
            raise ValueError(f"{self.label}: unexpected tar member {m.name!r} (not a plain key.suffix file)")
        key, suffix = match.groups()
        if key not in self._members:
            self._members[key] = {}
            self._keys.append(key)
        self._members[key][suffix] = (m.offset_data, m.size)

    def __len__(self) -> int:
        return len(self._keys)

    def _bytes(self, where: tuple[int, int]) -> bytes:
        self._fh.seek(where[0])
        data = self._fh.read(where[1])
        if len(data) != where[1]:
            raise ValueError(f"{self.label}: truncated tar member")
        return data

    def read(self, row: int) -> BinRecord:
        if not 0 <= row < len(self):
            raise IndexError(f"{self.label}: row {row} out of range [0, {len(self)})")
        key = self._keys[row]
        members = self._members[key]
        return decode_wds_bin(key, members, lambda suffix: self._bytes(members[suffix]), label=self.label)

    def close(self) -> None:
        self._fh.close()


def decode_wds_bin(
    key: str, suffixes: Iterable[str], read: Callable[[str], bytes], *, label: str
) -> BinRecord:
    """The record of bin `key` from its WebDataset members; `read(suffix)` gives a member's bytes."""
    try:
        meta = json.loads(read(WDS_JSON_MEMBER))
        rec: BinRecord = {"key": key, "sample_ids": list(meta["sample_ids"])}
        for name, dtype in ARRAY_FIELDS.items():
            arr = np.load(io.BytesIO(read(f"{name}.npy")), allow_pickle=False)
            rec[name] = np.asarray(arr, dtype=dtype)
    except KeyError as e:
        raise ValueError(f"{label}: bin {key} lacks member {e}") from None
    rec["image_grid_thw"] = rec["image_grid_thw"].reshape(-1, 3)
    images = sorted(
        (int(m.group(1)), m.group(2), suffix)
        for suffix in suffixes
        if (m := _IMG_RE.match(suffix)) is not None
    )
    rec["images"] = [read(suffix) for _, _, suffix in images]
    rec["image_formats"] = list(meta.get("image_formats") or [ext for _, ext, _ in images])
    return rec


def open_shard_reader(path: str, fmt: str, *, label: str) -> ArrowShardReader | WdsShardReader:
    if fmt == "arrow":
        return ArrowShardReader(path, label=label)
    if fmt == "wds":
        return WdsShardReader(path, label=label)
    raise ValueError(f"unknown shard format {fmt!r} (want 'arrow' or 'wds')")
