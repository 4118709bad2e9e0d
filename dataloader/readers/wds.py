"""WebDataset tar shards: members located through the tar index, a bin's members read with one `pread`."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable

import numpy as np

from mmpack.dataloader.readers.npy import decode_npy
from mmpack.dataloader.readers.record import BinRecord, no_videos, video_plan_dicts
from mmpack.dataloader.readers.tar_index import shard_bins
from mmpack.packing.format import ARRAY_FIELDS, WDS_JSON_MEMBER

_IMG_RE = re.compile(r"^img(\d+)\.([A-Za-z0-9]+)$")
_VID_RE = re.compile(r"^vid(\d+)\.([A-Za-z0-9]+)$")


class WdsShardReader:
    """Indexes the members of a WebDataset tar once; reads all members of a bin with one `pread`.

    `index_cache`: a file where the tar index of this exact content is kept (name it by the shard's verified
    sha256). The first reader on a machine writes it, atomically; later ones (other loader workers, other
    ranks) load it instead of walking the archive again.
    """

    def __init__(self, path: str, *, label: str, index_cache: str | None = None) -> None:
        self.label = label
        # A plain descriptor, kept for the reader's lifetime: bins are read with pread, and a Python file
        # object would cost more system calls to open (one per shard per worker).
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._bins = shard_bins(self._fd, label=label, index_cache=index_cache)
        except BaseException:
            os.close(self._fd)
            raise

    def __len__(self) -> int:
        return len(self._bins)

    def read(self, row: int) -> BinRecord:
        if not 0 <= row < len(self):
            raise IndexError(f"{self.label}: row {row} out of range [0, {len(self)})")
        key, start, end, members = self._bins[row]
        # A bin's members are adjacent in the tars we write: one read covers them and the headers between them
        # (were they scattered, the read would just cover more of the file).
        data = os.pread(self._fd, end - start, start)
        if len(data) != end - start:
            raise ValueError(f"{self.label}: truncated tar member")
        view = memoryview(data)

        def member(suffix: str) -> memoryview:
            offset, size = members[suffix]
            return view[offset - start : offset - start + size]

        return decode_wds_bin(key, members, member, label=self.label)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def decode_wds_bin(
    key: str, suffixes: Iterable[str], read: Callable[[str], bytes | memoryview], *, label: str
) -> BinRecord:
    """The record of bin `key` from its WebDataset members; `read(suffix)` gives a member's bytes."""
    try:
        meta = json.loads(bytes(read(WDS_JSON_MEMBER)))
        rec: BinRecord = {"key": key, "sample_ids": list(meta["sample_ids"])}
        for name, dtype in ARRAY_FIELDS.items():
            member = f"{name}.npy"
            data = read(member)
            try:
                arr = decode_npy(data)
            except ValueError as e:
                raise ValueError(f"{label}: bin {key} member {member!r}: {e}") from None
            rec[name] = np.asarray(arr, dtype=dtype)
    except KeyError as e:
        raise ValueError(f"{label}: bin {key} lacks member {e}") from None
    rec["image_grid_thw"] = rec["image_grid_thw"].reshape(-1, 3)
    images = sorted(
        (int(m.group(1)), m.group(2), suffix)
        for suffix in suffixes
        if (m := _IMG_RE.match(suffix)) is not None
    )
    rec["images"] = [bytes(read(suffix)) for _, _, suffix in images]
    rec["image_formats"] = list(meta.get("image_formats") or [ext for _, ext, _ in images])
    if not meta.get("n_videos"):
        return rec | no_videos()
    videos = sorted(
        (int(m.group(1)), suffix) for suffix in suffixes if (m := _VID_RE.match(suffix)) is not None
    )
    if len(videos) != meta["n_videos"]:
        raise ValueError(f"{label}: bin {key} lists {meta['n_videos']} videos, its tar has {len(videos)}")
    try:
        grids = decode_npy(read("video_grid_thw.npy"))
    except KeyError:
        raise ValueError(f"{label}: bin {key} lacks member 'video_grid_thw.npy'") from None
    rec["videos"] = [bytes(read(suffix)) for _, suffix in videos]
    rec["video_formats"] = list(meta["video_formats"])
    rec["video_grid_thw"] = np.asarray(grids, dtype=np.int32).reshape(-1, 3)
    rec["video_plans"] = video_plan_dicts(meta["video_plans"], f"{label}: bin {key}")
    return rec
