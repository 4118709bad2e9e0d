"""The list of bins and the sample-id index of a packed dataset: one row per bin (key, tokens, samples, images,
videos, shard), read shard by shard with only the columns a row needs, written as small script files so that
the page loads one page of bins, or one bucket of ids, at a time (from file:// too, where fetch() is not
allowed)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmpack.dataloader.manifest import Manifest
from mmpack.dataloader.readers import open_shard_reader

PAGE_NAME = "bins/p{page:06d}.js"
IDS_NAME = "ids/h{bucket:04d}.js"
_ARROW_COLUMNS = ("key", "seq_lens", "image_grid_thw", "sample_ids")


@dataclass(frozen=True)
class ShardRows:
    """The bins of one shard: a row per bin, the sample ids of each, or why the shard could not be read."""

    index: int  # the shard's index in the manifest's list (of one format)
    first_bin: int
    rows: list[list[Any]]  # [key, tokens, samples, images, videos] per bin
    sample_ids: list[list[str]]
    problem: str | None = None


def shard_rows(root: Path, manifest: Manifest, index: int) -> ShardRows:
    """The rows of shard `index`; a missing or unreadable shard gives no rows and one problem line."""
    entry = manifest.shards[index]
    path = root / entry.path
    try:
        if entry.format == "arrow":
            rows, ids = _arrow_rows(path)
        else:
            rows, ids = _reader_rows(path, entry.format)
    except FileNotFoundError:
        return ShardRows(
            index, entry.first_bin, [], [], f"shard {path} is missing: its {entry.bins} bins are not shown"
        )
    except Exception as e:  # a damaged shard: the others still show
        return ShardRows(
            index, entry.first_bin, [], [], f"shard {path} cannot be read ({e}): its bins are not shown"
        )
    if len(rows) != entry.bins:
        return ShardRows(
            index, entry.first_bin, rows[: entry.bins], ids[: entry.bins],
            f"shard {path} holds {len(rows)} bins, the manifest says {entry.bins}",
        )  # fmt: skip
    return ShardRows(index, entry.first_bin, rows, ids)


def _arrow_rows(path: Path) -> tuple[list[list[Any]], list[list[str]]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    with pa.memory_map(str(path), "r") as source:
        schema = pa.ipc.open_file(source).schema
        names = [c for c in (*_ARROW_COLUMNS, "video_grid_thw") if schema.get_field_index(c) >= 0]
        fields = [schema.get_field_index(c) for c in names]
        reader = pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(included_fields=fields))
        rows: list[list[Any]] = []
        ids: list[list[str]] = []
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            keys = batch.column("key").to_pylist()
            seq = batch.column("seq_lens")
            tokens = _list_sums(seq)
            samples = np.asarray(pc.list_value_length(seq).fill_null(0))
            images = _counts(batch.column("image_grid_thw"))
            videos = (
                _counts(batch.column("video_grid_thw"))
                if "video_grid_thw" in names
                else np.zeros(len(keys), np.int64)
            )
            rows += [
                [k, int(t), int(s), int(i), int(v)]
                for k, t, s, i, v in zip(keys, tokens, samples, images, videos)
            ]
            ids += batch.column("sample_ids").to_pylist()
    return rows, ids


def _counts(col: Any) -> np.ndarray:
    """Items per row of a list column whose items are (t, h, w) triples (fixed-size lists, or flat ints)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    per_item = 1 if pa.types.is_fixed_size_list(col.type.value_type) else 3
    return np.asarray(pc.list_value_length(col).fill_null(0)) // per_item


def _list_sums(col: Any) -> np.ndarray:
    """Sum of each list of an Arrow list column of integers."""
    offsets = np.asarray(col.offsets)
    flat = np.asarray(col.flatten(), dtype=np.int64)
    sums = np.concatenate([[0], np.cumsum(flat)])
    return sums[offsets[1:] - offsets[0]] - sums[offsets[:-1] - offsets[0]]


def _reader_rows(path: Path, fmt: str) -> tuple[list[list[Any]], list[list[str]]]:
    """Any format, through the loader's shard reader (reads each bin whole)."""
    reader = open_shard_reader(str(path), fmt, label=str(path))
    try:
        rows, ids = [], []
        for r in range(len(reader)):
            rec = reader.read(r)
            rows.append(
                [
                    rec["key"],
                    int(np.sum(rec["seq_lens"])),
                    len(rec["seq_lens"]),
                    len(rec["images"]),
                    len(rec["videos"]),
                ]
            )
            ids.append(list(rec["sample_ids"]))
        return rows, ids
    finally:
        reader.close()


def id_hash(sample_id: str) -> int:
    """32-bit FNV-1a of the id's UTF-8 bytes (the page computes the same to find an id's bucket)."""
    h = 0x811C9DC5
    for byte in sample_id.encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def id_buckets(total_samples: int, per_bucket: int = 2000) -> int:
    """How many id files: about `per_bucket` ids each, at most 65536."""
    return max(1, min(65536, -(-total_samples // per_bucket)))


def script(call: str, *args: Any) -> str:
    """A script file's text: one call of the page's `VIEW` object with JSON arguments."""
    body = ",".join(json.dumps(a, separators=(",", ":"), ensure_ascii=False) for a in args)
    return f"VIEW.{call}({body});\n"


class IdIndex:
    """The sample-id index being built: `buckets` tables of {sample id: bin}."""

    def __init__(self, buckets: int, rename: Callable[[str], str] = str) -> None:
        self.buckets = buckets
        self.rename = rename
        self.tables: list[dict[str, int]] = [{} for _ in range(buckets)]
        self.count = 0

    def add(self, sr: ShardRows) -> None:
        for i, ids in enumerate(sr.sample_ids):
            for sid in map(self.rename, ids):
                self.tables[id_hash(sid) % self.buckets][sid] = sr.first_bin + i
                self.count += 1

    def write(self, out: Path) -> None:
        for b, entries in enumerate(self.tables):
            _write(out / IDS_NAME.format(bucket=b), script("ids", b, entries))


def write_pages(
    out: Path, root: Path, manifest: Manifest, page_size: int, ids: IdIndex, problems: list[str]
) -> Iterator[int]:
    """Read the shards in order and write the pages of bins in global order (a missing shard's bins as rows
    with no key), adding every sample id to `ids` and every unreadable shard to `problems`; yields the number of
    bins listed after each page."""
    buffer: list[list[Any]] = []
    page = done = 0
    for index, entry in enumerate(manifest.shards):
        sr = shard_rows(root, manifest, index)
        if sr.problem:
            problems.append(sr.problem)
        ids.add(sr)
        for i in range(entry.bins):
            row = sr.rows[i] if i < len(sr.rows) else [None, 0, 0, 0, 0]
            buffer.append([entry.first_bin + i, *row, index])
            if len(buffer) == page_size:
                _write(out / PAGE_NAME.format(page=page), script("page", page, buffer))
                page, done, buffer = page + 1, done + len(buffer), []
                yield done
    if buffer or page == 0:
        _write(out / PAGE_NAME.format(page=page), script("page", page, buffer))
        yield done + len(buffer)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
