"""Random access to the bins of one local shard file: Arrow IPC or WebDataset tar.

Both readers return the same `BinRecord` dict: key, input_ids (uint32), loss_mask (uint8), seq_lens (int32),
sample_ids (list[str]), images (list[bytes]), image_formats (list[str]), image_grid_thw (int32 [n, 3]).
Tar members are never extracted: they are located by offset (headers walked directly, `tarfile` only for unusual
archives) and a bin's members are read with one `pread`; `.npy` arrays are decoded directly when the header is a
plain one, otherwise by `np.load(allow_pickle=False)`, and nothing is unpickled.
"""

from __future__ import annotations

from mmpack.dataloader.readers.arrow import ArrowShardReader
from mmpack.dataloader.readers.npy import decode_npy
from mmpack.dataloader.readers.record import BinRecord
from mmpack.dataloader.readers.tar_index import (
    INDEX_CACHE_VERSION,
    TarEntry,
    build_index_cache,
    index_tar,
    walk_plain_tar,
)
from mmpack.dataloader.readers.wds import WdsShardReader, decode_wds_bin

__all__ = [
    "INDEX_CACHE_VERSION",
    "ArrowShardReader",
    "BinRecord",
    "TarEntry",
    "WdsShardReader",
    "build_index_cache",
    "decode_npy",
    "decode_wds_bin",
    "index_tar",
    "open_shard_reader",
    "walk_plain_tar",
]


def open_shard_reader(
    path: str, fmt: str, *, label: str, index_cache: str | None = None
) -> ArrowShardReader | WdsShardReader:
    """A reader of the shard file at `path`; `index_cache` (WebDataset only) as in `WdsShardReader`."""
    if fmt == "arrow":
        return ArrowShardReader(path, label=label)
    if fmt == "wds":
        return WdsShardReader(path, label=label, index_cache=index_cache)
    raise ValueError(f"unknown shard format {fmt!r} (want 'arrow' or 'wds')")
