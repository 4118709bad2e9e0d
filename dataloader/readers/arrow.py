"""Arrow IPC shards: memory-mapped, bin i is row i of the concatenated record batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from mmpack.dataloader.readers.record import BinRecord, no_videos, video_plan_dicts
from mmpack.packing.format import ARRAY_FIELDS, VIDEO_ARRAY_FIELDS


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
        if "videos" not in cols:  # a dataset without videos (any format version)
            return rec | no_videos()
        for name in ("videos", "video_formats", "video_plans"):
            offsets, flat = cols[name]
            rec[name] = flat[offsets[j] : offsets[j + 1]].to_pylist()
        offsets, flat = cols["video_grid_thw"]
        rec["video_grid_thw"] = np.asarray(flat[offsets[j] : offsets[j + 1]], dtype=np.int32).reshape(-1, 3)
        rec["video_plans"] = video_plan_dicts(rec["video_plans"], f"{self.label}: bin {rec['key']}")
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
    if "videos" in batch.schema.names:
        for name in ("videos", "video_formats", "video_plans"):
            cols[name] = _list_column(batch.column(name))
        for name in VIDEO_ARRAY_FIELDS:
            offsets, flat = _list_column(batch.column(name))
            cols[name] = (offsets * 3, flat.flatten().to_numpy(zero_copy_only=False))
    return cols
