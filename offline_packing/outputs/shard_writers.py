"""Shard writers: one packed bin -> an Arrow IPC row or a group of WebDataset tar members.

Both formats hold the same record per bin (packing/format.py). Output bytes are a pure function of the
bins: no timestamps, owners or random names end up in a shard. Video fields are written only for datasets
with videos (Arrow: `with_videos` columns in every shard; WebDataset: members of bins that hold videos), so
the shards of image-only datasets are byte-identical to those of format version 2.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import pyarrow as pa

from mmpack.offline_packing.workdir import npy_bytes
from mmpack.packing.format import WDS_IMAGE_MEMBER, WDS_JSON_MEMBER, WDS_VIDEO_MEMBER

ARROW_BATCH_ROWS = 64
ARROW_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),
        pa.field("input_ids", pa.list_(pa.uint32())),
        pa.field("loss_mask", pa.list_(pa.uint8())),
        pa.field("seq_lens", pa.list_(pa.int32())),
        pa.field("sample_ids", pa.list_(pa.string())),
        pa.field("images", pa.list_(pa.binary())),
        pa.field("image_formats", pa.list_(pa.string())),
        pa.field("image_grid_thw", pa.list_(pa.list_(pa.int32(), 3))),
    ]
)
ARROW_VIDEO_FIELDS = [
    pa.field("videos", pa.list_(pa.binary())),
    pa.field("video_formats", pa.list_(pa.string())),
    pa.field("video_grid_thw", pa.list_(pa.list_(pa.int32(), 3))),
    pa.field("video_plans", pa.list_(pa.string())),
]
ARROW_VIDEO_SCHEMA = pa.schema([*ARROW_SCHEMA, *ARROW_VIDEO_FIELDS])
_EXT_RE = re.compile(r"^[a-z0-9]{1,8}$")


@dataclass
class PackedBin:
    """Everything stored for one bin."""

    key: str
    input_ids: np.ndarray  # uint32 [n_tokens]
    loss_mask: np.ndarray  # uint8 [n_tokens]
    seq_lens: np.ndarray  # int32 [n_samples]
    sample_ids: list[str]
    images: list[bytes]
    image_formats: list[str]
    image_grid_thw: np.ndarray  # int32 [n_images, 3]
    videos: list[bytes] = field(default_factory=list)
    video_formats: list[str] = field(default_factory=list)
    video_plans: list[dict] = field(default_factory=list)  # VideoPlan.to_dict() per video
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))


class HashingWriter:
    """A write-only file wrapper that counts bytes and computes sha256 as data goes through."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size_bytes = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size_bytes += len(view)
        self._f.write(view)
        return len(view)

    def tell(self) -> int:
        return self.size_bytes

    def flush(self) -> None:
        self._f.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True  # the underlying file is closed by its owner


def _list_array(values: pa.Array, lengths: list[int]) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def video_plan_json(plan: dict) -> str:
    """The stored text of one video plan (sorted keys: deterministic bytes)."""
    return json.dumps(plan, sort_keys=True, separators=(",", ":"))


def bins_to_record_batch(bins: list[PackedBin], with_videos: bool = False) -> pa.RecordBatch:
    """Arrow record batch of `bins` (one row each) with ARROW_SCHEMA (ARROW_VIDEO_SCHEMA `with_videos`)."""
    cat = lambda arrs, dtype: np.concatenate(arrs).astype(dtype, copy=False) if arrs else np.zeros(0, dtype)  # noqa: E731
    grids = cat([b.image_grid_thw.reshape(-1) for b in bins], np.int32)
    n_images = [len(b.images) for b in bins]
    columns = [
        pa.array([b.key for b in bins], pa.string()),
        _list_array(pa.array(cat([b.input_ids for b in bins], np.uint32)), [len(b.input_ids) for b in bins]),
        _list_array(pa.array(cat([b.loss_mask for b in bins], np.uint8)), [len(b.loss_mask) for b in bins]),
        _list_array(pa.array(cat([b.seq_lens for b in bins], np.int32)), [len(b.seq_lens) for b in bins]),
        _list_array(
            pa.array([s for b in bins for s in b.sample_ids], pa.string()), [len(b.sample_ids) for b in bins]
        ),
        _list_array(pa.array([im for b in bins for im in b.images], pa.binary()), n_images),
        _list_array(pa.array([f for b in bins for f in b.image_formats], pa.string()), n_images),
        _list_array(pa.FixedSizeListArray.from_arrays(pa.array(grids, pa.int32()), 3), n_images),
    ]
    if not with_videos:
        if any(b.videos for b in bins):
            raise ValueError("bins hold videos: write them with with_videos=True")
        return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
    n_videos = [len(b.videos) for b in bins]
    video_grids = cat([b.video_grid_thw.reshape(-1) for b in bins], np.int32)
    columns += [
        _list_array(pa.array([v for b in bins for v in b.videos], pa.binary()), n_videos),
        _list_array(pa.array([f for b in bins for f in b.video_formats], pa.string()), n_videos),
        _list_array(pa.FixedSizeListArray.from_arrays(pa.array(video_grids, pa.int32()), 3), n_videos),
        _list_array(
            pa.array([video_plan_json(p) for b in bins for p in b.video_plans], pa.string()), n_videos
        ),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_VIDEO_SCHEMA)


class ArrowShardWriter:
    """Arrow IPC file of bins, in record batches of up to ARROW_BATCH_ROWS rows."""

    def __init__(self, sink: IO[bytes], with_videos: bool = False):
        self._with_videos = with_videos
        self._writer = pa.ipc.new_file(sink, ARROW_VIDEO_SCHEMA if with_videos else ARROW_SCHEMA)
        self._pending: list[PackedBin] = []

    def add(self, packed: PackedBin) -> None:
        self._pending.append(packed)
        if len(self._pending) == ARROW_BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.write_batch(bins_to_record_batch(self._pending, self._with_videos))
            self._pending = []

    def close(self) -> None:
        self._flush()
        self._writer.close()


def image_extension(fmt: str) -> str:
    """A safe member extension for an image format name ("jpg", "png", ...)."""
    ext = fmt.lower()
    return ext if _EXT_RE.match(ext) else "bin"


def wds_members(packed: PackedBin) -> list[tuple[str, bytes]]:
    """(member name, bytes) of one bin in a WebDataset tar, sorted by name."""
    k = packed.key
    meta = {
        "key": k,
        "sample_ids": list(packed.sample_ids),
        "image_formats": list(packed.image_formats),
        "n_images": len(packed.images),
    }
    if packed.videos:
        meta |= {
            "n_videos": len(packed.videos),
            "video_formats": list(packed.video_formats),
            "video_plans": list(packed.video_plans),
        }
    members = [
        (f"{k}.{WDS_JSON_MEMBER}", json.dumps(meta, sort_keys=True, ensure_ascii=False).encode()),
        (f"{k}.input_ids.npy", npy_bytes(packed.input_ids.astype(np.uint32, copy=False))),
        (f"{k}.loss_mask.npy", npy_bytes(packed.loss_mask.astype(np.uint8, copy=False))),
        (f"{k}.seq_lens.npy", npy_bytes(packed.seq_lens.astype(np.int32, copy=False))),
        (
            f"{k}.image_grid_thw.npy",
            npy_bytes(packed.image_grid_thw.astype(np.int32, copy=False).reshape(-1, 3)),
        ),
    ]
    for i, (data, fmt) in enumerate(zip(packed.images, packed.image_formats)):
        members.append((f"{k}." + WDS_IMAGE_MEMBER.format(index=i, ext=image_extension(fmt)), data))
    if packed.videos:
        grids = packed.video_grid_thw.astype(np.int32, copy=False).reshape(-1, 3)
        members.append((f"{k}.video_grid_thw.npy", npy_bytes(grids)))
    for i, (data, fmt) in enumerate(zip(packed.videos, packed.video_formats)):
        members.append((f"{k}." + WDS_VIDEO_MEMBER.format(index=i, ext=image_extension(fmt)), data))
    return sorted(members)


class WdsShardWriter:
    """WebDataset tar of bins with deterministic headers (mtime 0, owner 0/root-less, mode 0644)."""

    def __init__(self, sink: IO[bytes]):
        # USTAR headers are cheaper to build than PAX ones; bin keys and member names fit in 100 bytes
        # unless the shard prefix is very long, which then gets PAX
        self._sink = sink
        self._tar: tarfile.TarFile | None = None

    def _open(self, longest_name: int) -> tarfile.TarFile:
        fmt = tarfile.USTAR_FORMAT if longest_name <= 100 else tarfile.PAX_FORMAT
        return tarfile.open(fileobj=self._sink, mode="w", format=fmt)  # type: ignore[call-overload]

    def add(self, packed: PackedBin) -> None:
        members = wds_members(packed)
        if self._tar is None:
            self._tar = self._open(len(packed.key) + 40)  # the key plus the longest member suffix
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        if self._tar is None:
            self._tar = self._open(0)
        self._tar.close()


def open_shard_writer(
    fmt: str, sink: IO[bytes], with_videos: bool = False
) -> ArrowShardWriter | WdsShardWriter:
    """A writer of format `fmt` ("arrow" or "wds") over `sink`; `with_videos`: the dataset holds videos."""
    if fmt == "arrow":
        return ArrowShardWriter(sink, with_videos)
    if fmt == "wds":
        return WdsShardWriter(sink)
    raise ValueError(f"unknown shard format {fmt!r}")
