"""Read the packing of a packed dataset (manifest + per-bin `seq_lens`/`image_grid_thw`/`video_grid_thw`) for
`mmpack stats`.

Only metadata is read: from Arrow shards the `key`, `seq_lens`, `image_grid_thw` and (datasets with videos)
`video_grid_thw` columns (other columns are never loaded), from WebDataset tars the `.json`, `.seq_lens.npy`,
`.image_grid_thw.npy` and `.video_grid_thw.npy` members (image and video members are skipped by seeking). Paths are fsspec URLs: local, `file://`, `s3://`, `http(s)://`.
"""

from __future__ import annotations

import io
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from mmpack.offline_packing.engines.workers import capped_workers
from mmpack.offline_packing.stats.inputs import StatsInputError
from mmpack.packing.format import MANIFEST_NAME
from mmpack.packing.manifest import Manifest, ManifestError
from mmpack.packing.tar_index import index_tar

_ARROW_COLUMNS = ("key", "seq_lens", "image_grid_thw")


@dataclass(frozen=True)
class ShardBins:
    """The bins of one shard: samples and images per bin, sample lengths, image tokens."""

    path: str
    format: str
    keys: list[str]
    sample_lengths: np.ndarray  # int64, concatenated over the shard's bins in order
    samples_per_bin: np.ndarray  # int64 [bins]
    images_per_bin: np.ndarray  # int64 [bins]
    image_patches_per_bin: np.ndarray  # int64 [bins], sum of t*h*w (before the merge)
    size_bytes: int
    videos_per_bin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [bins] (empty: none)
    video_steps_per_bin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sum of grid t
    video_patches_per_bin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sum of t*h*w


@dataclass(frozen=True)
class DatasetPacking:
    """The packing of a whole dataset, in global bin order (per-dataset arrays are built once, on first use)."""

    url: str
    manifest: dict
    format: str
    capacity: int
    shards: list[ShardBins]
    warnings: list[str] = field(default_factory=list)

    @cached_property
    def samples_per_bin(self) -> np.ndarray:
        return np.concatenate([s.samples_per_bin for s in self.shards] or [np.zeros(0, np.int64)])

    @cached_property
    def lengths(self) -> np.ndarray:
        return np.concatenate([s.sample_lengths for s in self.shards] or [np.zeros(0, np.int64)])

    @cached_property
    def bin_ids(self) -> np.ndarray:
        spb = self.samples_per_bin
        return np.repeat(np.arange(spb.size, dtype=np.int64), spb)

    @cached_property
    def image_counts(self) -> np.ndarray:
        """Per-sample image counts. Shards only record images per bin, so each bin's images are put on its
        first sample: per-bin image statistics are exact, per-sample ones are not available."""
        spb = self.samples_per_bin
        counts = np.zeros(int(spb.sum()), dtype=np.int64)
        images = np.concatenate([s.images_per_bin for s in self.shards] or [np.zeros(0, np.int64)])
        first = np.concatenate(([0], np.cumsum(spb)[:-1])) if spb.size else spb
        nonempty = spb > 0
        counts[first[nonempty]] = images[nonempty]
        return counts


def is_dataset_path(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    """True for a dataset folder/URL or its manifest.json; False for a length file.

    A local path is a dataset when it is a folder (or does not exist and has no suffix); a URL when it ends
    with "/", has no suffix in its last part, or is a folder on its filesystem.
    """
    stripped = path.rstrip("/")
    if stripped.endswith("/" + MANIFEST_NAME) or stripped == MANIFEST_NAME:
        return True
    name = stripped.rsplit("/", 1)[-1]
    if "://" not in path or path.startswith("file://"):
        local = Path(path.removeprefix("file://"))
        if local.exists():
            return local.is_dir()
        return "." not in name
    if path.endswith("/") or "." not in name:
        return True
    try:
        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        return bool(fs.isdir(root))
    except (OSError, ValueError):
        return False


def read_dataset(
    path: str,
    storage_options: dict[str, Any] | None = None,
    *,
    fmt: str | None = None,
    workers: int = 8,
) -> DatasetPacking:
    """Read the manifest and the per-bin metadata of every shard of one format (`fmt`, default: arrow first)."""
    storage_options = storage_options or {}
    root = path.rstrip("/")
    if root.endswith("/" + MANIFEST_NAME) or root == MANIFEST_NAME:
        root = root[: -len(MANIFEST_NAME)].rstrip("/") or "."
    fs, fs_root = fsspec.core.url_to_fs(root, **storage_options)
    if "://" not in root and not Path(root).exists():
        raise StatsInputError(f"{root}: no such dataset folder or length file")
    model = _read_manifest(fs, fs_root, root)
    manifest = model.to_dict()
    formats = model.shard_formats
    fmt = fmt or model.default_format()
    if fmt not in formats:
        raise StatsInputError(f"{root}: dataset has formats {formats}, not {fmt!r}")
    entries = [s.to_dict() for s in model.shards_of(fmt)]
    readers = {"arrow": _read_arrow_shard, "wds": _read_wds_shard}
    if fmt not in readers:
        raise StatsInputError(f"{root}: unknown shard format {fmt!r}")

    def read_one(entry: dict) -> ShardBins:
        shard_path = f"{fs_root}/{entry['path']}"
        try:
            return _read_shard(fs, shard_path, entry, readers[fmt])
        except FileNotFoundError as e:
            raise StatsInputError(f"{root}: shard {entry['path']} listed in the manifest is missing") from e
        except (ValueError, KeyError, tarfile.TarError) as e:
            raise StatsInputError(f"{root}: cannot read shard {entry['path']}: {e}") from e
        except OSError as e:
            raise OSError(f"shard {entry['path']}: {e}") from e

    with ThreadPoolExecutor(max_workers=capped_workers(workers, len(entries))) as pool:
        shards = list(pool.map(read_one, entries))
    capacity = int(manifest["seq_len"])
    packing = DatasetPacking(root, manifest, fmt, capacity, shards)
    packing.warnings.extend(_check_consistency(packing, entries))
    return packing


def _read_manifest(fs: Any, fs_root: str, root: str) -> Manifest:
    manifest_path = f"{fs_root}/{MANIFEST_NAME}"
    try:
        with fs.open(manifest_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise StatsInputError(
            f"{root}: no {MANIFEST_NAME} found; not a packed dataset (or its pack job has not finished)"
        ) from e
    except IsADirectoryError as e:  # pragma: no cover - unusual filesystems
        raise StatsInputError(f"{root}/{MANIFEST_NAME} is a folder") from e
    try:
        return Manifest.from_json(raw, source=f"{root}/{MANIFEST_NAME}")
    except ManifestError as e:
        raise StatsInputError(str(e)) from e


def _read_shard(fs: Any, shard_path: str, entry: dict, reader: Any) -> ShardBins:
    try:
        with fs.open(shard_path, "rb") as f:
            return reader(f, shard_path, entry)
    except ValueError as e:
        if "range" not in str(e):
            raise
    # an HTTP server without range requests: no seeking, so read the whole shard once
    return reader(io.BytesIO(fs.cat_file(shard_path)), shard_path, entry)


def _read_arrow_shard(f: Any, shard_path: str, entry: dict) -> ShardBins:
    import pyarrow as pa
    import pyarrow.compute as pc

    keys: list[str] = []
    lengths, spb, ipb, patches = [], [], [], []
    schema = pa.ipc.open_file(f).schema
    missing = [c for c in _ARROW_COLUMNS if schema.get_field_index(c) < 0]
    if missing:
        raise ValueError(f"columns {missing} missing from the Arrow schema")
    included = [schema.get_field_index(c) for c in _ARROW_COLUMNS]
    has_videos = schema.get_field_index("video_grid_thw") >= 0
    if has_videos:
        included.append(schema.get_field_index("video_grid_thw"))
    reader = pa.ipc.open_file(f, options=pa.ipc.IpcReadOptions(included_fields=included))
    video: list[list[np.ndarray]] = [[], [], []]
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        seq_lens = batch.column("seq_lens")
        keys.extend(batch.column("key").to_pylist())
        lengths.append(pc.list_flatten(seq_lens).to_numpy(zero_copy_only=False))
        spb.append(pc.list_value_length(seq_lens).fill_null(0).to_numpy(zero_copy_only=False))
        n_images, thw = _arrow_grids(batch.column("image_grid_thw"))
        ipb.append(n_images)
        patches.append(_sum_per_bin(np.prod(thw, axis=1), n_images))
        if has_videos:
            n_videos, vthw = _arrow_grids(batch.column("video_grid_thw"))
            video[0].append(n_videos)
            video[1].append(_sum_per_bin(vthw[:, 0], n_videos))
            video[2].append(_sum_per_bin(np.prod(vthw, axis=1), n_videos))
    shard = _shard_bins(shard_path, "arrow", entry, keys, lengths, spb, ipb, patches)
    return _with_videos(shard, video) if has_videos else shard


def _arrow_grids(grids: Any) -> tuple[np.ndarray, np.ndarray]:
    """(grids per bin, int64 [n, 3] grids) of a list<fixed_size_list<int32, 3>> column."""
    import pyarrow.compute as pc

    n = pc.list_value_length(grids).fill_null(0).to_numpy(zero_copy_only=False)
    thw = pc.list_flatten(pc.list_flatten(grids)).to_numpy(zero_copy_only=False).reshape(-1, 3)
    return n, thw.astype(np.int64)


def _with_videos(shard: ShardBins, video: list[list[np.ndarray]]) -> ShardBins:
    from dataclasses import replace

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    return replace(
        shard,
        videos_per_bin=cat(video[0]),
        video_steps_per_bin=cat(video[1]),
        video_patches_per_bin=cat(video[2]),
    )


def _sum_per_bin(per_image: np.ndarray, n_images: np.ndarray) -> np.ndarray:
    bin_of_image = np.repeat(np.arange(n_images.size), n_images.astype(np.int64))
    return np.bincount(bin_of_image, weights=per_image, minlength=n_images.size).astype(np.int64)


def _shard_bins(path, fmt, entry, keys, lengths, spb, ipb, patches) -> ShardBins:
    def cat(parts: list) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    return ShardBins(
        path=str(entry.get("path", path)),
        format=fmt,
        keys=keys,
        sample_lengths=cat(lengths),
        samples_per_bin=cat(spb),
        images_per_bin=cat(ipb),
        image_patches_per_bin=cat(patches),
        size_bytes=int(entry.get("bytes", 0) or 0),
    )


def _read_wds_shard(f: Any, shard_path: str, entry: dict) -> ShardBins:
    records: dict[str, dict[str, Any]] = {}
    wanted = ("json", "seq_lens.npy", "image_grid_thw.npy", "video_grid_thw.npy")
    for name, offset, size in index_tar(f, label=shard_path, non_regular="skip"):
        key, _, suffix = name.rsplit("/", 1)[-1].partition(".")
        if suffix in wanted:  # image and video members are never read
            f.seek(offset)
            records.setdefault(key, {})[suffix] = f.read(size)
    keys, lengths, spb, ipb, patches = [], [], [], [], []
    video: list[list[np.ndarray]] = [[], [], []]
    for key, members in records.items():
        if "seq_lens.npy" not in members:
            raise ValueError(f"bin {key} has no seq_lens.npy member")
        seq_lens = np.load(io.BytesIO(members["seq_lens.npy"]), allow_pickle=False).astype(np.int64)
        grid = np.zeros((0, 3), np.int64)
        if "image_grid_thw.npy" in members:
            grid = np.load(io.BytesIO(members["image_grid_thw.npy"]), allow_pickle=False)
            grid = grid.astype(np.int64).reshape(-1, 3)
        keys.append(key)
        lengths.append(seq_lens.reshape(-1))
        spb.append(np.array([seq_lens.size]))
        ipb.append(np.array([grid.shape[0]]))
        patches.append(np.array([int(np.prod(grid, axis=1).sum())]))
        vgrid = np.zeros((0, 3), np.int64)
        if "video_grid_thw.npy" in members:
            vgrid = np.load(io.BytesIO(members["video_grid_thw.npy"]), allow_pickle=False)
            vgrid = vgrid.astype(np.int64).reshape(-1, 3)
        for part, value in zip(video, (len(vgrid), vgrid[:, 0].sum(), np.prod(vgrid, axis=1).sum())):
            part.append(np.array([int(value)]))
    shard = _shard_bins(shard_path, "wds", entry, keys, lengths, spb, ipb, patches)
    return _with_videos(shard, video)


def _check_consistency(packing: DatasetPacking, entries: list[dict]) -> list[str]:
    """Compare what the shards hold with what the manifest says; mismatches become warnings."""
    warnings = []
    next_bin = 0
    for shard, entry in zip(packing.shards, entries, strict=True):
        got = {
            "bins": shard.samples_per_bin.size,
            "samples": int(shard.samples_per_bin.sum()),
            "tokens": int(shard.sample_lengths.sum()),
            "first_bin": next_bin,
        }
        for name, value in got.items():
            if name in entry and int(entry[name]) != value:
                warnings.append(
                    f"shard {shard.path}: manifest says {name}={entry[name]}, shards hold {value}"
                )
        next_bin += shard.samples_per_bin.size
    counts = packing.manifest.get("counts", {})
    lengths, spb = packing.lengths, packing.samples_per_bin
    total = {"bins": spb.size, "samples_packed": int(spb.sum()), "tokens": int(lengths.sum())}
    for name, value in total.items():
        if name in counts and int(counts[name]) != value:
            warnings.append(f"manifest counts.{name}={counts[name]}, shards hold {value}")
    bin_tokens = np.bincount(packing.bin_ids, weights=lengths, minlength=spb.size)
    if bin_tokens.size and bin_tokens.max() > packing.capacity:
        over = int((bin_tokens > packing.capacity).sum())
        warnings.append(f"{over} bins hold more than seq_len={packing.capacity} tokens")
    keys = [k for s in packing.shards for k in s.keys]
    if len(set(keys)) != len(keys):
        warnings.append(f"{len(keys) - len(set(keys))} duplicate bin keys across shards")
    return warnings
